"""The cost model is data: a versioned profile JSON (measured points + fitted physics-shaped models).

Loading validates the file (a missing or malformed profile is a clear error naming the path and
field). Cost functions turn a batch composition into seconds of GPU work "alone, no MPS"; the
`rates` of the sharing section turn that work into wall time when phases co-run.
"""

from __future__ import annotations

import bisect
import json
import math
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from nodus.config import ConfigError

SCHEMA = "nodus.profile/1"


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


STEP_MODES = ("eager", "graphed", "static")  # the trainers a profile's train terms can describe (real/trainer.py)
LORA_KERNELS = ("default", "tuned")  # the engine LoRA kernel configs a profile's engine terms describe
# The adapter handoffs a profile's train and publish terms can describe (real.flat_adapter.ADAPTER_FORMATS).
ADAPTER_FORMATS = ("safetensors", "flat")


class Environment(_M):
    gpu: str
    model: str
    vllm: str | None = None
    torch: str | None = None
    driver: str | None = None
    date: str
    git_commit: str | None = None
    host: dict | None = None  # CPU, cores, /dev/shm (nodus.outdir.host): the phases are host-bound in part
    # The engine's LoRA kernel configs when measured with tuned ones ({"source", "folder", "gpu"},
    # real/lora_kernels.py); None: vLLM's defaults (every profile before the field).
    lora_kernel_configs: dict | None = None
    # The measuring engine's adapter slots (vLLM max_loras; nodus calibrate, since session 21); None:
    # not recorded (the largest adapter count measured, in every calibration before the field).
    engine_max_loras: int | None = Field(default=None, ge=1)
    # torch's CPU threads in the measured trainers where capped (RealOptions.trainer_cpu_threads;
    # nodus fit records its runs'); None: torch's own count (every profile before the field).
    trainer_cpu_threads: int | None = Field(default=None, ge=1)
    # The GPU's free and total memory in GiB before anything started (nodus calibrate, nvidia-smi):
    # the simulator fits a default trainer micro-batch to it (nodus.gpumemory); None: not measured
    # (nodus.gpumemory.GPU_MEMORY_GIB's by the GPU's name, where it knows it).
    gpu_memory_gib: list[float] | None = Field(default=None, min_length=2, max_length=2)
    # How the measured trainers handed each new adapter version to the engine (RealOptions.adapter_format):
    # PEFT safetensors folders (every profile before the field) or one flat file each (:flat). The train
    # terms include the trainer's save and the publish the engine's load, so they describe this format.
    adapter_format: Literal[ADAPTER_FORMATS] = "safetensors"
    sources: list[str] = []


class Curve(_M):
    """Piecewise-linear step time (s) against batch size through measured points, one curve per
    number of distinct adapters in the batch."""

    adapters: int = Field(ge=0)
    batch: list[int]
    step_s: list[float]

    @model_validator(mode="after")
    def _shape(self) -> "Curve":
        if len(self.batch) != len(self.step_s) or len(self.batch) < 2:
            raise ValueError("batch and step_s need the same length, at least 2 points")
        if self.batch != sorted(set(self.batch)):
            raise ValueError("batch sizes must be strictly increasing")
        return self


class Linear(_M):
    """y = a_s + b_s_per_unit * x."""

    a_s: float = Field(ge=0)
    b_s_per_unit: float = Field(ge=0)


class GraphlessStep(_M):
    """A decode step run without CUDA graphs: its measured time at ``batch`` sequences with
    ``adapters`` distinct adapters."""

    adapters: int = Field(ge=0)
    batch: int = Field(ge=1)
    step_s: float = Field(gt=0)


class Decode(_M):
    curves: list[Curve]  # by adapters, increasing
    s_per_context_token: float = Field(default=0.0, ge=0)  # extra step time per token of KV context
    # Multiplier on every decode step: the curves are a microbenchmark's on the host that ran it;
    # `nodus fit` sets this from a host's dedicated runs (the engine's per-step host work moves
    # with the host, not the GPU).
    scale: float = Field(default=1.0, gt=0)
    # The largest CUDA-graph size in tokens (vLLM's max_cudagraph_capture_size) of the engine the
    # graphless steps were measured past; a run's own engine setting (EngineSpec.cuda_graph_max_tokens,
    # by default min(2 * max_num_seqs, 512)) decides which of its steps run without graphs.
    # None: steps past the graphs not modelled.
    graph_max_tokens: int | None = Field(default=None, ge=1)
    # Step time of a batch past the graph sizes, by adapters: launch-bound, so flat in the batch
    # (measured at one batch size past them).
    graphless: list[GraphlessStep] = []
    # What one sequence returning its sampled token's logprob adds to a decode step (the engine's
    # host work per request and step for the audit, RunConfig.audit; before ``scale``). The curves
    # were measured returning every sequence's, so a step is priced without it on the sequences that
    # do not ask. Fitted on pairs of runs that differ in their audit alone (`nodus fit-audit`); 0:
    # not measured (a run auditing less is priced as the full audit, and flagged).
    logprob_s_per_seq: float = Field(default=0.0, ge=0)
    # The engine's per-step host floor, in seconds (not scaled): with vLLM's async scheduling the host
    # prepares step n+1 while the GPU runs step n, so a step takes max(host, GPU), and a small batch's
    # GPU step, shorter than the host's work, costs the host's. A step is priced max(curves x scale,
    # step_floor_s). Fitted with the scale on one host's lone generations of several batch sizes
    # (`nodus fit --step-floor`); 0: none (the scale alone carries the host, as fitted before).
    step_floor_s: float = Field(default=0.0, ge=0)


