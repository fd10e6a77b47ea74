"""What a cluster of engines and trainers asks of a GPU's memory, and the trainer micro-batch that
fits: one model for both backends. The real backend checks it before starting processes and fits a
default micro-batch to the GPU it runs on (``real.backend.fit_microbatch``); the simulator fits it to
its profile's GPU the same way (``sim.backend_factory``), so a prediction prices the micro-batch the
real run would train at. Pure Python: ``experiments/trainer_memory.py`` imports it on a bare GPU host.
"""

from __future__ import annotations

# A graphed trainer's memory against its micro-batch tokens, affine: measured on session 49's H100
# (experiments/trainer_memory.py, the backend's own warm-up of the reference workload's stack: 4 jobs
# of 64 rows, packed 4 responses a row), the allocator's peak reserved memory plus ~0.5 GiB of CUDA
# context: 19.8 GiB at 4096 tokens and 35.1 GiB at 8192. Above every capture seen to fail (58.1 GiB
# at 16k in session 29; 28.3 GiB at 8k in session 49's two-stack run) and under session 30's fit
# (two at 8k beside 49.1 GiB of engines in 139.7 GiB).
TRAINER_BASE_GIB, TRAINER_GIB_PER_1K = 4.6, 3.8
TRAINER_GIB_TOKENS = 16384  # the micro-batch an estimate without one assumes (the config's default)
# An eager trainer's memory whatever its micro-batch (one-stack eager runs at 32k tokens worked in
# sessions 5-6).
EAGER_TRAINER_GIB = 50.0
# What the processes hold beyond the engine share and the trainers (session 49, H100): each engine
# process 2.0 GiB above its gpu_memory_utilization share (15.9 GiB at 13.9; CUDA context and CUDA
# graphs), and the controller 2.0 GiB.
ENGINE_OVERHEAD_GIB, CONTROLLER_GIB = 2.0, 2.0
# The smallest micro-batch fit_microbatch goes down to.
MIN_FIT_MICROBATCH = 1024


def trainer_gib_estimate(microbatch_tokens: int | None, graphed: bool = True) -> float:
    """A trainer's memory: a graphed one TRAINER_BASE_GIB plus TRAINER_GIB_PER_1K a thousand
    micro-batch tokens (its graph pools and activations grow with the micro-batch; two measured
    sizes, on the reference workload's shape), 65.4 GiB at 16k; an eager one EAGER_TRAINER_GIB."""
    if not graphed:
        return EAGER_TRAINER_GIB
    return TRAINER_BASE_GIB + TRAINER_GIB_PER_1K * (microbatch_tokens or TRAINER_GIB_TOKENS) / 1024


def gpu_memory_need_gib(total_gib: float, engine_memory: float, n_stacks: int, trainer_gib: float) -> float:
    """What a cluster of ``n_stacks`` stacks asks of a GPU of ``total_gib``: the engines' share of
    it, each engine's overhead beyond its share, the controller, and a trainer a stack."""
    return engine_memory * total_gib + n_stacks * (ENGINE_OVERHEAD_GIB + trainer_gib) + CONTROLLER_GIB


def microbatch_that_fits(free_gib: float, total_gib: float, engine_memory: float, n_stacks: int,
                         microbatch_tokens: int, graphed: bool = True) -> int | None:
    """The largest of ``microbatch_tokens``, its half, its quarter, ... (not under
    MIN_FIT_MICROBATCH) at which a trainer a stack fits beside the engines in ``free_gib``; None
    when none does (or, for an eager trainer, whose estimate does not follow the micro-batch, when
    it does not fit as asked)."""
    tokens = microbatch_tokens
    while True:
        if gpu_memory_need_gib(total_gib, engine_memory, n_stacks, trainer_gib_estimate(tokens, graphed)) <= free_gib:
            return tokens
        if not graphed or tokens // 2 < MIN_FIT_MICROBATCH:
            return None
        tokens //= 2


def query_gpu(fields: str) -> list[str] | None:
    """The first GPU's ``fields`` (nvidia-smi ``--query-gpu``, comma-separated names), one string
    each without units, or None where nvidia-smi is missing, fails or does not answer in 30 s."""
    import shutil as _sh
    import subprocess

    if _sh.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    # From the right: only the first field (a GPU's name) could hold a comma.
    return [v.strip() for v in out.stdout.splitlines()[0].rsplit(",", fields.count(","))]


def gpu_driver() -> str | None:
    """The NVIDIA driver's version (nvidia-smi), or None where it cannot be read."""
    got = query_gpu("driver_version")
    return got[0] if got and got[0] else None


def gpu_memory_gib() -> tuple[float, float] | None:
    """The first GPU's free and total memory in GiB (nvidia-smi), or None where it cannot be read."""
    got = query_gpu("memory.free,memory.total")
    if got is None:
        return None
    free_mib, total_mib = (float(v) for v in got)
    return free_mib / 1024, total_mib / 1024


# The real backend's engine share of the GPU unless told (RealOptions.engine_memory, `nodus run
# --engine-memory`): what the simulator's fit assumes.
DEFAULT_ENGINE_MEMORY = 0.45
# Free and total GiB at the start of a run, by GPU name (nvidia-smi on an idle lent GPU): the
# simulator's fit reads its profile's environment.gpu here. H200: 143155 of 143771 MiB; H100 80GB
# HBM3, session 49: 77.2 GiB free of 81559 MiB.
GPU_MEMORY_GIB = {"NVIDIA H200": (139.8, 140.4), "NVIDIA H100 80GB HBM3": (77.2, 79.65)}


def profile_gpu_memory(environment) -> tuple[float, float] | None:
    """A profile's GPU memory (free, total GiB): the one ``nodus calibrate`` measured on it
    (``environment.gpu_memory_gib``, read before anything started), else GPU_MEMORY_GIB's for its
    GPU's name; None where neither says."""
    own = getattr(environment, "gpu_memory_gib", None)
    if own:
        return float(own[0]), float(own[1])
    return GPU_MEMORY_GIB.get(getattr(environment, "gpu", None))


def fitted_microbatch(asked: int, stacks: int, mem: tuple[float, float] | None,
                      engine_memory: float = DEFAULT_ENGINE_MEMORY) -> int:
    """The micro-batch a graphed run of ``stacks`` stacks trains at when its config leaves the
    default ``asked``: the largest halving whose trainers fit beside the engines in ``mem`` (free,
    total GiB); ``asked`` where it fits, where nothing smaller does, or where the memory is unknown."""
    if mem is None:
        return asked
    fits = microbatch_that_fits(mem[0], mem[1], engine_memory, stacks, asked)
    return asked if fits is None else fits
