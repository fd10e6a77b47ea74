"""The one trainer: a frozen base model, one LoRA adapter and one AdamW per job, shared batches.

``train_step`` takes several jobs' rollouts and runs them through the base model together
(``real.multilora`` applies each row's own adapter). Each job's update is exactly the update it
would get alone: the summed loss is the sum of per-job losses, each normalised over the job's own
sequences/tokens of the whole step (not of a micro-batch), and since the jobs' parameters are
disjoint, d(sum)/d(job's params) is that job's own gradient. Then per job: its own grad-norm
clipping, its own AdamW (``torch.optim.AdamW``) with its own learning rate. A job whose loss or
grad norm is not finite is not stepped and is reported failed; the others step normally (rows
never mix in a transformer without batch-norm, so one job's NaN stays in that job's grads).

Rows are right-padded and run without an attention mask: under causal attention real tokens
never look at the padding after them, and no mask lets SDPA use its flash kernel.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import torch
from torch import nn
from torch.profiler import record_function

from nodus.microbatch import plan_microbatches  # noqa: F401 (re-exported)
from real.grpo_loss import LOSS_TYPES, LossType, aggregate_loss, per_token_loss, token_logprobs
from real.flat_adapter import ADAPTER_FORMATS
from real.graphed import (StaticKey, StaticState, StaticStep, bucket_widths, microbatch_inputs, packed_length,
                          program_rows, prompt_groups, static_plan)
from real.multilora import (DEFAULT_TARGET_MODULES, Adapter, AdapterStack, Routing, RowLayout, init_adapter,
                            make_row_layout, save_flat_adapter, save_peft_adapter, wrap_linears)


@dataclass
class JobBatch:
    """One job's rollouts for one step.

    A right-padded 2-D tensor is accepted for the token fields; each row is trimmed after its
    last completion token (left-padded prompts are not supported: pads would be attended to).
    """

    input_ids: Sequence[Sequence[int]] | torch.Tensor  # per sequence: prompt + completion token ids
    completion_mask: Sequence[Sequence[int]] | torch.Tensor  # same shape; 1 where the token is trained on
    advantages: Sequence[float] | torch.Tensor  # one per sequence
    old_logprobs: Sequence[Sequence[float]] | None = None  # per sequence, one per masked-in token; None: on-policy
    ref_logprobs: Sequence[Sequence[float]] | None = None  # same; used if the job's beta > 0 (None: base model)


@dataclass(frozen=True)
class StepStats:
    """One job's outcome of one train_step."""

    loss: float  # the job's aggregated loss (nan/inf if that is why it failed)
    grad_norm: float  # total L2 norm of the job's LoRA grads before clipping
    tokens: int  # prompt + completion tokens of the job's sequences
    completion_tokens: int  # tokens the loss is computed on
    failed: bool  # True: not stepped, params and optimizer state unchanged
    step: int  # optimizer steps the job has taken after this call


@dataclass(frozen=True)
class JobConfig:
    """A job's adapter shape, optimizer and loss settings (names as in PEFT / torch / TRL)."""

    rank: int
    alpha: float
    lr: float
    seed: int
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    loss_type: LossType = "grpo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0  # KL coefficient to the base model; 0 turns the KL term off
    max_completion_length: int | None = None  # dr_grpo's constant; None: longest completion of the step


@dataclass
class _Job:
    config: JobConfig
    adapter: Adapter
    optimizer: torch.optim.AdamW
    generator: torch.Generator
    step: int = 0


@dataclass
class _Seqs:
    """A JobBatch validated into flat numpy form."""

    ids: list[np.ndarray]  # per sequence, int64 tokens (trimmed after the last completion token)
    positions: list[np.ndarray]  # per sequence, indices of completion tokens
    advantages: np.ndarray  # [S] float
    old: list[np.ndarray] | None
    ref: list[np.ndarray] | None
    # Logprobs to compare the training forward's against, per sequence (None: that sequence not audited).
    audit: list[np.ndarray | None] | None = None

    @property
    def audited_tokens(self) -> int:
        """Completion tokens with an audit logprob."""
        if self.audit is None:
            return 0
        return int(sum(len(p) for p, a in zip(self.positions, self.audit) if a is not None))

    @property
    def completion_tokens(self) -> int:
        return int(sum(len(p) for p in self.positions))


@dataclass
class _JobSpan:
    """One job's rows within a micro-batch, with its loss inputs laid out [rows, width]."""

    slot: int  # the job's index in the step (its slot in the adapter stack)
    rows: list[int]  # the job's sequence indices, in row order
    start: int  # first of its completion tokens in the micro-batch's flat logprob vector
    end: int
    index: tuple[torch.Tensor, torch.Tensor]  # (row, column) of each of those tokens
    mask: torch.Tensor  # [rows, width] bool
    advantages: torch.Tensor  # [rows]
    old: torch.Tensor | None  # [rows, width] old logprobs, or None (on-policy)
    ref: torch.Tensor | None  # [rows, width] reference logprobs, or None
    audit: torch.Tensor | None = None  # [rows, width] logprobs to audit against, or None
    # [rows, width] bool: the audited tokens, when only some of the rows are audited (None: all of them).
    audit_mask: torch.Tensor | None = None