class Prefill(_M):
    no_lora: Linear  # x = prompt tokens admitted
    lora: Linear


class TrainCost(_M):
    per_microbatch: Linear  # x = tokens in the micro-batch (fwd + bwd)
    s_per_adapter: float = Field(ge=0)  # optimizer step + bookkeeping per adapter in the step
    max_profiled_tokens: int = Field(ge=1)
    # Per extra token of the multi-adapter layout (`nodus.microbatch.microbatch_costs`): for
    # `padded`, the regrouping beyond the micro-batch's own padded tokens (jobs spread unevenly over
    # a micro-batch are padded to the busiest job's row count); for `masked`, each token times the
    # other adapters of its micro-batch (the LoRA GEMMs' extra inner columns).
    s_per_regroup_token: float = Field(default=0.0, ge=0)
    extra_tokens_layout: Literal["padded", "masked"] = "padded"  # the trainer layout that term is of
    # Packed rows (trainer.share_prompts): what one query-key pair of a packed micro-batch's masked
    # attention (``nodus.microbatch.packed_pairs_per_microbatch``) costs, in units of ``per_microbatch``'s per-token
    # term, so it moves with a refit or a what-if of the train terms. Fitted on the trainer alone
    # (``nodus fit-packed``); None: not measured, packed rows priced as plain.
    packed_pair_per_token: float | None = Field(default=None, ge=0)
    # The largest micro-batch (in query-key pairs) that fit saw: a larger one is flagged.
    max_profiled_packed_pairs: int | None = Field(default=None, ge=1)
    # The KL term of a job with beta > 0 (jobs[].beta): the base model's forward pass over its tokens
    # for the reference logprobs, as a share of what those tokens' micro-batches cost (``per_microbatch``:
    # forward and backward; nodus calibrate's KL step). None: not measured, such a job's train priced
    # without it (and flagged).
    kl_share: float | None = Field(default=None, ge=0)
    # The trainer these terms (and the sharing rates measured with this profile as base) describe:
    # eager, or its micro-batches replayed as CUDA graphs (--trainer-graphs; "static" on a CPU).
    step_mode: Literal[STEP_MODES] = "eager"
    # The handoff: host work between a group's generation and its train step (the rollouts' advantages
    # and token lists built, the batch handed to the trainer process; real.backend.train), per sequence
    # trained and per one of them carrying the engine's logprobs (the audit, RunConfig.audit). It holds
    # neither the GPU nor the engine. `nodus fit-handoff` fits both on recorded runs' gaps (on the H200:
    # 11-12 ms for a dedicated job of 64 sequences with the full audit, 5-6 ms auditing one response a
    # prompt); 0 in profiles from before them (the train step starting at once).
    handoff_s_per_sequence: float = Field(default=0.0, ge=0)
    handoff_s_per_audited: float = Field(default=0.0, ge=0)
    # With two stacks or more the host serves more processes (an engine and a trainer a stack) and the
    # handoff takes this many times as long (on the H200 ~1.4x a dedicated job's at as many sequences).
    handoff_stacks_factor: float = Field(default=1.0, ge=1)


class PublishCost(_M):
    save_s_per_adapter: float = Field(ge=0)  # trainer side: adapter to the engine's reach (host time)
    # A publish's fixed part, whatever its adapters (the round trip to the engine): nodus fit fits it
    # on runs whose publishes hold different adapter counts; 0 in profiles from before it.
    save_s_per_publish: float = Field(default=0.0, ge=0)
    engine_load_s: float = Field(ge=0)  # engine side: load a new adapter version before first use
    # How many times slower a publish progresses while a train step runs on its GPU (1: not at
    # all). Measured on the H200 with the trainer freed at the end of a train: a publish beside the
    # other group's step took 0.18-0.33 s per adapter against 0.034-0.05 s alone.
    corun_factor: float = Field(default=1.0, ge=1)


RATE_MAX = 2.0  # a side's rate is at most this: twice as fast as alone without MPS


class Rates(_M):
    """Progress per second, in units of 'alone without MPS' work, for each side."""

    engine: float = Field(gt=0, le=RATE_MAX)
    trainer: float = Field(gt=0, le=RATE_MAX)


class BatchRates(_M):
    """The engine-and-trainer pair's co-run rates while the engine decodes `batch` sequences."""

    batch: int = Field(ge=1)
    none_corun: Rates | None = None
    mps_corun: Rates | None = None


