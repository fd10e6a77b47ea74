"""The trainer's step as a fixed-shape program: one CUDA graph replay per micro-batch.

Why: the eager step is host-bound. Session 6's profile of an 8-job step: 51k kernels, the GPU busy
1.5 s of the step's wall time, the rest Python (HF modules, autograd, the LoRA routing) queueing
kernels. Captured once, a micro-batch's forward, loss, backward and gradient accumulation replay
as one launch.

A graph needs fixed shapes and fixed buffers, so here every micro-batch of a step is [R rows, T
tokens] (``static_plan``): T is the step's longest row rounded up (or the width the trainer was
told to expect), R rows per micro-batch, the last one topped up with empty rows. Each row's job is
an input (its slot in a stack of ``slots`` adapters, the masked layout of ``real.multilora``), and
so is everything the loss reads, per token: logprobs are computed at every position, and each
job's GRPO loss is the weighted sum of its tokens' clipped surrogates that ``real.grpo_loss``
defines (the weights of ``loss_token_weights``, 0 off the job's completion tokens), so a job's
loss and gradient are the eager path's up to summation order. Padding rows and positions weigh 0:
they add exactly 0 to every gradient.

The same program runs without capture (``capture=False``): that is how a CPU checks it against the
eager path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from real.grpo_loss import token_logprobs
from real.multilora import RowLayout

# Float inputs per token, laid out [channel, R, T] (one host-to-device copy).
_TOKEN_CHANNELS = ("weight", "old", "ref", "audit", "audit_mask")
# Float inputs per row, [channel, R].
_ROW_CHANNELS = ("advantage", "eps_low", "eps_high", "beta", "on_policy", "has_ref")
WIDTH_QUANTUM = 16  # a step's width is rounded up to a multiple of this (fewer distinct graphs)


@dataclass(frozen=True)
class StaticKey:
    """What a captured micro-batch program is specialised to."""

    rows: int  # R
    width: int  # T
    slots: int  # adapters in the stack (the step's jobs, or more: empty slots)
    rank: int  # the stack's rank (the step's largest)
    kl: bool  # whether any job has a KL term (beta != 0)


def static_plan(lengths: list[list[int]], max_tokens: int, width_hint: int | None = None) -> tuple[int, int, list]:
    """(R, T, micro-batches): rows (job k, sequence s) longest first, R per micro-batch.

    T: the longest row rounded up to ``WIDTH_QUANTUM``, or ``width_hint`` when no row is longer
    (one width for every step of a run). R: as many micro-batches as ``max_tokens`` padded tokens
    each needs, the rows spread evenly over them."""
    rows = sorted(((k, s) for k, ls in enumerate(lengths) for s in range(len(ls))),
                  key=lambda ks: (-lengths[ks[0]][ks[1]], ks))
    longest = max(lengths[k][s] for k, s in rows)
    width = -(-longest // WIDTH_QUANTUM) * WIDTH_QUANTUM
    if width_hint is not None and width_hint >= longest:
        width = width_hint
    n_mb = max(1, math.ceil(len(rows) * width / max_tokens))
    per = math.ceil(len(rows) / n_mb)
    return per, width, [rows[i:i + per] for i in range(0, len(rows), per)]


class _Stack:
    """Fixed adapter stacks the wrapped layers read (``AdapterStack``'s attributes), loaded per step."""

    def __init__(self, shapes: dict[str, tuple[int, int]], slots: int, rank: int, device, dtype):
        self.max_rank = rank
        self.A = {n: torch.zeros(slots, rank, d_in, device=device, dtype=dtype, requires_grad=True)
                  for n, (d_in, _) in shapes.items()}
        self.B = {n: torch.zeros(slots, d_out, rank, device=device, dtype=dtype, requires_grad=True)
                  for n, (_, d_out) in shapes.items()}
        self.scaling = torch.zeros(slots, device=device, dtype=dtype)

    def leaves(self) -> list[torch.Tensor]:
        return [t for n in self.A for t in (self.A[n], self.B[n])]


class StaticStep:
    """One captured (or, with ``capture=False``, plainly run) micro-batch program of a trainer."""

    def __init__(self, trainer, key: StaticKey, capture: bool):
        self.key, self.trainer = key, trainer
        dev, R, T = trainer.device, key.rows, key.width
        fdt = trainer.logp_dtype
        self.stack = _Stack(trainer.shapes, key.slots, key.rank, dev, trainer.param_dtype)
        self.ids = torch.zeros(2, R, T, dtype=torch.int64, device=dev)  # [input ids, next token]
        self.local = torch.zeros(R, dtype=torch.int64, device=dev)
        self.tok = torch.zeros(len(_TOKEN_CHANNELS), R, T, dtype=fdt, device=dev)
        self.row = torch.zeros(len(_ROW_CHANNELS), R, dtype=fdt, device=dev)
        self.grads = [torch.zeros_like(t) for t in self.stack.leaves()]
        self.loss = torch.zeros(key.slots, dtype=torch.float64, device=dev)
        self.audit_max = torch.zeros(key.slots, dtype=fdt, device=dev)
        self.audit_sum = torch.zeros(key.slots, dtype=torch.float64, device=dev)
        self.layout = RowLayout(num_rows=R, slots=None, rows_per_slot=R, dest_rows=None,
                                local_slot=self.local, num_local=key.slots)
        self.graph = None
        if capture:
            self._capture()
        self.zero()

    # --- the program --------------------------------------------------------------------------

    def _body(self) -> None:
        t, key = self.trainer, self.key
        routing = t.routing
        routing.stack, routing.layout = self.stack, self.layout
        try:
            hidden = t.decoder(input_ids=self.ids[0], use_cache=False).last_hidden_state
            weight = t.model.get_output_embeddings().weight
            lp = token_logprobs(hidden.reshape(-1, hidden.shape[-1]), weight, self.ids[1].reshape(-1),
                                t.logprob_chunk_tokens).reshape(key.rows, key.width)
            ch = dict(zip(_TOKEN_CHANNELS, self.tok))
            rw = {n: v[:, None] for n, v in zip(_ROW_CHANNELS, self.row)}
            mask = ch["weight"] > 0
            # per_token_loss with each row's own settings; an on-policy row's old logprobs are its
            # own (ratio exactly 1, the gradient of logp kept), as there.
            old = torch.where(rw["on_policy"] > 0, lp.detach(), ch["old"])
            ratio = torch.exp(lp - old)
            clipped = torch.clamp(ratio, 1.0 - rw["eps_low"], 1.0 + rw["eps_high"])
            per_token = -torch.min(ratio * rw["advantage"], clipped * rw["advantage"])
            if key.kl:
                # A row without a KL term compares with itself: 0, and a finite 0 gradient.
                ref = torch.where(rw["has_ref"] > 0, ch["ref"], lp.detach())
                log_ref_ratio = ref - lp
                per_token = per_token + rw["beta"] * (torch.exp(log_ref_ratio) - log_ref_ratio - 1.0)
            per_row = torch.where(mask, per_token * ch["weight"], torch.zeros_like(per_token)).sum(dim=1)
            per_job = torch.zeros(key.slots, dtype=per_row.dtype, device=per_row.device).index_add(
                0, self.local, per_row)
            grads = torch.autograd.grad(per_job.sum(), self.stack.leaves(), allow_unused=True)
            used = [(acc, g) for acc, g in zip(self.grads, grads) if g is not None]
            torch._foreach_add_([a for a, _ in used], [g for _, g in used])
            self.loss.index_add_(0, self.local, per_row.detach().to(torch.float64))
            audited = ch["audit_mask"] > 0
            diff = torch.where(audited, (lp.detach() - ch["audit"]).abs(), torch.zeros_like(lp))
            self.audit_max.scatter_reduce_(0, self.local, diff.amax(dim=1), "amax")
            self.audit_sum.index_add_(0, self.local, diff.sum(dim=1).to(torch.float64))
        finally:
            routing.stack = routing.layout = None

    def _capture(self) -> None:
        """Warm up on a side stream (compiles, kernel and cuDNN plan choices), then capture."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._body()
        # The warm-up's blocks are free now; hand them back (the graph keeps its own pool).
        torch.cuda.empty_cache()

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body()

    # --- per step -----------------------------------------------------------------------------

    @torch.no_grad()
    def zero(self) -> None:
        torch._foreach_zero_(self.grads + [self.loss, self.audit_max, self.audit_sum])

    @torch.no_grad()
    def load(self, adapters: list) -> None:
        """The step's adapters into slots 0.., empty slots and padded ranks zero."""
        st = self.stack
        leaves = st.leaves()
        torch._foreach_zero_(leaves)
        dst, src = [], []
        for j, a in enumerate(adapters):
            for n in a.A:
                dst += [st.A[n][j, :a.rank], st.B[n][j, :, :a.rank]]
                src += [a.A[n].detach(), a.B[n].detach()]
        torch._foreach_copy_(dst, src)
        scaling = torch.zeros(self.key.slots, dtype=st.scaling.dtype)
        scaling[:len(adapters)] = torch.tensor([a.scaling for a in adapters], dtype=st.scaling.dtype)
        st.scaling.copy_(scaling)

    @torch.no_grad()
    def put(self, ids: np.ndarray, local: np.ndarray, tok: np.ndarray, row: np.ndarray) -> None:
        """One micro-batch's inputs into the fixed buffers (stream-ordered, host not blocked)."""
        pin = self.ids.device.type == "cuda"
        for dst, src in ((self.ids, ids), (self.local, local), (self.tok, tok), (self.row, row)):
            src = torch.from_numpy(src).to(dst.dtype)
            dst.copy_(src.pin_memory() if pin else src, non_blocking=pin)

    def write_grads(self, adapters: list) -> None:
        """Each job's parameters get their slot's accumulated gradient."""
        st = self.stack
        grads = dict(zip([id(t) for t in st.leaves()], self.grads))
        for j, a in enumerate(adapters):
            for n in a.A:
                a.A[n].grad = grads[id(st.A[n])][j, :a.rank].clone()
                a.B[n].grad = grads[id(st.B[n])][j, :, :a.rank].clone()


def microbatch_inputs(mb: list[tuple[int, int]], key: StaticKey, seqs, configs) -> tuple[np.ndarray, ...]:
    """Host arrays for one micro-batch of (slot, sequence) rows: ids [2, R, T] (tokens, next
    tokens), each row's slot [R], per-token floats [channels, R, T] and per-row floats [channels, R]
    (``_TOKEN_CHANNELS`` / ``_ROW_CHANNELS``), in float64."""
    R, T = key.rows, key.width
    ids = np.zeros((2, R, T), dtype=np.int64)
    local = np.zeros(R, dtype=np.int64)
    tok = np.zeros((len(_TOKEN_CHANNELS), R, T))
    row = np.zeros((len(_ROW_CHANNELS), R))
    c = {n: i for i, n in enumerate(_TOKEN_CHANNELS)}
    r = {n: i for i, n in enumerate(_ROW_CHANNELS)}
    for i, (k, s) in enumerate(mb):
        sq, cfg = seqs[k], configs[k]
        seq, pos = sq.ids[s], sq.positions[s]
        ids[0, i, :len(seq)] = seq
        ids[1, i, :len(seq) - 1] = seq[1:]
        local[i] = k
        at = pos - 1  # the token at t is predicted at position t-1
        tok[c["weight"], i, at] = token_weight(cfg, sq, len(pos))
        if sq.old is not None:
            tok[c["old"], i, at] = sq.old[s]
        if sq.ref is not None:
            tok[c["ref"], i, at] = sq.ref[s]
        if sq.audit is not None:
            tok[c["audit"], i, at] = sq.audit[s]
            tok[c["audit_mask"], i, at] = 1.0
        row[r["advantage"], i] = sq.advantages[s]
        row[r["eps_low"], i] = cfg.epsilon_low
        row[r["eps_high"], i] = cfg.epsilon_high
        row[r["beta"], i] = cfg.beta
        row[r["on_policy"], i] = float(sq.old is None)
        row[r["has_ref"], i] = float(sq.ref is not None and cfg.beta != 0.0)
    return ids, local, tok, row


def token_weight(cfg, seqs, n_tokens: int) -> float:
    """A completion token's weight in its job's loss (``real.grpo_loss.loss_token_weights`` with the
    whole step's counts), for a sequence of ``n_tokens`` completion tokens."""
    num_seqs = len(seqs.ids)
    if cfg.loss_type == "grpo":
        return 1.0 / (max(n_tokens, 1) * num_seqs)
    if cfg.loss_type in ("bnpo", "dapo"):
        return 1.0 / max(seqs.completion_tokens, 1)
    longest = cfg.max_completion_length or max(len(p) for p in seqs.positions)
    return 1.0 / (num_seqs * max(longest, 1))