@dataclass
class _MicroBatch:
    """Device tensors for one job-major micro-batch."""

    input_ids: torch.Tensor  # [R, T] right-padded
    hidden_index: torch.Tensor  # [M] flat position (row * T + t - 1) predicting each completion token
    targets: torch.Tensor  # [M] the completion tokens
    layout: RowLayout
    spans: list[_JobSpan]


STEP_MODES = ("eager", "static", "graphed")


def _as_rows(x) -> list:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def _validate(job_id: str, batch: JobBatch, vocab_size: int) -> _Seqs:
    ids_rows, mask_rows = _as_rows(batch.input_ids), _as_rows(batch.completion_mask)
    adv = np.asarray(_as_rows(batch.advantages), dtype=np.float64)
    if not (len(ids_rows) == len(mask_rows) == len(adv)) or not ids_rows:
        raise ValueError(f"job {job_id!r}: input_ids ({len(ids_rows)}), completion_mask ({len(mask_rows)}) and "
                         f"advantages ({len(adv)}) must have the same number (>= 1) of sequences")
    ids, positions = [], []
    for s, (row, m) in enumerate(zip(ids_rows, mask_rows)):
        row, m = np.asarray(row, dtype=np.int64), np.asarray(m, dtype=bool)
        if row.shape != m.shape:
            raise ValueError(f"job {job_id!r} sequence {s}: {len(row)} tokens but {len(m)} mask entries")
        pos = np.flatnonzero(m)
        if len(pos) and pos[0] == 0:
            raise ValueError(f"job {job_id!r} sequence {s}: the first token has no context to be predicted from")
        row = row[: pos[-1] + 1] if len(pos) else row[:1]
        if row.min() < 0 or row.max() >= vocab_size:
            raise ValueError(f"job {job_id!r} sequence {s}: token ids must be in [0, {vocab_size})")
        ids.append(row)
        positions.append(pos)
    return _Seqs(ids, positions, adv, _per_token(job_id, "old_logprobs", batch.old_logprobs, positions),
                 _per_token(job_id, "ref_logprobs", batch.ref_logprobs, positions))


def _per_token(job_id, field_name, values, positions, optional_rows: bool = False) -> list[np.ndarray] | None:
    """One float64 array per sequence, one value per completion token; ``optional_rows``: a
    sequence's entry may be None (none for it: the audit of a sample of the responses)."""
    if values is None:
        return None
    rows = [None if v is None and optional_rows else np.asarray(v, dtype=np.float64).reshape(-1)
            for v in _as_rows(values)]
    if len(rows) != len(positions) or any(r is not None and len(r) != len(p) for r, p in zip(rows, positions)):
        raise ValueError(f"job {job_id!r}: {field_name} needs one value per completion token of each sequence")
    if all(r is None for r in rows):
        return None
    return rows