class EnginesBatch(_M):
    """Two stacks' engines of `batch` sequences each (`nodus calibrate-engines`): one engine's time
    beside the other generating over its time alone (`none`, `mps`), and beside the other stack's
    trainer stepping over as many sequences and adapters (`none_beside_trainer`,
    `mps_beside_trainer`), per sharing mode measured."""

    batch: int = Field(ge=1)
    none: float | None = Field(default=None, gt=0)
    mps: float | None = Field(default=None, gt=0)
    none_beside_trainer: float | None = Field(default=None, gt=0)
    mps_beside_trainer: float | None = Field(default=None, gt=0)
    # That trainer's step beside the engine over its step alone.
    none_trainer_beside: float | None = Field(default=None, gt=0)
    mps_trainer_beside: float | None = Field(default=None, gt=0)


class SharingCost(_M):
    none_corun: Rates  # engine and trainer time-slicing the GPU
    mps_alone: Rates  # one side running alone inside its MPS share
    mps_corun: Rates  # both running under MPS
    # The pair's co-run rates by the engine's running batch (calibrate-sharing's buckets): one
    # constant per mode cannot say that the rates move with the batch (session 3's runs, fitted
    # one at a time: the trainer's MPS co-run rate 0.50 beside one-job generations, 0.67 beside
    # two-job ones). Where given for a mode, the simulator takes the pair's rates from here,
    # linear in batch between points, the end points' beyond them; else the constants above.
    corun_by_engine_batch: list[BatchRates] = []
    # The MPS settings the MPS rates were fitted under, where not the defaults (`nodus fit` sets it
    # from its runs, e.g. {"trainer_priority": "below-normal"}): they move the co-run rates (the
    # trainer at below-normal priority gave the engine's co-running generations 1.78 s against
    # 2.22 s), so `nodus validate` flags an MPS run whose settings differ. {}: the defaults.
    controls: dict[str, bool | str | int | float] = {}
    # Each engine's rate (alone-without-MPS work per second) while the engines of two stacks
    # (arm.stacks = 2) generate at once under MPS, nothing else running; None: never measured, and
    # the two engines share the engine-trainer pair's combined rate (the 'sharing-many-clients'
    # rule), which put session 30's two-stack runs 13.7-18.1% under the measured on session 16's
    # profile. `nodus fit-stacks`
    # fits it from recorded two-stack runs. Beside a trainer as well, each engine goes at this rate
    # times the pair's engine rate over its alone rate under MPS (the trainer slows two engines as
    # it slows one); the trainers keep the many-clients rule.
    mps_engines: float | None = Field(default=None, gt=0, le=RATE_MAX)
    # The settings mps_engines was fitted under (`nodus fit-stacks` records its runs' policy,
    # packing, engine and trainer thread caps and MPS settings; `nodus validate` and the simulator
    # flag a stacks run that differs). Applies to arm.stacks arms only, never to timeslice's.
    engines_controls: dict[str, bool | str | int | float | None] = {}
    # A trainer's rate (alone-without-MPS work per second) in an arm of several stacks under MPS
    # while it is the only trainer running and one engine or more generate: a train beside another
    # stack's generation (offset stacks, stacks drifted apart) or, on an overlap arm, beside its own
    # stack's. None: the pair's trainer rate (mps_corun.trainer), fitted on one stack, which priced
    # session 39's offset stacks' trains at 1.52-1.58 s against 0.88-0.96 s measured (H200).
    # `nodus fit-stacks --rate trainer` fits it on recorded runs, the two-engine rate held.
    mps_stacks_trainer: float | None = Field(default=None, gt=0, le=RATE_MAX)
    # An engine's rate (alone-without-MPS work per second) beside that lone trainer: one engine goes
    # at it, several at mps_engines times it over the engine's alone rate (as beside the pair's
    # trainer). None: the pair's engine rate (mps_corun.engine). A lone trainer fitted faster than
    # the pair's leaves the engine beside it at the pair's rate otherwise: on the H200 two stacks
    # fitted that way (sessions 35, 39) priced generations 7-18% short and trains 15-98% long on
    # held-out runs, right in steps/GPU-h by errors that cancel. `nodus fit-stacks --rate phases`
    # fits it with the lone trainer's rate and the two-engine rate, on the runs' phase times.
    mps_stacks_engine: float | None = Field(default=None, gt=0, le=RATE_MAX)
    # The settings mps_stacks_trainer was fitted under (as engines_controls).
    stacks_trainer_controls: dict[str, bool | str | int | float | None] = {}
    # Each trainer's rate (alone-without-MPS work per second) while the trainers of two stacks or more
    # train at once under MPS (lockstep stacks train together; free ones drift into it); beside an
    # engine as well, times the pair's trainer rate over its alone rate (an engine slows two trainers
    # as it slows one). None: the many-clients rule (the pair's combined rate split over the clients),
    # which priced the H100's lockstep trains 20% short (session 57: 0.889 s measured, 0.710 s
    # simulated) and the H200's 7% short. `nodus fit-stacks --rate phases` fits it with the other
    # stacks rates where the runs' trains ran together. Applies to arm.stacks arms only.
    mps_trainers: float | None = Field(default=None, gt=0, le=RATE_MAX)
    # The most sequences one engine generated at once in the runs the stacks rates above were fitted
    # on (nodus fit-stacks); with engines_by_batch below, also where the two-engine rate holds as fitted
    # (its anchor). The rates are constants: an engine generating more (8 or 16 jobs on a
    # stack against the fit runs' 1-2) is priced at rates measured at those sizes, and a prediction
    # of it is flagged (on the H200, session 58: engines of 512 sequences beside each other generated
    # 5-14% longer than priced, where the rates were fitted at 64-128). None: not recorded.
    stacks_engine_sequences: int | None = Field(default=None, ge=1)
    # Two engines' slowdown beside each other by engine size, from the two-engine bench (`nodus
    # calibrate-engines`; each engine of `batch` sequences over one adapter per 64). Where given for
    # the arm's sharing mode, the two-engine rate follows it over engine size (sim.gpu.engines_rate):
    # under MPS with a fitted mps_engines, that rate at the fit's engine size (stacks_engine_sequences)
    # times the bench's slowdown there over its slowdown at the running size; else alone's rate over
    # the slowdown. On the H200 the rate fitted on each size's own runs fell from 0.86 (256 sequences)
    # to 0.71 (512), which a constant fitted at 64-128 cannot say (session 59; the H100's bench is
    # flat from 64 to 512 sequences). Where the bench also timed an engine beside the other stack's
    # trainer (`mps_beside_trainer`), an engine of stacks beside a lone trainer under MPS follows it
    # the same way (sim.gpu.stacks_engine_rate): mps_stacks_engine at the fit's engine size times the
    # bench's ratio, or without a fitted one, mps_alone's engine rate over the slowdown; and the lone
    # trainer beside such an engine follows `mps_trainer_beside` (sim.gpu.stacks_trainer_rate), from
    # mps_stacks_trainer. On the H100 the lone trainer's steps beside 256-sequence engines ran
    # 1.07-1.08 s against 0.91-0.98 s priced at the 128-sequence fit (session 57).
    engines_by_batch: list[EnginesBatch] = []


