"""The trainer's step as a fixed-shape program: one CUDA graph replay per micro-batch.

Why: the eager step queues ~50k kernels from Python (HF modules, autograd, the LoRA routing), so
its time follows the host's speed: the same 4-job step took 1.05 s and 1.77 s on two H200 hosts
of one kind (session 9), the graphed step 1.16 s on the slower one, and an 8-job step with nothing
beside it went from 3.75 s to 2.11 s inside a run. Captured once, a micro-batch's forward, loss,
backward and gradient accumulation replay as one launch.

A graph needs fixed shapes and fixed buffers, so here every micro-batch is [R rows, T tokens]
(``static_plan``): T one of a few bucket widths (``bucket_widths``: the run's widest row, then
0.85x steps down), R = the micro-batch token budget // T (half that for a step's last rows when
they fit), rows longest first, the last micro-batch topped up with empty rows. On the H200's recorded rows one width for all padded a step 2.2x and
made it slower than eager; the buckets pad ~9% more than the eager planner at 8 jobs. Every
program of a trainer shares one adapter stack and gradient accumulators (``StaticState``) and
one CUDA memory pool (they never run at once and keep nothing there between replays). Each row's
job is an input (its slot in the stack, the masked layout of ``real.multilora``), and so is
everything the loss reads, per token: logprobs are computed at every position, and each job's
GRPO loss is the weighted sum of its tokens' clipped surrogates that ``real.grpo_loss`` defines
(the weights of ``loss_token_weights``, 0 off the job's completion tokens), so a job's loss and
gradient are the eager path's up to summation order. Padding rows and positions weigh 0: they add
exactly 0 to every gradient.

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
WIDTH_QUANTUM = 16  # micro-batch widths are multiples of this
BUCKET_RATIO = 0.85  # each narrower width bucket is this fraction of the last
MIN_WIDTH = 32  # no narrower bucket (short rows share it)


@dataclass(frozen=True)
class StaticKey:
    """What a captured micro-batch program is specialised to."""

    rows: int  # R
    width: int  # T
    slots: int  # adapters in the stack (the step's jobs, or more: empty slots)
    rank: int  # the stack's rank (the step's largest)
    kl: bool  # whether any job has a KL term (beta != 0)


def bucket_widths(top: int) -> list[int]:
    """The widths micro-batches pad to, widest first: ``top``, then each ``BUCKET_RATIO`` of the
    last (rounded up to ``WIDTH_QUANTUM``) down to ``MIN_WIDTH``. A row pads to the narrowest that
    holds it, so padding stays under 1 / BUCKET_RATIO - 1 of a row."""
    widths = [top]
    while True:
        w = -(-int(widths[-1] * BUCKET_RATIO) // WIDTH_QUANTUM) * WIDTH_QUANTUM
        if w < MIN_WIDTH or w >= widths[-1]:
            return widths
        widths.append(w)


def static_plan(lengths: list[list[int]], max_tokens: int,
                width_hint: int | None = None) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """(R, T, rows) per micro-batch: rows (job k, sequence s) longest first; a micro-batch starts
    at the next row, pads to the narrowest bucket width T that holds it (``bucket_widths`` of the
    step's longest row rounded up, or of ``width_hint`` when no row is longer: one set of widths
    for every step of a run) and takes the next R = max_tokens // T rows (shorter ones)."""
    rows = sorted(((k, s) for k, ls in enumerate(lengths) for s in range(len(ls))),
                  key=lambda ks: (-lengths[ks[0]][ks[1]], ks))
    longest = lengths[rows[0][0]][rows[0][1]]
    top = -(-longest // WIDTH_QUANTUM) * WIDTH_QUANTUM
    if width_hint is not None and width_hint >= longest:
        top = width_hint
    widths = bucket_widths(top)
    plan, i = [], 0
    while i < len(rows):
        n = lengths[rows[i][0]][rows[i][1]]
        width = min(w for w in widths if w >= n)
        per = program_rows(max_tokens, width, len(rows) - i)
        plan.append((per, width, rows[i:i + per]))
        i += per
    return plan


def program_rows(max_tokens: int, width: int, left: int | None = None) -> int:
    """Rows of the program a micro-batch of ``width`` takes: max_tokens // width, or half that for
    the step's last rows when they fit in half (a half-empty last micro-batch would cost a whole
    one). ``left`` None: the full count."""
    full = max(1, max_tokens // width)
    return full // 2 if left is not None and full >= 2 and left <= full // 2 else full


class StaticState:
    """What every program of one (slots, rank) shares within a step: the adapter stack the wrapped
    layers read (``AdapterStack``'s attributes) and the step's accumulated gradients, per-job
    losses and audit sums."""

    def __init__(self, shapes: dict[str, tuple[int, int]], slots: int, rank: int, device, dtype, fdt):
        self.slots, self.max_rank = slots, rank
        self.A = {n: torch.zeros(slots, rank, d_in, device=device, dtype=dtype, requires_grad=True)
                  for n, (d_in, _) in shapes.items()}
        self.B = {n: torch.zeros(slots, d_out, rank, device=device, dtype=dtype, requires_grad=True)
                  for n, (_, d_out) in shapes.items()}
        self.scaling = torch.zeros(slots, device=device, dtype=dtype)
        self.grads = [torch.zeros_like(t) for t in self.leaves()]
        self.loss = torch.zeros(slots, dtype=torch.float64, device=device)
        self.audit_max = torch.zeros(slots, dtype=fdt, device=device)
        self.audit_sum = torch.zeros(slots, dtype=torch.float64, device=device)

    def leaves(self) -> list[torch.Tensor]:
        return [t for n in self.A for t in (self.A[n], self.B[n])]

    @torch.no_grad()
    def zero(self) -> None:
        torch._foreach_zero_(self.grads + [self.loss, self.audit_max, self.audit_sum])

    @torch.no_grad()
    def load(self, adapters: list) -> None:
        """The step's adapters into slots 0.., empty slots and padded ranks zero."""
        torch._foreach_zero_(self.leaves())
        dst, src = [], []
        for j, a in enumerate(adapters):
            for n in a.A:
                dst += [self.A[n][j, :a.rank], self.B[n][j, :, :a.rank]]
                src += [a.A[n].detach(), a.B[n].detach()]
        torch._foreach_copy_(dst, src)
        scaling = torch.zeros(self.slots, dtype=self.scaling.dtype)
        scaling[:len(adapters)] = torch.tensor([a.scaling for a in adapters], dtype=self.scaling.dtype)
        self.scaling.copy_(scaling)

    def write_grads(self, adapters: list) -> None:
        """Each job's parameters get their slot's accumulated gradient."""
        grads = dict(zip([id(t) for t in self.leaves()], self.grads))
        for j, a in enumerate(adapters):
            for n in a.A:
                a.A[n].grad = grads[id(self.A[n])][j, :a.rank].clone()
                a.B[n].grad = grads[id(self.B[n])][j, :, :a.rank].clone()


class StaticStep:
    """One micro-batch program of shape ``key`` over a shared ``StaticState``: captured as a CUDA
    graph (``pool``: the memory pool every program of the trainer shares; they never run at once
    and keep nothing in it between replays), or plainly run with ``capture=False``."""

    def __init__(self, trainer, key: StaticKey, state: StaticState, capture: bool, pool=None):
        self.key, self.trainer, self.state = key, trainer, state
        dev, R, T = trainer.device, key.rows, key.width
        fdt = trainer.logp_dtype
        self.ids = torch.zeros(2, R, T, dtype=torch.int64, device=dev)  # [input ids, next token]
        self.local = torch.zeros(R, dtype=torch.int64, device=dev)
        self.tok = torch.zeros(len(_TOKEN_CHANNELS), R, T, dtype=fdt, device=dev)
        self.row = torch.zeros(len(_ROW_CHANNELS), R, dtype=fdt, device=dev)
        self.layout = RowLayout(num_rows=R, slots=None, rows_per_slot=R, dest_rows=None,
                                local_slot=self.local, num_local=key.slots)
        self.graph = None
        if capture:
            self._capture(pool)

    # --- the program --------------------------------------------------------------------------

    def _body(self) -> None:
        t, key, st = self.trainer, self.key, self.state
        routing = t.routing
        routing.stack, routing.layout = st, self.layout
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
            grads = torch.autograd.grad(per_job.sum(), st.leaves(), allow_unused=True)
            used = [(acc, g) for acc, g in zip(st.grads, grads) if g is not None]
            torch._foreach_add_([a for a, _ in used], [g for _, g in used])
            st.loss.index_add_(0, self.local, per_row.detach().to(torch.float64))
            audited = ch["audit_mask"] > 0
            diff = torch.where(audited, (lp.detach() - ch["audit"]).abs(), torch.zeros_like(lp))
            st.audit_max.scatter_reduce_(0, self.local, diff.amax(dim=1), "amax")
            st.audit_sum.index_add_(0, self.local, diff.sum(dim=1).to(torch.float64))
        finally:
            routing.stack = routing.layout = None

    def _capture(self, pool) -> None:
        """Warm up on a side stream (compiles, kernel and cuDNN plan choices), then capture. The
        warm-up adds to the shared accumulators: the step zeroes them before its first replay."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self._body()
        # The warm-up's blocks are free now; hand them back (the graph keeps its own pool).
        torch.cuda.empty_cache()

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body()

    @torch.no_grad()
    def put(self, ids: np.ndarray, local: np.ndarray, tok: np.ndarray, row: np.ndarray) -> None:
        """One micro-batch's inputs into the fixed buffers (stream-ordered, host not blocked)."""
        pin = self.ids.device.type == "cuda"
        for dst, src in ((self.ids, ids), (self.local, local), (self.tok, tok), (self.row, row)):
            src = torch.from_numpy(src).to(dst.dtype)
            dst.copy_(src.pin_memory() if pin else src, non_blocking=pin)


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