class MultiLoRATrainer:
    """A frozen causal LM (any HF model with get_decoder / get_output_embeddings and a plain
    lm_head, Qwen3 in practice) shared by many jobs' LoRA adapters."""

    def __init__(self, base_model: nn.Module, target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 param_dtype: torch.dtype = torch.float32, max_tokens_per_microbatch: int = 32768,
                 logprob_chunk_tokens: int = 2048, gradient_checkpointing: bool = False,
                 base_model_name_or_path: str | None = None, lora_layout: str = "masked",
                 step_mode: str = "eager", graph_width: int | None = None, share_prompts: int = 0):
        """``lora_layout``: how each row reaches its own adapter in a mixed micro-batch —
        "masked" (every adapter's A at once, other adapters' columns zeroed; dense GEMMs, no
        regrouping, J_mb * rank extra inner columns), "padded" (rows regrouped per adapter into a
        padded [J, rows, d] batch for bmm), or "auto" (masked in a layer while J_mb * rank <=
        d_in / 8). Same function. On the H200, 8 jobs of rank 16 on the Qwen3-0.6B shape,
        masked ran 48.4k tokens/s against padded's 39.9k, at 64 against 91 GiB peak
        (`experiments/results/h200/session3/bench_trainer_h200.json`).

        ``step_mode``: "eager", "graphed" (each micro-batch one CUDA graph replay, ``real.graphed``;
        masked layout, no gradient checkpointing, a GPU), or "static" (the graphed path's fixed-shape
        program run without capture, for checking it on a CPU). ``graph_width``: the widest bucket the
        fixed-shape path pads rows to when they fit (one set of programs for a run's steps;
        ``prepare_static`` sets it and captures the programs up front).

        ``share_prompts`` (the fixed-shape modes, "static" and "graphed"; 0 or 1: off): a job's
        sequences with the same prompt, up to this many, go through the model as one row, the
        prompt once and each sequence's completion after it, attending to the prompt and to itself
        only (``real.graphed.packed_row``): the same logprobs and gradients with the prompt's
        tokens computed once instead of once per response (GRPO samples several responses a
        prompt). Attention then runs with an explicit mask (SDPA's masked kernels, not flash)."""
        if step_mode not in STEP_MODES:
            raise ValueError(f"step_mode={step_mode!r}; expected one of {STEP_MODES}")
        if step_mode == "graphed" and not torch.cuda.is_available():
            raise ValueError("step_mode='graphed' needs a CUDA device (use 'static' to run its program on a CPU)")
        if dtype is not None or device is not None:
            base_model.to(device=device, dtype=dtype)
        base_model.requires_grad_(False)
        self.model = base_model
        self.device = next(base_model.parameters()).device
        # Logprobs and the loss in at least fp32 (fp64 if the model is fp64, for exactness tests).
        self.logp_dtype = torch.promote_types(next(base_model.parameters()).dtype, torch.float32)
        self.target_modules = tuple(target_modules)
        self.param_dtype = param_dtype
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.last_microbatches = 0  # micro-batches of the last train_step
        self.last_rows = 0  # rows the model ran in the last train_step (packed prompt groups count once)
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.base_model_name_or_path = base_model_name_or_path
        self.routing = Routing(lora_layout)
        self.step_mode = step_mode
        self.graph_width = graph_width
        # Whether this trainer runs the fixed-shape step, the one that can pack prompts (a capture
        # that fails later falls back to eager for good: rows are then plain, graph_error says why).
        self._fixed_shape = step_mode != "eager" and lora_layout == "masked" and not gradient_checkpointing
        self._packing_checked = False  # the decoder was seen to honour a packed row's mask
        self.share_prompts = 0
        self.graph_error: str | None = None  # why a capture failed (the step then ran eager)
        self._static: dict[StaticKey, StaticStep] = {}  # every program built (they share one memory pool)
        self.build_s: dict[str, float] = {}  # seconds each program took to build (capture included)
        self._states: dict[tuple[int, int], StaticState] = {}  # (slots, rank) -> shared stack + accumulators
        self._pool = None  # the CUDA graph memory pool the programs share
        self.gradient_checkpointing = gradient_checkpointing
        self.shapes = wrap_linears(base_model, self.target_modules, self.routing)
        self.decoder = base_model.get_decoder()
        self.vocab_size = base_model.get_output_embeddings().weight.shape[0]
        if gradient_checkpointing:
            # Non-reentrant: the wrapped layers read self.routing, which stays set during backward.
            base_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            base_model.train()  # HF only checkpoints in training mode; Qwen3 has no dropout
        else:
            base_model.eval()
        self.jobs: dict[str, _Job] = {}
        self.set_share_prompts(share_prompts)

    def set_share_prompts(self, share: int) -> None:
        """``share_prompts`` (the constructor's), checked: a run's own setting, per train step."""
        if not (isinstance(share, int) and not isinstance(share, bool) and share >= 0):
            raise ValueError(f"share_prompts={share!r}: sequences a packed row holds, an integer >= 0 "
                             f"(0 or 1: no sharing)")
        if share > 1:
            if not self._fixed_shape:
                raise ValueError(f"share_prompts={share} packs each prompt's responses into one row, which the "
                                 "fixed-shape step does: step_mode 'static' or 'graphed', lora_layout 'masked', no "
                                 "gradient checkpointing")
            if not self._packing_checked:
                _check_shared_prompt_model(self.model, self.decoder)
                self._packing_checked = True
        self.share_prompts = share

    # --- jobs -------------------------------------------------------------------------------

    def add_job(self, job_id: str, rank: int, alpha: float, lr: float, seed: int, weight_decay: float = 0.0,
                max_grad_norm: float = 1.0, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                loss_type: LossType = "grpo", epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                beta: float = 0.0, max_completion_length: int | None = None) -> None:
        """Register a job with a fresh PEFT-initialised adapter (seeded) and a fresh AdamW."""
        if job_id in self.jobs:
            raise ValueError(f"job {job_id!r} already exists")
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={loss_type!r} must be one of {LOSS_TYPES}")
        if rank < 1:
            raise ValueError(f"rank={rank} must be >= 1")
        config = JobConfig(rank, alpha, lr, seed, weight_decay, max_grad_norm, tuple(betas), eps, loss_type,
                           epsilon_low, epsilon_high, beta, max_completion_length)
        generator = torch.Generator().manual_seed(seed)
        adapter = init_adapter(self.shapes, rank, alpha, generator, self.device, self.param_dtype)
        optimizer = torch.optim.AdamW(adapter.parameters(), lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay)
        self.jobs[job_id] = _Job(config, adapter, optimizer, generator)

    def remove_job(self, job_id: str) -> None:
        self._job(job_id)
        del self.jobs[job_id]

    def set_lr(self, job_id: str, lr: float) -> None:
        for group in self._job(job_id).optimizer.param_groups:
            group["lr"] = lr

    def adapter(self, job_id: str) -> Adapter:
        return self._job(job_id).adapter

    def _job(self, job_id: str) -> _Job:
        if job_id not in self.jobs:
            raise KeyError(f"unknown job {job_id!r}; known: {sorted(self.jobs)}")
        return self.jobs[job_id]

    # --- training ---------------------------------------------------------------------------

    def train_step(self, batches: dict[str, JobBatch],
                   audit: dict[str, list] | None = None) -> dict[str, StepStats]:
        """One optimizer step for every job in ``batches``, all in shared micro-batches.

        ``audit`` (job -> per sequence, one logprob per completion token, e.g. the engine's of the
        sampled tokens, or None for a sequence left out of the audit): compared against the training
        forward's own logprobs, which are the job's pre-update adapter's, at no extra forward; the
        result is left in ``last_audit`` (job -> max_abs, mean_abs)."""
        self.last_audit: dict[str, dict[str, float]] = {}
        if not batches:
            return {}
        job_ids = list(batches)
        jobs = [self._job(j) for j in job_ids]
        seqs = [_validate(j, batches[j], self.vocab_size) for j in job_ids]
        for j, s in zip(job_ids, seqs):
            if audit and audit.get(j) is not None:
                try:
                    s.audit = _per_token(j, "audit logprobs", audit[j], s.positions, optional_rows=True)
                except ValueError:  # the audit is a diagnostic: a malformed one never stops training
                    s.audit = None
        audit_acc = {k: [] for k, s in enumerate(seqs) if s.audit is not None}
        for job, s in zip(jobs, seqs):
            if job.config.beta != 0.0 and s.ref is None:
                s.ref = self._base_logprobs(s)
        losses = None
        if self._static_wanted():
            with record_function("nodus.forward_backward"):
                losses = self._backward_static(jobs, seqs, audit_acc)
            if losses is None and self.graph_error is not None:
                # Built inside this step, the dropped programs lived on in _backward_static's frame
                # until it returned: their memory goes back only now.
                self._free_memory()
        plan = None
        if losses is None:
            plan = self._plan(seqs)
            with record_function("nodus.forward_backward"):
                losses = self._backward(plan, jobs, seqs, audit_acc)
        with record_function("nodus.clip"):
            norms = [self._clip(job) for job in jobs]
        finite = [math.isfinite(float(loss)) and math.isfinite(n) for loss, n in zip(losses, norms)]
        if self.routing.mixed_masked and not all(finite):
            # On the masked path a job's non-finite gradient reaches the other adapters of its
            # micro-batches (0 * nan in their B gradients). Faults are rare: redo the step's
            # gradients on the padded path, which keeps every adapter's rows apart.
            for job in jobs:
                job.optimizer.zero_grad(set_to_none=True)
            audit_acc = {k: [] for k in audit_acc}
            mode, self.routing.layout_mode = self.routing.layout_mode, "padded"
            try:
                losses = self._backward(plan or self._plan(seqs), jobs, seqs, audit_acc)
            finally:
                self.routing.layout_mode = mode
            norms = [self._clip(job) for job in jobs]
        for k, parts in audit_acc.items():
            if parts:
                t = torch.stack(parts).double().cpu()
                self.last_audit[job_ids[k]] = {"max_abs": float(t[:, 0].max()),
                                               "mean_abs": float(t[:, 1].sum() / t[:, 2].sum())}
        with record_function("nodus.optimizer"):
            return {j: self._apply_update(job, s, loss, norm)
                    for j, job, s, loss, norm in zip(job_ids, jobs, seqs, losses, norms)}

    def _plan(self, seqs: list[_Seqs]) -> list["_MicroBatch"]:
        # Everything copied to the device up front: a copy between kernels would make the host
        # wait for the GPU, and the GPU then idle while the host queues the next kernels.
        with record_function("nodus.prepare"):
            plan = [self._prepare(mb, seqs) for mb in
                    plan_microbatches([[len(r) for r in s.ids] for s in seqs], self.max_tokens_per_microbatch)]
        self.last_microbatches = len(plan)
        self.last_rows = sum(len(s.ids) for s in seqs)
        return plan

    @property
    def programs(self) -> list[StaticKey]:
        """The fixed-shape programs built so far (captured ones when graphed)."""
        return list(self._static)

    def _static_wanted(self) -> bool:
        return (self.step_mode != "eager" and self.routing.layout_mode == "masked"
                and not self.gradient_checkpointing)

    def _static_state(self, slots: int, rank: int) -> StaticState:
        """The shared stack and accumulators of at least ``slots`` adapters of rank ``rank``: a
        kept one (a run's smaller steps reuse it and its programs), or a new one."""
        fits = [k for k in self._states if k[0] >= slots and k[1] >= rank]
        if fits:
            return self._states[min(fits)]
        # As many slots as any earlier state: a later step of fewer jobs fits the new one too.
        key = (max([slots] + [k[0] for k in self._states]), rank)
        self._states[key] = StaticState(self.shapes, *key, self.device, self.param_dtype, self.logp_dtype,
                                        compute_dtype=self.model.get_output_embeddings().weight.dtype)
        return self._states[key]

    def _static_step(self, key: StaticKey, state: StaticState) -> StaticStep | None:
        """The fixed-shape program for ``key``: kept, or built (captured when graphed). A capture
        that fails leaves the trainer eager (``graph_error`` says why) instead of failing the step."""
        st = self._static.get(key)
        if st is None:
            try:
                if self.step_mode == "graphed" and self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                t0 = time.perf_counter()
                st = StaticStep(self, key, state, capture=self.step_mode == "graphed", pool=self._pool)
                # What building the programs costs (the warm-up's capture time, per program).
                self.build_s[str(key)] = round(time.perf_counter() - t0, 3)
            except Exception as err:  # noqa: BLE001
                import sys
                import traceback

                self.graph_error = f"{type(err).__name__}: {err}"
                self.step_mode = "eager"
                self.routing.stack = self.routing.layout = None
                print(f"[trainer] CUDA graph capture failed, training eager: {self.graph_error}\n"
                      f"{traceback.format_exc()}", file=sys.stderr)
            if st is None:  # out of the except block: its traceback no longer holds the failed build
                self._release_static()
                return None
            self._static[key] = st
        return st

    def _release_static(self) -> None:
        """Drop every fixed-shape program, their shared stacks and graph memory pool, and give the
        memory back, for the eager step that follows a failed capture: the programs captured before
        it held their pool (~30 GiB at 16k-token micro-batches on the H200), and the eager step ran
        out of memory beside it (session 23, two trainers of a timeslice arm). The jobs' adapters and
        optimizer state live with the jobs, not here: nothing of a job is lost. (``build_s`` keeps
        what the builds cost.)"""
        self._static.clear()
        self._states.clear()
        self._pool = None
        self._free_memory()

    @staticmethod
    def _free_memory() -> None:
        """Collect what nothing references any more and give the allocator's cached GPU memory back,
        for the other processes on the GPU (an engine, another stack's trainer)."""
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def prepare_static(self, slots: int, rank: int, width: int, packed_width: int | None = None) -> list[StaticKey]:
        """Build (capture, when graphed) now every program a run's steps of up to ``slots`` jobs of
        rank <= ``rank`` and rows of <= ``width`` tokens will use, so none is captured inside a
        timed step; later steps pad to ``width``'s buckets. With ``share_prompts`` the rows are
        packed prompt groups: ``packed_width`` (their widest, a prompt plus ``share_prompts``
        completions) replaces ``width``. Returns the programs' keys."""
        if not self._static_wanted():
            return []
        shared = self.share_prompts > 1
        if shared:
            if packed_width is None:
                raise ValueError("prepare_static: share_prompts packs a prompt group into one row; give "
                                 "packed_width, the widest such row")
            width = packed_width
        self.graph_width = width
        state = self._static_state(slots, rank)
        mb = self.max_tokens_per_microbatch
        keys = [StaticKey(rows=rows, width=w, slots=state.slots, rank=state.max_rank, shared=shared)
                for w in bucket_widths(width)
                for rows in sorted({program_rows(mb, w), program_rows(mb, w, left=0)}, reverse=True)]
        for key in keys:
            if self._static_step(key, state) is None:
                del state  # the failed build's stacks, held here past the release: given back too
                self._free_memory()
                return []
        return keys

    def _backward_static(self, jobs, seqs, audit_acc) -> list[torch.Tensor] | None:
        """``_backward`` as fixed-shape micro-batches (``real.graphed``); None: run eager instead."""
        shared = self.share_prompts > 1
        groups = None
        if shared:  # rows are prompt groups (their packed lengths), not sequences
            groups = [prompt_groups(s.ids, s.positions, self.share_prompts) for s in seqs]
            lengths = [[packed_length(s.ids, s.positions, g) for g in gs] for s, gs in zip(seqs, groups)]
        else:
            lengths = [[len(r) for r in s.ids] for s in seqs]
        plan = static_plan(lengths, self.max_tokens_per_microbatch, self.graph_width)
        state = self._static_state(len(jobs), max(j.adapter.rank for j in jobs))
        adapters, configs = [j.adapter for j in jobs], [j.config for j in jobs]
        programs = []
        for R, T, _ in plan:
            st = self._static_step(StaticKey(rows=R, width=T, slots=state.slots, rank=state.max_rank,
                                             shared=shared), state)
            if st is None:
                return None
            programs.append(st)
        state.zero()
        state.load(adapters)
        for st, (_, _, rows) in zip(programs, plan):
            with record_function("nodus.prepare"):
                inputs = st.put(microbatch_inputs(rows, st.key, seqs, configs, groups))
            with record_function("nodus.forward"):
                st.run(inputs)
        state.write_grads(adapters)
        self.last_microbatches = len(plan)
        self.last_rows = sum(len(rows) for _, _, rows in plan)
        self.routing.mixed_masked = len(jobs) > 1
        for k in audit_acc:
            n = float(seqs[k].audited_tokens)
            audit_acc[k].append(torch.stack([state.audit_max[k].double(), state.audit_sum[k],
                                             state.audit_sum.new_tensor(n)]))
        return [state.loss[k].clone() for k in range(len(jobs))]

    def _backward(self, plan, jobs, seqs, audit_acc) -> list[torch.Tensor]:
        """Forward and backward over every micro-batch; each job's loss and its grads in place."""
        losses = [torch.zeros((), dtype=torch.float64, device=self.device) for _ in jobs]
        stack = AdapterStack([job.adapter for job in jobs], requires_grad=True)
        self.routing.stack = stack
        self.routing.mixed_masked = False
        try:
            for mb in plan:
                with record_function("nodus.forward"):
                    logp = self._forward_logprobs(mb)
                total = logp.new_zeros(())
                for span in mb.spans:
                    k = span.slot
                    loss = self._job_loss(jobs[k].config, seqs[k], span, logp[span.start:span.end])
                    if span.audit is not None and span.end > span.start:
                        d = (logp[span.start:span.end].detach() - span.audit[span.index]).abs()
                        if span.audit_mask is None:
                            audit_acc[k].append(torch.stack([d.max(), d.sum(), d.new_tensor(d.numel())]))
                        else:  # only the audited sequences' tokens; no host sync (a mask, not a selection)
                            m = span.audit_mask[span.index]
                            d = torch.where(m, d, torch.zeros_like(d))
                            audit_acc[k].append(torch.stack([d.max(), d.sum(), m.sum().to(d.dtype)]))
                    losses[k] += loss.detach().to(torch.float64)
                    total = total + loss
                with record_function("nodus.backward"):
                    total.backward()
        finally:
            self.routing.stack = self.routing.layout = None
        stack.write_grads()
        return losses

    @staticmethod
    def _clip(job: _Job) -> float:
        """Clip the job's grads to its max norm; the norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(job.adapter.parameters(), job.config.max_grad_norm))

    def _job_loss(self, cfg: JobConfig, seqs: _Seqs, span: "_JobSpan", logp: torch.Tensor) -> torch.Tensor:
        """The job's loss over its rows of one micro-batch, normalised by the whole step's counts."""
        lp = logp.new_zeros(span.mask.shape).index_put(span.index, logp)
        ptl = per_token_loss(lp, span.old, span.advantages, cfg.epsilon_low, cfg.epsilon_high, span.ref, cfg.beta)
        longest = cfg.max_completion_length or max(len(p) for p in seqs.positions)
        return aggregate_loss(ptl, span.mask, cfg.loss_type, num_seqs=len(seqs.ids),
                              num_tokens=seqs.completion_tokens, max_completion_length=longest)

    def _apply_update(self, job: _Job, seqs: _Seqs, loss: torch.Tensor, grad_norm: float) -> StepStats:
        loss_value = float(loss)
        failed = not (math.isfinite(loss_value) and math.isfinite(grad_norm))
        if not failed:
            job.optimizer.step()
            job.step += 1
        job.optimizer.zero_grad(set_to_none=True)
        return StepStats(loss=loss_value, grad_norm=grad_norm, tokens=int(sum(len(r) for r in seqs.ids)),
                         completion_tokens=seqs.completion_tokens, failed=failed, step=job.step)

    # --- forward ----------------------------------------------------------------------------

    def _prepare(self, mb: list[tuple[int, int]], seqs: list[_Seqs]) -> "_MicroBatch":
        """Device tensors for one job-major micro-batch of rows (slot k, sequence s)."""
        width = max(len(seqs[k].ids[s]) for k, s in mb)
        ids = np.zeros((len(mb), width), dtype=np.int64)  # pad id 0: its outputs are never read
        hidden_idx, targets = [], []
        for i, (k, s) in enumerate(mb):
            row, pos = seqs[k].ids[s], seqs[k].positions[s]
            ids[i, : len(row)] = row
            hidden_idx.append(i * width + pos - 1)  # the token at t is predicted from position t-1
            targets.append(row[pos])
        spans, offset = [], 0
        for k in sorted({k for k, _ in mb}):
            rows = [s for kk, s in mb if kk == k]
            spans.append(self._span(k, rows, seqs[k], offset))
            offset = spans[-1].end
        return _MicroBatch(
            input_ids=self._put(torch.from_numpy(ids)),
            hidden_index=self._put(torch.from_numpy(np.concatenate(hidden_idx))),
            targets=self._put(torch.from_numpy(np.concatenate(targets))),
            layout=make_row_layout([k for k, _ in mb], "cpu", len(seqs)).to(self._put),
            spans=spans)

    def _span(self, slot: int, rows: list[int], seqs: _Seqs, start: int) -> "_JobSpan":
        lengths = [len(seqs.positions[s]) for s in rows]
        width = max(max(lengths), 1)
        r_idx = torch.from_numpy(np.repeat(np.arange(len(rows)), lengths))
        c_idx = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths]).astype(np.int64))
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        mask[r_idx, c_idx] = True

        def padded(values):
            if values is None:
                return None
            out = torch.zeros(len(rows), width, dtype=self.logp_dtype)
            out[r_idx, c_idx] = torch.from_numpy(np.concatenate([values[s] for s in rows])).to(self.logp_dtype)
            return self._put(out)

        audit = audit_mask = None
        if seqs.audit is not None:  # a sequence left out of the audit (None) counts zeros, masked off
            audit = padded([np.zeros(len(seqs.positions[s])) if a is None else a for s, a in enumerate(seqs.audit)])
            if any(seqs.audit[s] is None for s in rows):
                audit_mask = torch.zeros(len(rows), width, dtype=torch.bool)
                for i, s in enumerate(rows):
                    if seqs.audit[s] is not None:
                        audit_mask[i, :lengths[i]] = True
                audit_mask = self._put(audit_mask)

        return _JobSpan(slot=slot, start=start, end=start + sum(lengths),
                        index=(self._put(r_idx), self._put(c_idx)), mask=self._put(mask),
                        advantages=self._put(torch.from_numpy(seqs.advantages[rows]).to(self.logp_dtype)),
                        old=padded(seqs.old), ref=padded(seqs.ref), rows=rows, audit=audit,
                        audit_mask=audit_mask)

    def _put(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _forward_logprobs(self, mb: "_MicroBatch") -> torch.Tensor:
        """Logprobs of the micro-batch's completion tokens, flat in row order."""
        if self.routing.stack is not None:
            self.routing.layout = mb.layout
        hidden = self.decoder(input_ids=mb.input_ids, use_cache=False).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, mb.hidden_index)
        weight = self.model.get_output_embeddings().weight
        return token_logprobs(hidden, weight, mb.targets, self.logprob_chunk_tokens)

    @torch.no_grad()
    def _logprobs_many(self, seqs: list[_Seqs], adapters: list[Adapter] | None) -> list[list[torch.Tensor]]:
        out = [[None] * len(s.ids) for s in seqs]
        plan = [self._prepare(mb, seqs) for mb in
                plan_microbatches([[len(r) for r in s.ids] for s in seqs], self.max_tokens_per_microbatch)]
        self.routing.stack = AdapterStack(adapters, requires_grad=False) if adapters else None
        try:
            for mb in plan:
                logp = self._forward_logprobs(mb).cpu()
                for span in mb.spans:
                    a = span.start
                    for s in span.rows:
                        n = len(seqs[span.slot].positions[s])
                        out[span.slot][s] = logp[a:a + n]
                        a += n
        finally:
            self.routing.stack = self.routing.layout = None
        return out

    def _base_logprobs(self, seqs: _Seqs) -> list[np.ndarray]:
        return [t.double().numpy() for t in self._logprobs_many([seqs], None)[0]]

    def logprobs(self, job_id: str | None, batch: JobBatch) -> list[torch.Tensor]:
        """Per sequence, fp32 (fp64 for an fp64 model) logprobs of its completion tokens (mask == 1) under the job's current
        adapter (job_id None: the base model), the layout ``JobBatch.old_logprobs`` takes."""
        seqs = [_validate(job_id or "<base>", batch, self.vocab_size)]
        adapters = None if job_id is None else [self._job(job_id).adapter]
        return self._logprobs_many(seqs, adapters)[0]

    @torch.no_grad()
    def logits(self, job_id: str | None, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [R, T, V] of right-padded rows under one job's adapter (None:
        the base). For checks on small inputs; training never materialises these."""
        ids = input_ids.to(self.device)
        if job_id is not None:
            self.routing.stack = AdapterStack([self._job(job_id).adapter], requires_grad=False)
            self.routing.layout = make_row_layout([0] * ids.shape[0], self.device, 1)
        try:
            return self.model(input_ids=ids, use_cache=False).logits
        finally:
            self.routing.stack = self.routing.layout = None

    def logprobs_many(self, batches: dict[str, JobBatch]) -> dict[str, list[torch.Tensor]]:
        """``logprobs`` for several jobs in shared micro-batches."""
        job_ids = list(batches)
        seqs = [_validate(j, batches[j], self.vocab_size) for j in job_ids]
        out = self._logprobs_many(seqs, [self._job(j).adapter for j in job_ids])
        return dict(zip(job_ids, out))

    # --- persistence ------------------------------------------------------------------------

    def save_adapter(self, job_id: str, path: str, dtype: torch.dtype = torch.float32,
                     adapter_format: str = "safetensors") -> None:
        """``safetensors``: PEFT format (adapter_config.json + adapter_model.safetensors), loadable
        by ``peft.PeftModel.from_pretrained`` and vLLM's ``LoRARequest``. ``flat``: the engine's fast
        handoff (real/flat_adapter.py), loadable by an engine that installed its loader."""
        if adapter_format not in ADAPTER_FORMATS:
            raise ValueError(f"adapter_format={adapter_format!r}: choose one of {ADAPTER_FORMATS}")
        save = save_flat_adapter if adapter_format == "flat" else save_peft_adapter
        save(self._job(job_id).adapter, path, self.target_modules, self.base_model_name_or_path, dtype)

    def state_dict_job(self, job_id: str) -> dict:
        """Everything to resume the job: config, adapter, optimizer state, step count, RNG. CPU copies."""
        job = self._job(job_id)
        return {
            "config": asdict(job.config),
            "A": {n: p.detach().cpu().clone() for n, p in job.adapter.A.items()},
            "B": {n: p.detach().cpu().clone() for n, p in job.adapter.B.items()},
            # deepcopy: state_dict() returns the live moment tensors, which later steps mutate.
            "optimizer": _to_cpu(copy.deepcopy(job.optimizer.state_dict())),
            "step": job.step,
            "rng": job.generator.get_state(),
        }

    def load_state_job(self, job_id: str, state: dict) -> None:
        """Create (or replace) ``job_id`` from a ``state_dict_job`` checkpoint."""
        self.jobs.pop(job_id, None)
        config = dict(state["config"])
        self.add_job(job_id, **config)
        job = self.jobs[job_id]
        with torch.no_grad():
            for n in job.adapter.A:
                job.adapter.A[n].copy_(state["A"][n])
                job.adapter.B[n].copy_(state["B"][n])
        # A copy: the optimizer keeps the given state's tensors (its step counts among them) and
        # steps them in place, which would change ``state`` for a later load of it.
        job.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        job.step = int(state["step"])
        job.generator.set_state(state["rng"])


def _check_shared_prompt_model(model, decoder) -> None:
    """The shared-prompt layout hands the decoder its mask per layer type ({"full_attention": mask})
    with position ids: a model with other layer types (sliding windows) would need the window in
    the mask too, and a transformers whose decoder ignored the dict (it takes one since ~4.53) would
    let responses see each other. Checked on the model itself: a prompt with two one-token responses
    packed into one row must give the second response about the hidden state it has alone, far
    closer than the same row under a mask that lets it see the first response (which a decoder
    ignoring the mask would also give: bf16 rounding is no false alarm this way)."""
    from real.graphed import shared_prompt_mask

    types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        raise ValueError(f"share_prompts needs a model whose every layer is full attention; this one has "
                         f"{sorted(types)} (the graphed trainer packs rows by default: --share-prompts 0 or "
                         "trainer.share_prompts: 0 for a row per response)")
    dev = next(model.parameters()).device
    ids, pos = torch.tensor([[1, 2, 3, 4]], device=dev), torch.tensor([[0, 1, 2, 2]], device=dev)
    seg = torch.tensor([[0, 0, 1, 2]], device=dev)
    causal = torch.ones(4, 4, dtype=torch.bool, device=dev).tril()[None, None]
    with torch.no_grad():
        want = decoder(input_ids=torch.tensor([[1, 2, 4]], device=dev), use_cache=False).last_hidden_state[0, 2]
        got = {name: decoder(input_ids=ids, position_ids=pos, use_cache=False,
                             attention_mask={"full_attention": mask}).last_hidden_state[0, 3]
               for name, mask in (("packed", shared_prompt_mask(seg)), ("leaky", causal))}
    rel = {k: float((v.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
           for k, v in got.items()}
    if not rel["packed"] < 0.25 * rel["leaky"]:
        raise ValueError(f"share_prompts: this transformers' decoder does not honour the packed row's attention mask "
                         f"(a response's hidden state lies {rel['packed']:.3g} of its size from its own alone, and "
                         f"{rel['leaky']:.3g} when it may see the other response): it needs a decoder that takes "
                         "attention_mask as a dict per layer type (transformers >= 4.53), or --share-prompts 0 "
                         "(trainer.share_prompts: 0; the graphed trainer packs rows by default)")


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