class Assumption(_M):
    id: str
    what: str
    value: float | str | None = None


class Validation(_M):
    """How well this profile predicted recorded real runs it was not fitted on (`nodus validate
    --annotate`): the error bar every prediction on it carries."""

    heldout_mape: float | None = None  # steps per GPU-hour, replayed lengths
    heldout_bias: float | None = None  # signed: + means the simulator predicts more than measured
    heldout_worst: float | None = None
    kendall_tau: float | None = None
    heldout_runs: int = 0
    configurations: list[str] = []  # the held-out runs' arms, e.g. "8 jobs overlap g=2 mps"
    # The same error arm by arm (calibration.validate.arm_errors; keyed by arm_key, e.g. "overlap g=2
    # mps", "shared-sync g=1 mps stacks=2"): runs, configurations, mape, bias, worst. A profile
    # validated on some arms prices the others without an error bar of their own.
    arms: dict[str, dict[str, float | int | None]] = {}
    report: str | None = None  # where the full report is
    # The same error on other days' held-out runs under the MPS settings its rates were fitted under
    # (experiments/crossday.py --annotate): what a plan for a day no profile was fitted on meets.
    across_days_mape: float | None = None
    across_days_bias: float | None = None
    across_days_worst: float | None = None
    across_days_runs: int = 0
    across_days_report: str | None = None
    # The held-out error with each run's machine speed known (`nodus validate`'s machine-calibrated
    # figures: each run priced with its machine's measured-over-simulated ratio on its other runs):
    # what a plan gets once one configuration is measured on the machine it is for.
    machine_mape: float | None = None
    machine_bias: float | None = None
    machine_worst: float | None = None
    machine_runs: int = 0
    machines: int = 0
    # The ratio over dedicated (`nodus validate`'s heldout_ratio): each held-out run over the same day's
    # and machine's dedicated run of its seed, simulated against measured; the error bar of a ratio.
    ratio_mape: float | None = None
    ratio_bias: float | None = None
    ratio_worst: float | None = None
    ratio_pairs: int = 0
    # Against each held-out configuration's mean over its runs (`nodus validate`'s heldout_per_config):
    # the per-run noise averaged out; Kendall tau over every pair of configurations, and over the
    # pairs whose measured means lie apart by more than their runs' noise (the others are ordered by
    # chance; calibration.validate.resolved_tau).
    config_mape: float | None = None
    config_worst: float | None = None
    config_tau: float | None = None
    configs: int = 0
    config_tau_resolved: float | None = None
    config_pairs_resolved: int | None = None
    config_pairs: int = 0


