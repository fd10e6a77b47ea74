"""The trainer's step as fixed-shape programs: per micro-batch, the decoder's forward and its
backward each one CUDA graph replay, the loss between them eager.

Why: the eager step queues ~50k kernels from Python (HF modules, autograd, the LoRA routing), so
its time follows the host's speed: the same 4-job step took 1.05 s and 1.77 s on two H200 hosts
of one kind (session 9), the graphed step 1.16 s on the slower one, and an 8-job step with nothing
beside it went from 3.75 s to 2.11 s inside a run.

A graph needs fixed shapes and fixed buffers, so here every micro-batch is [R rows, T tokens]
(``static_plan``): T one of a few bucket widths (``bucket_widths``: the run's widest row, then
0.85x steps down), R = the micro-batch token budget // T (half that for a step's last rows when
they fit), rows longest first, the last micro-batch topped up with empty rows. On the H200's
recorded rows one width for all padded a step 2.2x and made it slower than eager; the buckets pad
~8% more than the eager planner. Each row's job is an input (its slot in the adapter stack, the
masked layout of ``real.multilora``). The loss runs eagerly on the micro-batch's completion tokens
only (its shape follows them; ~100 kernels): session 9's first version computed logprobs at every
padded position inside the graph, 26-28% more FLOPs than the eager step, which under MPS beside
the engine, where the GPU is the limit, bought nothing. Each job's GRPO loss is the weighted sum of
its tokens' clipped surrogates that ``real.grpo_loss`` defines (the weights of
``loss_token_weights``), so its loss and gradient are the eager path's up to summation order;
padding rows and positions get exactly zero gradient. Every program of a trainer shares one
adapter stack and gradient accumulators (``StaticState``) and one CUDA memory pool (they run one
at a time).

The same parts run without capture (``capture=False``): that is how a CPU checks them against the
eager path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from real.grpo_loss import per_token_loss, token_logprobs
from real.multilora import RowLayout, give_slot_grads

# Float inputs per completion token, laid out [channel, M]: its loss weight, old / reference /
# audit logprobs, and its job's settings.
_TOKEN_CHANNELS = ("weight", "old", "ref", "audit", "audit_mask", "advantage", "eps_low", "eps_high", "beta",
                   "on_policy", "has_ref")
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
    shared: bool = False  # rows are prompt groups (``prompt_groups``): positions and segments are inputs


def round_width(tokens: float) -> int:
    """``tokens`` rounded up to a multiple of ``WIDTH_QUANTUM``."""
    return -(-int(tokens) // WIDTH_QUANTUM) * WIDTH_QUANTUM


def bucket_widths(top: int) -> list[int]:
    """The widths micro-batches pad to, widest first: ``top``, then each ``BUCKET_RATIO`` of the
    last (rounded up to ``WIDTH_QUANTUM``) down to ``MIN_WIDTH``. A row pads to the narrowest that
    holds it, so padding stays under 1 / BUCKET_RATIO - 1 of a row."""
    widths = [top]
    while True:
        w = round_width(widths[-1] * BUCKET_RATIO)
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
    top = round_width(longest)
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


def prompt_groups(ids: list[np.ndarray], positions: list[np.ndarray], most: int) -> list[list[int]]:
    """One job's sequences grouped by identical prompt (the tokens before a sequence's first
    completion token), in order of first appearance, at most ``most`` sequences a group: the rows
    of the shared-prompt layout, where a group's prompt runs through the model once and each of its
    sequences' completions attends to it (``packed_row``). A sequence without completion tokens
    stays alone."""
    groups: dict[bytes, list[list[int]]] = {}
    order: list[list[int]] = []
    for s, (row, pos) in enumerate(zip(ids, positions)):
        if not len(pos):
            order.append([s])
            continue
        key = row[:pos[0]].tobytes()
        chunks = groups.setdefault(key, [])
        if not chunks or len(chunks[-1]) >= most:
            chunks.append([])
            order.append(chunks[-1])
        chunks[-1].append(s)
    return order


def packed_length(ids: list[np.ndarray], positions: list[np.ndarray], group: list[int]) -> int:
    """Tokens of a group's packed row: its prompt once, then each sequence's tokens after it."""
    prompt = _prompt_length(ids, positions, group[0])
    return prompt + sum(len(ids[s]) - prompt for s in group)


def _prompt_length(ids, positions, s) -> int:
    return int(positions[s][0]) if len(positions[s]) else len(ids[s])


def packed_row(ids: list[np.ndarray], positions: list[np.ndarray], group: list[int]):
    """A group's packed row: tokens, position ids (a sequence's tokens keep the positions they have
    alone), segment ids (0 the prompt, j + 1 the j-th sequence's part) and, per sequence, the
    packed index of the hidden state that predicts each of its completion tokens (its own index
    t - 1, or the prompt's, which every sequence of the group shares)."""
    prompt = _prompt_length(ids, positions, group[0])
    toks, pos, seg, predict = [ids[group[0]][:prompt]], [np.arange(prompt)], [np.zeros(prompt, np.int64)], []
    offset = prompt
    for j, s in enumerate(group):
        part = ids[s][prompt:]
        toks.append(part)
        pos.append(np.arange(prompt, prompt + len(part)))
        seg.append(np.full(len(part), j + 1, dtype=np.int64))
        q = positions[s] - 1  # the index (in the sequence alone) predicting each completion token
        predict.append(np.where(q < prompt, q, offset + q - prompt))
        offset += len(part)
    return np.concatenate(toks), np.concatenate(pos), np.concatenate(seg), predict


def shared_prompt_mask(seg: torch.Tensor) -> torch.Tensor:
    """[R, 1, T, T] bool (True: attend) from segment ids [R, T] (-1: padding): a token attends to
    the earlier tokens of its own segment and to its row's prompt (segment 0), so each sequence
    of a packed row sees what it sees alone; a padding position attends only to itself (its output
    is never read, and a row of its scores is never empty)."""
    T = seg.shape[1]
    idx = torch.arange(T, device=seg.device)
    causal = idx[None, :] <= idx[:, None]
    sq, sk = seg[:, :, None], seg[:, None, :]
    mask = causal & ((sk == 0) | (sk == sq)) & (sq >= 0)
    return (mask | (idx[None, :] == idx[:, None]))[:, None]


class StaticState:
    """What every program of one (slots, rank) shares within a step: the adapter stack the wrapped
    layers read (``AdapterStack``'s attributes ``A``, ``B``, ``scaling``, ``max_rank``) and the
    step's accumulated gradients, per-job losses and audit sums.

    The stack is held in the decoder's dtype and in the layout the masked path multiplies by
    (per module ``A_flat`` [slots * rank, d_in], ``B_flat`` [d_out, slots * rank]; ``A`` and ``B``
    are [slots, rank, d_in] / [slots, d_out, rank] views of them): the adapters are cast once per
    step in ``load``, not in every layer of every micro-batch (the eager path's fp32 stack cost 14
    cast and 14 permute-copy kernels per layer and micro-batch on the H200, ~12% of the graphed
    step's kernels). The values are the same: the eager path casts the same fp32 weights to the
    same dtype, and each micro-batch's gradient, computed in that dtype, is accumulated in the
    adapters' dtype as autograd does there."""

    def __init__(self, shapes: dict[str, tuple[int, int]], slots: int, rank: int, device, dtype, fdt,
                 compute_dtype=None):
        self.slots, self.max_rank = slots, rank
        cdt = compute_dtype or dtype
        self.A_flat = {n: torch.zeros(slots * rank, d_in, device=device, dtype=cdt, requires_grad=True)
                       for n, (d_in, _) in shapes.items()}
        self.B_flat = {n: torch.zeros(d_out, slots * rank, device=device, dtype=cdt, requires_grad=True)
                       for n, (_, d_out) in shapes.items()}
        as_a = (lambda t: t.view(slots, rank, -1))  # [slots, rank, d_in]
        as_b = (lambda t: t.view(-1, slots, rank).permute(1, 0, 2))  # [slots, d_out, rank]
        self.A, self.B = _Views(self.A_flat, as_a), _Views(self.B_flat, as_b)
        self.scaling = torch.zeros(slots, device=device, dtype=dtype)
        # The step's gradients in the adapters' dtype, in the flat layout.
        grad_a = {n: torch.zeros_like(t, dtype=dtype) for n, t in self.A_flat.items()}
        grad_b = {n: torch.zeros_like(t, dtype=dtype) for n, t in self.B_flat.items()}
        self.grads = [t for n in grad_a for t in (grad_a[n], grad_b[n])]  # in leaves() order
        self.grad_A, self.grad_B = _Views(grad_a, as_a), _Views(grad_b, as_b)
        self.loss = torch.zeros(slots, dtype=torch.float64, device=device)
        self.audit_max = torch.zeros(slots, dtype=fdt, device=device)
        self.audit_sum = torch.zeros(slots, dtype=torch.float64, device=device)

    def leaves(self) -> list[torch.Tensor]:
        return [t for n in self.A_flat for t in (self.A_flat[n], self.B_flat[n])]

    @torch.no_grad()
    def zero(self) -> None:
        torch._foreach_zero_(self.grads + [self.loss, self.audit_max, self.audit_sum])

    @torch.no_grad()
    def load(self, adapters: list) -> None:
        """The step's adapters into slots 0.. (cast to the stack's dtype), empty slots and padded
        ranks zero."""
        for t in self.leaves():
            t.zero_()
        for j, a in enumerate(adapters):
            for n in a.A:
                self.A[n][j, :a.rank].copy_(a.A[n].detach())
                self.B[n][j, :, :a.rank].copy_(a.B[n].detach())
        scaling = torch.zeros(self.slots, dtype=self.scaling.dtype)
        scaling[:len(adapters)] = torch.tensor([a.scaling for a in adapters], dtype=self.scaling.dtype)
        self.scaling.copy_(scaling)

    def write_grads(self, adapters: list) -> None:
        """Each job's parameters get their slot's accumulated gradient (copies: the accumulators
        serve the next step)."""
        give_slot_grads(adapters, self.grad_A, self.grad_B, copy=True)


class _Views:
    """``views[name]``: a fresh view of ``tensors[name]`` (made at each use, so that no view made
    once outlives an in-place update of its base)."""

    def __init__(self, tensors: dict[str, torch.Tensor], view):
        self._tensors, self._view = tensors, view

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._view(self._tensors[name])

    def __iter__(self):
        return iter(self._tensors)


class StaticStep:
    """One micro-batch program of shape ``key`` over a shared ``StaticState``.

    Three parts: the decoder's forward over the fixed [R, T] rows (a CUDA graph), the loss on the
    micro-batch's completion tokens only (eager: its shape follows the tokens, and its ~100
    kernels are few), and the decoder's backward from the loss's gradient on the hidden states,
    accumulating the adapters' gradients (a CUDA graph). Logprobs at every position instead would
    cost 26-28% more FLOPs than the eager step (the vocabulary matmuls at every padded position).
    ``pool``: the CUDA memory pool every program of the trainer shares (they run one at a time);
    ``capture=False`` runs the same three parts plainly (how a CPU checks them)."""

    def __init__(self, trainer, key: StaticKey, state: StaticState, capture: bool, pool=None):
        self.key, self.trainer, self.state = key, trainer, state
        dev, R, T = trainer.device, key.rows, key.width
        self.ids = torch.zeros(R, T, dtype=torch.int64, device=dev)
        self.local = torch.zeros(R, dtype=torch.int64, device=dev)
        # The shared-prompt layout's position and segment ids (``packed_row``; None: plain rows).
        self.pos = torch.zeros(R, T, dtype=torch.int64, device=dev) if key.shared else None
        self.seg = torch.full((R, T), -1, dtype=torch.int64, device=dev) if key.shared else None
        weight = trainer.model.get_output_embeddings().weight
        self.grad_hidden = torch.zeros(R, T, weight.shape[1], dtype=weight.dtype, device=dev)
        self.hidden: torch.Tensor | None = None  # the forward's output (fixed when captured)
        self.layout = RowLayout(num_rows=R, slots=None, rows_per_slot=R, dest_rows=None,
                                local_slot=self.local, num_local=key.slots)
        self.forward_graph = self.backward_graph = None
        if capture:
            self._capture(pool)

    # --- the program --------------------------------------------------------------------------

    def _forward(self) -> None:
        routing = self.trainer.routing
        routing.stack, routing.layout = self.state, self.layout
        try:
            if self.seg is None:
                self.hidden = self.trainer.decoder(input_ids=self.ids, use_cache=False).last_hidden_state
            else:
                mask = shared_prompt_mask(self.seg)
                self.hidden = self.trainer.decoder(input_ids=self.ids, position_ids=self.pos, use_cache=False,
                                                   attention_mask={"full_attention": mask}).last_hidden_state
        finally:
            routing.stack = routing.layout = None

    def _backward(self) -> None:
        st = self.state
        grads = torch.autograd.grad(self.hidden, st.leaves(), grad_outputs=self.grad_hidden, allow_unused=True)
        used = [(acc, g) for acc, g in zip(st.grads, grads) if g is not None]
        torch._foreach_add_([a for a, _ in used], [g for _, g in used])

    def _loss(self, inputs: dict) -> None:
        """The micro-batch's GRPO loss on its completion tokens (flat, [M]); its gradient on the
        hidden states into ``grad_hidden``; per-job loss and audit sums into the state."""
        t, st = self.trainer, self.state
        hs = self.hidden.detach().requires_grad_()
        h = hs.reshape(-1, hs.shape[-1]).index_select(0, inputs["index"])
        lp = token_logprobs(h, t.model.get_output_embeddings().weight, inputs["targets"], t.logprob_chunk_tokens)
        ch = dict(zip(_TOKEN_CHANNELS, inputs["floats"]))
        slot = inputs["slot"]
        # Each token with its own job's settings. An on-policy token's old logprob is its own
        # (what old_logp=None means); a token without a KL term compares with itself (0, and a
        # finite 0 gradient).
        old = torch.where(ch["on_policy"] > 0, lp.detach(), ch["old"])
        ref = torch.where(ch["has_ref"] > 0, ch["ref"], lp.detach()) if inputs["kl"] else None
        per_token = per_token_loss(lp, old, ch["advantage"], ch["eps_low"], ch["eps_high"], ref,
                                   ch["beta"] if inputs["kl"] else 0.0)
        weighted = per_token * ch["weight"]
        per_job = torch.zeros(self.key.slots, dtype=weighted.dtype, device=weighted.device).index_add(0, slot, weighted)
        (grad,) = torch.autograd.grad(per_job.sum(), hs, allow_unused=True)
        with torch.no_grad():
            if grad is None:  # no completion token in the micro-batch
                self.grad_hidden.zero_()
            else:
                self.grad_hidden.copy_(grad)
            st.loss.add_(per_job.detach().to(torch.float64))
            diff = torch.where(ch["audit_mask"] > 0, (lp.detach() - ch["audit"]).abs(), torch.zeros_like(lp))
            st.audit_max.scatter_reduce_(0, slot, diff, "amax")
            st.audit_sum.index_add_(0, slot, diff.to(torch.float64))

    def _capture(self, pool) -> None:
        """Warm up on a side stream (compiles, kernel and cuDNN plan choices), then capture the
        forward and, on the autograd graph that capture built, the backward. The warm-up adds to
        the shared gradients: the step zeroes them before its first replay."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward()
                self._backward()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward_graph, pool=pool):
            self._forward()
        with torch.cuda.graph(self.backward_graph, pool=pool):
            self._backward()
        # The warm-up's blocks are free now; hand them back (the graphs keep their pool).
        torch.cuda.empty_cache()

    def run(self, inputs: dict) -> None:
        """One micro-batch (``microbatch_inputs`` put on the device by ``put``)."""
        if self.forward_graph is not None:
            self.forward_graph.replay()
        else:
            self._forward()
        self._loss(inputs)
        if self.backward_graph is not None:
            self.backward_graph.replay()
        else:
            self._backward()

    @torch.no_grad()
    def put(self, host: dict) -> dict:
        """The micro-batch's rows into the fixed buffers and its completion tokens' inputs onto
        the device (stream-ordered, host not blocked); returns the latter for ``run``."""
        pin = self.ids.device.type == "cuda"
        fdt = self.trainer.logp_dtype

        def dev(a, dtype):
            t = torch.from_numpy(a).to(dtype)
            return t.pin_memory().to(self.ids.device, non_blocking=True) if pin else t.to(self.ids.device)

        self.ids.copy_(dev(host["ids"], torch.int64), non_blocking=pin)
        self.local.copy_(dev(host["local"], torch.int64), non_blocking=pin)
        if self.seg is not None:
            self.pos.copy_(dev(host["pos"], torch.int64), non_blocking=pin)
            self.seg.copy_(dev(host["seg"], torch.int64), non_blocking=pin)
        return {"index": dev(host["index"], torch.int64), "targets": dev(host["targets"], torch.int64),
                "slot": dev(host["slot"], torch.int64), "floats": dev(host["floats"], fdt), "kl": host["kl"]}


def microbatch_inputs(mb: list[tuple[int, int]], key: StaticKey, seqs, configs, groups=None) -> dict:
    """Host arrays for one micro-batch of (slot, sequence) rows: the rows' tokens ``ids`` [R, T]
    and slots ``local`` [R]; for each completion token, its position in the flat [R * T] hidden
    states that predicts it (``index``), the token (``targets``), its job's slot (``slot``) and
    ``floats`` [channels, M] (``_TOKEN_CHANNELS``: its loss weight, logprobs and its job's
    settings), in float64; ``kl``: whether any of them has a KL term. With ``groups`` (per job, its
    ``prompt_groups``) a row (slot, r) is the packed row of group r, and ``pos`` / ``seg`` [R, T]
    are its position and segment ids (padding: segment -1)."""
    R, T = key.rows, key.width
    ids = np.zeros((R, T), dtype=np.int64)
    local = np.zeros(R, dtype=np.int64)
    pos_ids = np.zeros((R, T), dtype=np.int64) if groups is not None else None
    seg_ids = np.full((R, T), -1, dtype=np.int64) if groups is not None else None
    index, targets, slot, floats = [], [], [], []
    kl = False
    c = {name: j for j, name in enumerate(_TOKEN_CHANNELS)}
    units = []  # (row, slot, sequence, packed index predicting each completion token)
    for i, (k, r) in enumerate(mb):
        sq = seqs[k]
        local[i] = k
        if groups is None:
            seq = sq.ids[r]
            ids[i, :len(seq)] = seq
            units.append((i, k, r, sq.positions[r] - 1))  # the token at t is predicted at position t-1
            continue
        toks, pos, seg, predict = packed_row(sq.ids, sq.positions, groups[k][r])
        ids[i, :len(toks)], pos_ids[i, :len(toks)], seg_ids[i, :len(toks)] = toks, pos, seg
        units += [(i, k, s, q) for s, q in zip(groups[k][r], predict)]
    for i, k, s, predict in units:
        sq, cfg = seqs[k], configs[k]
        seq, pos = sq.ids[s], sq.positions[s]
        n = len(pos)
        index.append(i * T + predict)
        targets.append(seq[pos])
        slot.append(np.full(n, k, dtype=np.int64))
        has_ref = sq.ref is not None and cfg.beta != 0.0
        kl |= has_ref
        f = np.zeros((len(_TOKEN_CHANNELS), n))
        f[c["weight"]] = token_weight(cfg, sq, n)
        if sq.old is not None:
            f[c["old"]] = sq.old[s]
        if has_ref:
            f[c["ref"]] = sq.ref[s]
        if sq.audit is not None and sq.audit[s] is not None:  # None: a sequence left out of the audit
            f[c["audit"]] = sq.audit[s]
            f[c["audit_mask"]] = 1.0
        f[c["advantage"]] = sq.advantages[s]
        f[c["eps_low"]], f[c["eps_high"]], f[c["beta"]] = cfg.epsilon_low, cfg.epsilon_high, cfg.beta
        f[c["on_policy"]] = float(sq.old is None)
        f[c["has_ref"]] = float(has_ref)
        floats.append(f)
    cat = (lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype))
    out = {"ids": ids, "local": local, "index": cat(index, np.int64), "targets": cat(targets, np.int64),
           "slot": cat(slot, np.int64), "floats": np.concatenate(floats, axis=1) if floats
           else np.zeros((len(_TOKEN_CHANNELS), 0)), "kl": kl}
    if groups is not None:
        out["pos"], out["seg"] = pos_ids, seg_ids
    return out


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