class Profile(_M):
    schema_: str = Field(alias="schema")
    environment: Environment
    decode: Decode
    prefill: Prefill
    train: TrainCost
    publish: PublishCost
    sharing: SharingCost
    assumptions: list[Assumption] = []
    measurements: dict = {}
    validation: Validation | None = None

    @model_validator(mode="after")
    def _schema(self) -> "Profile":
        if self.schema_ != SCHEMA:
            raise ValueError(f"schema={self.schema_!r}, expected {SCHEMA!r}")
        return self


def profile_step_mode(prof: dict) -> str:
    """The trainer a profile dict's train terms describe (``train.step_mode``; eager before the field)."""
    return (prof.get("train") or {}).get("step_mode", "eager")


def profile_adapter_format(prof: dict) -> str:
    """The adapter handoff a profile dict's train and publish terms describe (``environment.adapter_format``:
    "safetensors", PEFT folders, in every profile before the field, or "flat")."""
    return (prof.get("environment") or {}).get("adapter_format") or "safetensors"


def audit_priced(prof: dict) -> bool:
    """Whether a profile dict prices a lighter audit (``decode.logprob_s_per_seq`` > 0, fitted by
    ``nodus fit-audit``): a run returning logprobs on fewer responses is then simulated with its own
    audit, so ``nodus validate`` counts it inside the profile and the fits may take it."""
    return ((prof.get("decode") or {}).get("logprob_s_per_seq") or 0) > 0


def profile_lora_kernels(prof: dict) -> str:
    """The engine LoRA kernels a profile dict's engine terms describe: "tuned" when its
    environment records tuned configs (``environment.lora_kernel_configs``), else "default"
    (vLLM's own; every profile before the field)."""
    return "tuned" if (prof.get("environment") or {}).get("lora_kernel_configs") else "default"


def shipped_profiles() -> list[str]:
    root = resources.files("calibration") / "profiles"
    return sorted(p.name.removesuffix(".json") for p in root.iterdir() if p.name.endswith(".json"))


def profile_summaries() -> list[dict]:
    """One line of facts per shipped profile: what it was measured on, and its error bar."""
    from calibration.validate import heldout_arms

    out = []
    for name in shipped_profiles():
        cost = load_profile(name)
        p = cost.profile
        env, v = p.environment, p.validation
        host = env.host or {}
        out.append({
            "name": name, "gpu": env.gpu, "model": env.model, "date": env.date, "git_commit": env.git_commit,
            "host": " / ".join(str(host[k]) for k in ("cpu", "cpus") if host.get(k)) or host.get("note"),
            "heldout_mape": v.heldout_mape if v else None, "heldout_bias": v.heldout_bias if v else None,
            "heldout_runs": v.heldout_runs if v else 0, "report": v.report if v else None,
            "across_days_mape": v.across_days_mape if v else None, "across_days_runs": v.across_days_runs if v else 0,
            # Its ratio over dedicated on held-out same-machine pairs (nodus validate's heldout_ratio).
            "ratio_mape": v.ratio_mape if v else None, "ratio_bias": v.ratio_bias if v else None,
            "ratio_pairs": v.ratio_pairs if v else 0,
            "assumptions": len(p.assumptions),
            # The arms its held-out runs ran, with their runs where the annotation has them
            # (calibration.validate.arm_errors; older annotations: read from their configurations).
            "heldout_arms": heldout_arms(v.model_dump() if v else None),
            # Its two-engine rate's fit (nodus fit-stacks), where it has one: runs and leave-one-out error.
            "stacks": (cost.validation() or {}).get("stacks")})
    return out


def shipped_profile_path(name: str):
    """The file of the shipped profile ``name`` (it need not exist)."""
    return resources.files("calibration") / "profiles" / f"{name}.json"


def load_profile(name_or_path: str) -> "CostModel":
    """A shipped profile by name (e.g. 'h200-qwen3-0.6b') or a JSON file by path."""
    p = Path(name_or_path)
    if not p.exists() and not name_or_path.endswith(".json"):
        if name_or_path not in shipped_profiles():
            raise ConfigError(f"profile={name_or_path!r} is neither a file nor a shipped profile "
                              f"({', '.join(shipped_profiles())})")
        text = shipped_profile_path(name_or_path).read_text()
        source = f"shipped profile {name_or_path}"
    else:
        if not p.is_file():
            raise ConfigError(f"profile file {str(p)!r} does not exist")
        text, source = p.read_text(), f"profile file {str(p)!r}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{source} is not valid JSON: {err}") from None
    try:
        return CostModel(Profile.model_validate(data), source)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise ConfigError(f"{source} is malformed at {loc or '<root>'}: {first['msg']} "
                          f"({len(err.errors())} error(s))") from None


def profile_dict(name_or_path: str) -> dict:
    """A shipped or file profile as a JSON-ready dict (validated), for tools that derive a new one."""
    return json.loads(load_profile(name_or_path).profile.model_dump_json(by_alias=True))


def drop_base_validation(prof: dict) -> None:
    """Remove a profile dict's error bar (``validation``) before a fit writes it as a new profile: it
    measured the base, not the fit (every sim report prints a profile's validation), so the fitted
    profile has none until `nodus validate --annotate` gives it one. Session 58 found 13 shipped
    two-stack profiles printing session 16's graphed profile's held-out error, and every stacks
    profile its error on other days, carried over by fit-stacks and fit-audit."""
    prof.pop("validation", None)


def drop_two_engine_rate(prof: dict) -> bool:
    """Remove a profile dict's two-engine rate (``sharing.mps_engines``, its settings, its fit and
    its assumption), noting it in the profile's sources: a refit of the terms it was fitted beside
    leaves it stale. Whether it had one."""
    sharing = prof.get("sharing") or {}
    had = sharing.get("mps_engines") is not None
    if "mps_engines" in sharing:  # back to the fields' defaults, as a profile without them reads
        sharing["mps_engines"] = None
    if "engines_controls" in sharing:
        sharing["engines_controls"] = {}
    (prof.get("measurements") or {}).pop("stacks", None)
    prof["assumptions"] = [a for a in prof.get("assumptions", []) if a.get("id") != "sharing-two-engines"]
    if had:
        add_source(prof, "its two-engine rate (sharing.mps_engines) dropped: nodus fit-stacks on the new profile")
    return had


def add_source(prof: dict, source: str) -> None:
    """Record in the profile's environment header that `source` made or changed it."""
    env = prof.setdefault("environment", {})
    env["sources"] = list(env.get("sources") or []) + [source]


def set_assumption(prof: dict, assumption: dict) -> None:
    """Put ``assumption`` (id, what, value) in the profile's list, in place of any of its id."""
    prof["assumptions"] = [a for a in prof.get("assumptions", []) if a.get("id") != assumption["id"]] + [assumption]


def write_fit_report(report: str | Path | None, markdown: str, result: dict) -> None:
    """A fit's report: ``report``.md and ``report``.json (nothing when ``report`` is None)."""
    if report is None:
        return
    Path(report).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{report}.md").write_text(markdown)
    Path(f"{report}.json").write_text(json.dumps(result, indent=1) + "\n")


WHAT_IF_PHASES = ("train", "decode", "prefill", "publish")


def what_if(prof: dict, factors: dict[str, float]) -> dict:
    """A hypothetical profile: each named phase's costs times its factor (0.5: twice as fast).
    `train`: every train cost term; `decode`: every decode step; `prefill`: prefill; `publish`:
    the adapter save and engine load. It has no validation (none was measured) and lists the
    factors among its assumptions."""
    prof = json.loads(json.dumps(prof))
    for phase, f in factors.items():
        if phase not in WHAT_IF_PHASES:
            raise ConfigError(f"what-if {phase}={f}: phase must be one of {', '.join(WHAT_IF_PHASES)}")
        if not f > 0:
            raise ConfigError(f"what-if {phase}={f}: the factor must be > 0")
        if phase == "train":
            t = prof["train"]
            t["per_microbatch"] = {k: v * f for k, v in t["per_microbatch"].items()}
            t["s_per_adapter"] *= f
            t["s_per_regroup_token"] = t.get("s_per_regroup_token", 0.0) * f
            # packed_pair_per_token is in per-token units: it follows b_s_per_unit
        elif phase == "decode":
            prof["decode"]["scale"] = prof["decode"].get("scale", 1.0) * f
            if prof["decode"].get("step_floor_s"):  # the host's floor under every step too
                prof["decode"]["step_floor_s"] *= f
        elif phase == "prefill":
            for k in ("no_lora", "lora"):
                prof["prefill"][k] = {kk: v * f for kk, v in prof["prefill"][k].items()}
        else:  # its seconds; the co-run factor is a ratio of seconds and stays
            for k in ("save_s_per_adapter", "save_s_per_publish", "engine_load_s"):
                prof["publish"][k] = prof["publish"].get(k, 0.0) * f
    text = ", ".join(f"{k} x{v:g}" for k, v in sorted(factors.items()))
    drop_base_validation(prof)
    (prof.get("measurements") or {}).pop("stacks", None)  # nor its two-engine fit's error bar
    prof["assumptions"] = list(prof.get("assumptions") or []) + [
        {"id": "what-if", "value": None, "what": f"hypothetical: {text} (not measured)"}]
    add_source(prof, f"what-if {text}")
    Profile.model_validate(prof)
    return prof


def refuse_existing(out: str | Path, tool: str, report: str | Path | None = None) -> None:
    """Profiles are never overwritten: check before any costly measuring. ``report``: a fit's report
    prefix (``write_fit_report``), whose PREFIX.json must not be the profile itself."""
    if Path(out).exists():
        raise FileExistsError(f"--out {str(out)!r} exists; {tool} never overwrites a profile")
    if report is not None and Path(f"{report}.json").resolve() == Path(out).resolve():
        raise ValueError(f"--report {str(report)!r} would write its JSON to {str(out)!r}, the profile --out names; "
                         f"{tool}: give the report another prefix")


def write_profile(prof: dict, out: str | Path, tool: str, overwrite: bool = False) -> None:
    """Validate (the simulator must be able to read it) and write a profile; a file that exists is
    never replaced unless `overwrite`."""
    if not overwrite:
        refuse_existing(out, tool)
    Profile.model_validate(prof)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(prof, indent=1) + "\n")


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Linear through the points; linear extrapolation past either end along the edge segment."""
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)


def handoff_seconds(per_sequence: float, per_audited: float, stacks_factor: float, sequences: int, audited: int,
                    stacks: int) -> float:
    """The handoff's model (``TrainCost.handoff_*``): linear in the sequences trained and the audited ones
    among them, times ``stacks_factor`` on a GPU of two stacks or more. ``CostModel.handoff_s`` prices a
    profile's; ``calibration.handoff`` fits it."""
    return (stacks_factor if stacks > 1 else 1.0) * (per_sequence * sequences + per_audited * audited)


class CostModel:
    """Seconds of GPU work for each phase, from a Profile. Records where it was asked to
    extrapolate beyond the profiled region (reports list those flags)."""

    def __init__(self, profile: Profile, source: str):
        self.profile = profile
        self.source = source
        self._beyond: dict[str, float] = {}  # what was extrapolated -> largest value asked
        self._unmodelled: set[str] = set()  # settings the profile's terms were not measured under
        curves = sorted(profile.decode.curves, key=lambda c: c.adapters)
        self._curves = curves
        self._lora_curves = [c for c in curves if c.adapters >= 1]
        self._max_batch = max(c.batch[-1] for c in curves)
        self._graphless = sorted(profile.decode.graphless, key=lambda g: g.adapters)
        self._cache: dict[tuple[int, int], float] = {}

    def _curve_at(self, c: Curve, batch: int) -> float:
        return _interp(c.batch, c.step_s, batch)

    def decode_step_s(self, batch: int, context_tokens: float, adapters: int, logprob_seqs: int | None = None) -> float:
        """One decode step of `batch` sequences holding `context_tokens` of KV in total, with
        `adapters` distinct LoRA adapters among them, ``logprob_seqs`` of them returning their
        sampled tokens' logprobs (None: every one, as the curves were measured)."""
        step = self._decode_full_s(batch, context_tokens, adapters)
        d = self.profile.decode
        if logprob_seqs is not None and logprob_seqs < batch and d.logprob_s_per_seq:
            # Never below half the step: the term was fitted where the host work was a few tenths of it.
            step = max(step - d.logprob_s_per_seq * (batch - logprob_seqs) * d.scale, 0.5 * step)
        return max(step, d.step_floor_s)

    def _decode_full_s(self, batch: int, context_tokens: float, adapters: int) -> float:
        key = (batch, adapters)
        base = self._cache.get(key)
        if base is None:
            if batch > self._max_batch:
                self._note("decode batch", batch, self._max_batch)
            if adapters == 0 or not self._lora_curves:
                base = self._curve_at(self._curves[0], batch)
            else:
                lc = self._lora_curves
                if adapters > lc[-1].adapters:
                    self._note("decode adapters", adapters, lc[-1].adapters)
                # Between measured adapter counts, interpolate in log2(adapters): the LoRA kernels'
                # cost grows with the number of distinct adapter segments, sub-linearly.
                la = math.log2(adapters)
                pts = [(math.log2(c.adapters), self._curve_at(c, batch)) for c in lc]
                if len(pts) == 1 or la <= pts[0][0]:
                    base = pts[0][1]
                elif la >= pts[-1][0]:
                    base = pts[-1][1]
                else:
                    j = next(k for k in range(1, len(pts)) if pts[k][0] >= la)
                    (x0, y0), (x1, y1) = pts[j - 1], pts[j]
                    base = y0 + (y1 - y0) * (la - x0) / (x1 - x0)
            self._cache[key] = base
        return (base + self.profile.decode.s_per_context_token * context_tokens) * self.profile.decode.scale

    def graphless_extra_s(self, step_tokens: int, batch: int, adapters: int, graph_max_tokens: int) -> float:
        """What a step of ``step_tokens`` tokens (``batch`` decoding sequences and an admitted
        prompt's prefill) costs beyond a graphed decode step of ``batch``, on an engine whose
        largest CUDA graph is ``graph_max_tokens``: 0 within it, or when the profile does not model
        the step past the graphs."""
        d = self.profile.decode
        if d.graph_max_tokens is None or not self._graphless or step_tokens <= graph_max_tokens:
            return 0.0
        # The measured point of the nearest adapter count at or below (the first above if none).
        g = next((p for p in reversed(self._graphless) if p.adapters <= adapters), self._graphless[0])
        graphed = self.decode_step_s(batch, 0.0, adapters)
        return max(g.step_s * d.scale - graphed, 0.0)

    def prefill_s(self, tokens: int, lora: bool, cold: bool) -> float:
        """Prefill of newly admitted prompt tokens; the fixed part is paid only when the engine
        starts from idle (mid-batch admissions ride on decode steps, as chunked prefill does)."""
        f = self.profile.prefill.lora if lora else self.profile.prefill.no_lora
        return (f.a_s if cold else 0.0) + f.b_s_per_unit * tokens

    def train_s(self, microbatch_tokens: list[int], adapters: int, regroup_tokens: int = 0,
                packed_pairs: list[int] = (), kl_fraction: float = 0.0) -> float:
        """One train step: per micro-batch (padded tokens), per adapter, per token of the
        multi-adapter regrouping beyond the padded tokens, per query-key pair of packed rows'
        masked attention (``packed_pairs``: each packed micro-batch's, checked against the profiled
        range; priced where the profile measured it: ``has_packed_attention``), and the KL term's
        forward pass over the step's tokens of jobs with beta > 0 (``kl_fraction`` of its tokens;
        ``train.kl_share`` of the micro-batches' cost, where the profile measured it)."""
        t = self.profile.train
        for n in microbatch_tokens:
            if n > t.max_profiled_tokens:
                self._note("train micro-batch tokens", n, t.max_profiled_tokens)
        if t.packed_pair_per_token is not None and t.max_profiled_packed_pairs is not None:
            for n in packed_pairs:
                if n > t.max_profiled_packed_pairs:
                    self._note("packed micro-batch query-key pairs", n, t.max_profiled_packed_pairs)
        pairs_s = t.per_microbatch.b_s_per_unit * (t.packed_pair_per_token or 0.0) * sum(packed_pairs)
        mb_s = sum(t.per_microbatch.a_s + t.per_microbatch.b_s_per_unit * n for n in microbatch_tokens)
        kl_s = (t.kl_share or 0.0) * kl_fraction * mb_s
        return mb_s + t.s_per_adapter * adapters + t.s_per_regroup_token * regroup_tokens + pairs_s + kl_s

    def handoff_s(self, sequences: int, audited: int, stacks: int = 1) -> float:
        """The host's handoff from a generation to its train step (``train.handoff_s_per_*``): ``sequences``
        trained, ``audited`` of them carrying the engine's logprobs, on a GPU of ``stacks`` stacks."""
        t = self.profile.train
        return handoff_seconds(t.handoff_s_per_sequence, t.handoff_s_per_audited, t.handoff_stacks_factor,
                               sequences, audited, stacks)

    @property
    def has_packed_attention(self) -> bool:
        """Whether the profile prices packed rows' masked attention (train.packed_pair_per_token)."""
        return self.profile.train.packed_pair_per_token is not None

    def _note(self, what: str, value: float, limit: float) -> None:
        key = f"{what}|{limit}"
        self._beyond[key] = max(self._beyond.get(key, value), value)

    def note_beyond(self, what: str, value: float, limit: float) -> None:
        """A quantity past the region the profile's terms were measured or fitted in (reports list
        the largest value seen: "WHAT up to VALUE > profiled LIMIT")."""
        self._note(what, value, limit)

    def note_unmodelled(self, what: str) -> None:
        """A setting the prediction prices with terms measured without it (reports list it)."""
        self._unmodelled.add(what)

    @property
    def flags(self) -> set[str]:
        """Where predictions extrapolated past the profiled region, one line per quantity."""
        out = set(self._unmodelled)
        for key, v in self._beyond.items():
            what, limit = key.split("|")
            out.add(f"{what} up to {v:g} > profiled {limit}")
        return out

    def assumptions(self) -> list[dict]:
        return [a.model_dump() for a in self.profile.assumptions]

    def validation(self) -> dict | None:
        """The profile's error bars: its held-out validation, and where it has a two-engine rate
        (``sharing.mps_engines``), that fit's leave-one-run-out error under ``stacks``, and its
        leave-one-day-out error where its runs came from several days."""
        v = self.profile.validation
        out = v.model_dump() if v is not None else None
        fit = (self.profile.measurements or {}).get("stacks") or {}
        if self.profile.sharing.mps_engines is not None and fit.get("rows"):
            days = fit.get("left_out_days") or {}
            out = dict(out or {}, stacks={"runs": len(fit["rows"]), "left_out_mape": fit.get("left_out_mape"),
                                          "left_out_worst": fit.get("left_out_worst"),
                                          "days": len(days.get("days") or {}), "day_mape": days.get("mape"),
                                          "day_worst": days.get("worst")})
        tfit = (self.profile.measurements or {}).get("stacks_trainer") or {}
        if self.profile.sharing.mps_stacks_trainer is not None and tfit.get("rows"):
            out = dict(out or {}, stacks_trainer={"runs": len(tfit["rows"]), "rate": self.profile.sharing.mps_stacks_trainer,
                                                  "left_out_mape": tfit.get("left_out_mape"),
                                                  "left_out_worst": tfit.get("left_out_worst"),
                                                  "fitted_on": tfit.get("fitted_on"),
                                                  "tie_engines": bool(tfit.get("tie_engines"))})
        return out
