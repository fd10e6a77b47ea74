"""Run configuration: the workload (jobs), the arm (policy, groups, sharing) and engine/trainer knobs.

pydantic v2 models with ``extra="forbid"``: a typo in a YAML key is an error naming the key, never a
silent default. Cross-field checks raise errors that name the fields and values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from nodus.tasks import TASK_NAMES

Policy = Literal["dedicated", "shared-sync", "overlap", "timeslice", "continuous"]
Sharing = Literal["none", "mps"]
POLICIES: tuple[str, ...] = ("dedicated", "shared-sync", "overlap", "timeslice", "continuous")
# Policies whose engine and trainer never run at once on a GPU: the MPS priority between them
# decides nothing there (a run keeps whatever trainer priority its processes have).
NO_CORUN_POLICIES: tuple[str, ...] = ("dedicated", "shared-sync")
SHARINGS: tuple[str, ...] = ("none", "mps")


def stacks_of(arm: dict | None) -> int:
    """A recorded arm's engine + trainer stacks (``arm.stacks``; 1 where the arm does not say: one
    stack, and every run recorded before the field): the one reading of it."""
    return int((arm or {}).get("stacks") or 1)


def corun_key(policy: str | None, stacks: int | None = 1) -> str | None:
    """The policy as ``NO_CORUN_POLICIES`` and ``drop_idle_priority`` read it: shared-sync on more
    than one stack co-runs one stack's trainer beside another's engine, so it is keyed apart
    ('shared-sync/k2')."""
    return policy if (stacks or 1) <= 1 or policy is None else f"{policy}/k{stacks}"


def drop_idle_priority(settings: dict, policy: str | None) -> dict:
    """``settings`` (a run's controls, or trainer options by name) without the trainer's priority
    where ``policy`` never co-runs engine and trainer (``NO_CORUN_POLICIES``): it decides nothing
    there, so it makes no configuration, label or priming of its own."""
    if policy not in NO_CORUN_POLICIES:
        return dict(settings)
    return {k: v for k, v in settings.items() if k != "trainer_priority"}


DEFAULT_MICROBATCH_TOKENS = 16384  # the trainer's micro-batch cap unless a config sets one


def packed_rows(share_prompts: int | None) -> int:
    """trainer.share_prompts as a configuration means it: K > 1 responses of a prompt to a row, and
    0 for plain rows, which both 0 and 1 (and a missing value) train. Run and sweep labels and
    configuration keys go through here, so a run with 1 is a repeat of one with 0."""
    share = share_prompts or 0
    return share if share > 1 else 0


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the field and the value."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LognormalLengths(_Model):
    """Long-tailed response lengths: lognormal around a median, capped at max_new_tokens."""

    kind: Literal["lognormal"] = "lognormal"
    median_tokens: float = Field(gt=0)  # median response length, tokens
    sigma: float = Field(ge=0, le=3)  # log-space spread; 0 gives a fixed length


class FixedLengths(_Model):
    """Every response has the same length (capped at max_new_tokens)."""

    kind: Literal["fixed"] = "fixed"
    tokens: int = Field(ge=1)


class ReplayLengths(_Model):
    """Lengths recorded in a real run's trace (spans JSONL), replayed per job and step."""

    kind: Literal["replay"] = "replay"
    trace: str  # path to a spans.jsonl whose generate spans carry `response_tokens`
    job: str | None = None  # job id in the trace to replay; default: the same job id


LengthModel = Annotated[Union[LognormalLengths, FixedLengths, ReplayLengths], Field(discriminator="kind")]


class DatasetSpec(_Model):
    """A job's own problems (nodus.tasks.datasets): JSONL of {"question", "answer"}, scored by the
    job's task family's answer check. Paths are read where the run starts."""

    train: str  # training problems
    eval: str | None = None  # held-out problems; default: the last eval_size of train, never trained on
    eval_size: int = Field(default=64, ge=1)


class JobSpec(_Model):
    """One customer's LoRA GRPO job."""

    id: str | None = None  # stable job id; default "job{index}"
    task: str  # task family, see `nodus tasks list`
    prompts_per_step: int = Field(default=8, ge=1)
    responses_per_prompt: int = Field(default=8, ge=1)
    max_new_tokens: int = Field(default=256, ge=1, le=32768)
    prompt_tokens: int | None = Field(default=None, ge=1)  # mean prompt length; default: the task's
    steps: int = Field(default=20, ge=1)
    lora_rank: int = Field(default=16, ge=1, le=512)
    learning_rate: float = Field(default=1e-5, gt=0, le=1.0)
    seed: int | None = None  # default: run seed * 1000 + job index
    lengths: LengthModel | None = None  # response-length model; default: the task's
    group: int | None = Field(default=None, ge=0)  # pin to a group (overlap; within its stack) or stack (timeslice)
    stack: int | None = Field(default=None, ge=0)  # pin to one of arm.stacks (nodus validate replays a run's own)
    prompt_pool: int | None = Field(default=None, ge=1)  # a finite training set of this many items
                                                         # (default: fresh items every step)
    # Seconds after the run's start that the job is submitted (default: at the start). It joins its
    # group's first generation that starts after; alone on its own GPU (dedicated) it starts at once.
    arrive_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    dataset: DatasetSpec | None = None  # the job's own problems in place of its family's generator
    # The job's own GRPO update (names as TRL's GRPOConfig and PEFT's LoraConfig); unset: nodus's
    # defaults (resolved by ``grpo_settings``). Trained in a shared batch, the job's step is the one
    # these settings give it alone.
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] | None = None  # default grpo
    epsilon: float | None = Field(default=None, gt=0, lt=1)  # PPO clip range below 1; default 0.2
    epsilon_high: float | None = Field(default=None, gt=0)  # clip range above 1; default epsilon
    beta: float | None = Field(default=None, ge=0, allow_inf_nan=False)  # KL to the base model; default 0
    max_grad_norm: float | None = Field(default=None, gt=0)  # default trainer.max_grad_norm
    weight_decay: float | None = Field(default=None, ge=0, allow_inf_nan=False)  # AdamW's; default 0
    lora_alpha: float | None = Field(default=None, gt=0, allow_inf_nan=False)  # default 2 x lora_rank

    @model_validator(mode="after")
    def _dataset_fits(self) -> "JobSpec":
        if self.dataset is None:
            return self
        from nodus.tasks.datasets import NO_DATASET_TASKS

        if self.task in NO_DATASET_TASKS:
            raise ValueError(f"dataset with task={self.task!r}: its check needs the numbers the family draws; a "
                             "dataset is scored by a value-answer family's check (gsm8k, modular, ...)")
        if self.prompt_pool is not None:
            raise ValueError("dataset with prompt_pool: the dataset is the job's training set; drop prompt_pool")
        return self

    @model_validator(mode="after")
    def _known_task(self) -> "JobSpec":
        if self.task not in TASK_NAMES:
            raise ValueError(f"task={self.task!r} is not a known task; known: {', '.join(TASK_NAMES)}")
        return self


class ArmSpec(_Model):
    """How the jobs share (or don't share) the GPU."""

    policy: Policy = "overlap"
    # overlap: phase-offset groups; timeslice: stacks; continuous: unused (every job its own group)
    groups: int = Field(default=2, ge=1)
    sharing: Sharing = "mps"
    # The trainer waits for a group's Publish (the engine loading its new adapters) before it takes
    # the next group's Train (default, and how every run before this field existed behaved).
    # False frees it as soon as the Train ended with the adapters saved: on the H200 under MPS that
    # ran 16-22% fewer steps per GPU-hour (session 6: the engine's adapter load, now beside a
    # training step, took 0.5-0.7 s instead of 0.2 s, and the group's next generation waits on it).
    trainer_waits_for_publish: bool = True
    # Engine + trainer stacks that split the jobs between them (shared-sync, overlap, continuous):
    # each stack's engine and trainer serve its own jobs only, under the arm's policy (overlap:
    # ``groups`` phase-offset groups in every stack), and the stacks share the GPU under the arm's
    # sharing. More than one engine process generates at once, each with a host thread of its own
    # (session 28: the one engine's thread at 85-91% of a core paced every shared run). 1: one
    # engine and one trainer for every job. timeslice's stacks are its groups.
    stacks: int = Field(default=1, ge=1)
    # Stacks in lockstep (shared-sync on arm.stacks > 1): each stack's next generation waits until
    # every stack has published its step, so the stacks generate together and train together. Free
    # stacks drift apart with their response lengths; over sessions 30-37's nineteen 8-job two-stack
    # runs, the runs whose trains lay more beside the other's train made more steps per GPU-hour
    # (Pearson r +0.48; experiments/stack_alignment.py). False: each stack goes at its own pace.
    # Measured on the H200 (session 38, one machine, seeds 1-4): -4.1% against free stacks.
    lockstep: bool = False
    # Stacks started out of step (shared-sync on arm.stacks > 1): stack k > 0 starts its first
    # generation when stack k-1's first generation ends, so it generates while stack k-1 trains;
    # after that every stack goes at its own pace. Over sessions 30-38's free two-stack runs a train
    # beside the other stack's generation took 0.92 s, one beside its train 1.19 s
    # (experiments/stack_alignment.py). False: every stack starts at once.
    offset_stacks: bool = False
    # Offset stacks held apart: a stack's next generation waits until it starts this share of its
    # cycle (its mean time from one generation's start to the next) after another stack's latest
    # generation start, and as long before the next one already set (0.5 with two stacks: exactly
    # out of step; with n stacks the share is of the cycle's n-th part, doubled). Measured on the H200
    # (session 40), offset stacks left to themselves fell in step within seven steps of a 20-step run.
    # Needs offset_stacks (the start). 0: not held.
    hold_apart: float = Field(default=0.0, ge=0.0, le=0.5)
    # The most jobs under way on the GPU at once (a service's slots); None: every job at once. A job
    # beyond it (arrived, not yet started) queues, by arrival then job order, and joins its group's
    # first generation after a running job ends. The engine then has that many adapter slots.
    max_active: int | None = Field(default=None, ge=1)
    # The most steps a job may run ahead of the least advanced job under way in its stack
    # (continuous and overlap, whose jobs or groups each go at their own pace); None: unbounded. A
    # job at the bound waits to generate until that job's training step lands. Under continuous,
    # jobs with short responses otherwise finish early, and the run's last seconds hold fewer jobs.
    # 0: every job generates step s only once each job of its stack has trained step s - 1.
    # Measured on an H100 (session 72, one stack, 8 jobs): 0 made 8.4% less than unbounded, the
    # engine idle while each step waited for its slowest job's train and publish.
    max_lead: int | None = Field(default=None, ge=0)


def trainer_freed(arm: dict) -> bool:
    """Whether a recorded run's trainer took the next group's train before the last publish ended:
    ``trainer_waits_for_publish`` false (absent: runs before the field, which waited) and
    phase-offset groups (one group, or one group per stack, trains again only after its own publish)."""
    return arm.get("trainer_waits_for_publish") is False and (
        (arm.get("policy") == "overlap" and (arm.get("groups") or 1) > 1) or arm.get("policy") == "continuous")


class EngineSpec(_Model):
    """The one vLLM engine (or one per stack for `timeslice`)."""

    max_num_seqs: int = Field(default=512, ge=1)  # continuous-batching cap on running sequences
    # Adapters one decode step can hold (vLLM max_loras; every job's stays loaded). None: one per job;
    # a new overlap run's config of more than 8 jobs sets its largest group's jobs, at least 8
    # (nodus.runner.size_engine_slots).
    max_loras: int | None = Field(default=None, ge=1)
    # The engine's largest CUDA graph, in tokens per step (vLLM's max_cudagraph_capture_size); a
    # step of more tokens runs without graphs, as one that admits a waiting prompt beside a full
    # decode batch does. None: vLLM's default (engine_graph_max_tokens); a new run's config sets
    # 2 x max_num_seqs where the sequences its adapter slots can hold exceed max_num_seqs
    # (size_engine_graphs, peak_engine_sequences).
    cuda_graph_max_tokens: int | None = Field(default=None, ge=1)
    _graphs_sized: bool = PrivateAttr(default=False)  # nodus chose cuda_graph_max_tokens (size_engine_graphs)


def engine_graph_max_tokens(engine: "EngineSpec") -> int:
    """The engine's largest CUDA-graph size in tokens: the configured one, else vLLM's default,
    min(2 x max_num_seqs, 512) (vllm.config.CompilationConfig.max_cudagraph_capture_size)."""
    return engine.cuda_graph_max_tokens or min(2 * engine.max_num_seqs, 512)


def peak_engine_sequences(cfg: "RunConfig") -> int:
    """The most sequences an engine may be asked to hold at once: one job's step under
    ``dedicated`` and ``timeslice`` (an engine serves one job at a time), every job's step otherwise
    (one shared-sync batch, or groups whose generations overlap when generating outlasts training),
    but at most the ``engine.max_loras`` largest jobs' (a decode step holds that many adapters)."""
    per_job = [j.prompts_per_step * j.responses_per_prompt for j in cfg.jobs]
    if cfg.arm.policy in ("dedicated", "timeslice"):
        return max(per_job)
    if cfg.arm.stacks > 1:  # an engine per stack, each serving its own stack's jobs
        from nodus.runner import stack_jobs

        ids_of = [j.id for j in cfg.resolved().jobs]
        return max(sum(sorted((p for j, p in zip(ids_of, per_job) if j in ids), reverse=True)[:cfg.engine.max_loras
                                                                                              or len(ids)])
                   for ids in stack_jobs(cfg))
    return sum(sorted(per_job, reverse=True)[:cfg.engine.max_loras or len(per_job)])


def size_engine_graphs(cfg: "RunConfig") -> "RunConfig":
    """A new run's CUDA-graph size: left unset, it covers a full decode batch beside an admitted
    prompt (2 x max_num_seqs) wherever the jobs' sequences, as many as its adapter slots hold
    (``peak_engine_sequences``), can exceed ``max_num_seqs``.

    There vLLM queues the rest, and each step that admits a waiting prompt into a freed slot
    carries its prefill beside ~max_num_seqs decoding sequences: past vLLM's default graphs (512
    tokens) such a step runs without them (~5x a graphed step on the H200). Measured on the H200,
    16 jobs shared-sync + MPS: 4436 steps per GPU-hour with 512-token graphs, 5752 with 1024
    (experiments/results/h200/session14). A set size is kept; recorded runs replay as recorded
    (only new configs, `config_from_args`, are sized)."""
    eng = cfg.engine
    if eng.cuda_graph_max_tokens is not None or peak_engine_sequences(cfg) <= eng.max_num_seqs:
        return cfg
    sized = eng.model_copy(update={"cuda_graph_max_tokens": 2 * eng.max_num_seqs})
    sized._graphs_sized = True
    return cfg.model_copy(update={"engine": sized})


def graph_sizes_given(engine_args) -> bool:
    """Whether vLLM engine arguments ((name, value) pairs or a dict) set the CUDA-graph sizes
    themselves: a compilation_config with capture sizes, or one nodus cannot merge a size into."""
    comp = dict(engine_args).get("compilation_config")
    if comp is None:
        return False
    return not isinstance(comp, dict) or "max_cudagraph_capture_size" in comp or "cudagraph_capture_sizes" in comp


def engine_args_size_graphs(cfg: "RunConfig", engine_args) -> "RunConfig":
    """A compilation_config in the engine arguments that sets the CUDA-graph sizes keeps them: a
    size nodus chose (size_engine_graphs) gives way, and the run records none (vLLM's as given; the
    engine reports what it ran). A size the config itself sets stays, and the engine refuses the pair."""
    if not (cfg.engine._graphs_sized and graph_sizes_given(engine_args)):
        return cfg
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"cuda_graph_max_tokens": None})})


class TrainerSpec(_Model):
    """The one trainer."""

    # 16k tokens: the trainer peaks at ~46 GiB on Qwen3-0.6B, leaving room for the engine (32k: ~80 GiB)
    max_tokens_per_microbatch: int = Field(default=DEFAULT_MICROBATCH_TOKENS, ge=256)
    max_grad_norm: float = Field(default=1.0, gt=0)
    # Up to this many responses of one prompt trained as one row, the prompt once (0 or 1: a row per
    # response). The real backend needs the graphed trainer for it; on the H200 K=4 ran a 4-job
    # step 1.25-1.29x faster (experiments/results/h200/session18/, section 4).
    share_prompts: int = Field(default=0, ge=0)


class AuditSpec(_Model):
    """The on-policy audit: which rollouts return the engine's logprobs of their sampled tokens, to be
    compared with the trainer's (strict on-policy is enforced by adapter versions either way; the
    engine's logprobs feed only this check, never the loss). The engine's logprob work is host work
    per sequence and decode step: on the H200 two stacks ran +13-15% auditing one response a prompt
    instead of every one (session 32), and one stack +14-27% without the audit (session 12). The
    real backend runs it (real.backend.RealOptions' audit fields come from here); the simulator
    prices it by the profile's decode.logprob_s_per_seq."""

    logprobs: bool = True  # False: no audit (the engine returns no logprobs)
    every: int = Field(default=1, ge=1)  # audit each job's steps 0, N, 2N, ...
    # On an audited step, the first K responses of each prompt return logprobs (None: every one).
    responses: int | None = Field(default=None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _canonical(cls, data):
        # No audit is one setting whatever its cadence says (equal to every other no-audit spec); a
        # cadence no audit could take is still refused by the fields' own checks.
        if isinstance(data, dict) and data.get("logprobs") is False:
            def valid(v):
                return v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1)
            if valid(data.get("every")) and valid(data.get("responses")):
                return {**data, "every": 1, "responses": None}
        return data

    def audits(self, step: int) -> bool:
        """Whether a job's step ``step`` is audited (its rollouts carry the engine's logprobs)."""
        return self.logprobs and step % self.every == 0

    def asking(self, step: int, responses: int) -> int:
        """How many of a prompt's ``responses`` return logprobs on a job's step ``step``."""
        if not self.audits(step):
            return 0
        return responses if self.responses is None else min(self.responses, responses)

    def audited(self, step: int, sequences: int, responses: int) -> int:
        """How many of a job's ``sequences`` on its step ``step`` return logprobs, its prompts'
        ``responses`` each (a last prompt with fewer counts as one)."""
        return (sequences // responses) * self.asking(step, responses) + self.asking(step, sequences % responses)

    def is_full(self) -> bool:
        return self.logprobs and self.every == 1 and self.responses is None

    @classmethod
    def from_record(cls, record: dict) -> "AuditSpec":
        """The audit a run's diagnostics recorded (``real.backend``'s ``audit``: logprobs, every,
        responses; a key missing, or {} for a run before the record: the full audit's)."""
        return cls(logprobs=record.get("logprobs", True) is not False, every=record.get("every") or 1,
                   responses=record.get("responses"))

    def words(self) -> str:
        """The audit in words when it is not the full one: "off", "every 4 steps", "1 response a
        prompt", "every 4 steps, 2 responses a prompt"; "" for the full audit."""
        if not self.logprobs:
            return "off"
        parts = [f"every {self.every} steps"] if self.every != 1 else []
        if self.responses is not None:
            parts.append(f"{self.responses} response{'s' if self.responses != 1 else ''} a prompt")
        return ", ".join(parts)


# trainer.share_prompts that `nodus run` and `nodus sim` use where neither the config nor
# --share-prompts sets it and the trainer is the graphed one (--trainer-graphs on the real backend,
# a graphed profile in the simulator; `with_default_packing`): each prompt's responses 4 to a row.
# On the H200 with the Qwen3-0.6B shape the packed step alone ran 1.2-1.3x faster (sessions 18, 20);
# 16 jobs in 2 groups under overlap + MPS gained 4.8% (session 20) and 8.5% / 9.5% (session 24), 8
# jobs in 2 groups 0.8% (session 20). The same loss and update as plain rows (to fp64 rounding on
# the CPU: tests/test_shared_prompts.py). Learning inside the gate's -0.05 bounds: overlap + MPS with
# K = 4 against dedicated jobs with plain rows, seeds 1-3 pooled (sessions 15/18/20/27, tiny base, 8
# jobs x 20 steps), accuracy +0.012 [-0.010, +0.035], reward +0.006 [-0.016, +0.026]
# (experiments/results/h200/session27/learning/; `nodus compare` still says FAIL there, on its
# throughput-noise criterion, for want of a same-day A/A). Packing alone has one test: a dedicated
# K = 4 run against another day's plain one (seed 1), reward -0.026 [-0.064, +0.017], under the
# bound. The eager trainer cannot pack: 0 there.
AUTO_SHARE_PROMPTS = 4


# The shipped profile a simulation uses unless told, the eager trainer's (the default configuration's;
# graphed arms take the profiles below): fitted on one day's 1-4-job runs on a 16-core Xeon H200 host,
# validated on that day's 8- and 16-job runs: calibration/reports/validation-h200-session8.md.
DEFAULT_PROFILE = "h200-xeon16-20261130-qwen3-0.6b"
# The shipped profile of each trainer step mode (train.step_mode) that real runs use: the graphed
# trainer's (--trainer-graphs, with the tuned LoRA kernels and the overlap trainer at below-normal
# MPS priority): fitted on session 16's day; on other days' runs under its MPS settings 9.6% per run
# over sessions 12-25 (59 runs, per-day mean 9.2%; experiments/results/crossday/crossday.md). It
# carries the packed-attention term (share_prompts rows; session 18's bench), which the later
# day profiles lack. Session 22's profile is closer on the days of the 8-slot, 512-token engine
# (sessions 23-25: 10.2% against 14.7% on the runs both are scored on) and further on sessions 12-21
# (8.5% against 6.8%).
DEFAULT_PROFILES = {"eager": DEFAULT_PROFILE, "graphed": "h200-xeon16-graphed-session16-qwen3-0.6b"}
# The graphed trainer's shipped profile whose MPS rates were fitted at the default trainer priority:
# for runs that co-run engine and trainer at that priority (11.8% on 34 other days' such runs).
GRAPHED_NORMAL_PRIORITY_PROFILE = "h200-xeon16-graphed-qwen3-0.6b"
# Session 16's graphed profile with the two-engine rate fitted on ten days' free-running two-stack
# runs (sessions 30-37 and session 38's two machines, 30 runs; each run from the others 4.8% off,
# worst 11.4%; each day from the other days' 5.0%, worst 11.9%) and the audit's term on two days'
# pairs (sessions 32-33), so a lighter audit is priced too. Its one trainer rate is the pair's
# (sharing.mps_corun), which prices a train beside another stack's generation 1.5-1.6 s against
# 0.9-1.0 s measured; it came out right on free stacks by errors that cancel (the generations
# priced short). The default for two stacks through session 40; on the 21 runs held out since the
# profile below was fitted (sessions 39-41, five machines): 7.5% / 7.8% MAPE (replay / sampled),
# worst 22.5%, bias -6.8% / -7.2%.
STACKS_PAIR_PROFILE = "h200-xeon16-graphed-stacks-audit-sessions30-38-qwen3-0.6b"
# The same base with a lone trainer's rate beside engines of stacks (sharing.mps_stacks_trainer
# 1.215, fitted on session 39's four offset-stack runs, the two-engine rate refitted with it on the
# same thirty runs: 0.869). Its trains come out as measured (0.9-1.0 s). On the 21 runs held out
# since its fit (sessions 39-41: free, offset, held and overlap stacks, five machines on three
# days): 7.0% / 7.0% MAPE, worst 17.1% / 16.6%, bias +1.7% / +1.9%; better than the pair's-rate
# profile above on all four (`experiments/results/h200/session41/`, section 3). Its trainer rate is
# above the trainer's alone rate under MPS (1.074): it carries the train terms' overpricing on these
# machines. Most of its error is the machine: on session 41's two machines it was +9 to +17% on one
# and -1 to -2% on the other, whose free runs differed by 16%.
# The default for two stacks in sessions 41-42. Its engine scale (decode.scale 1.226) came from
# session 16's dedicated runs (vLLM's default graph sizes, the trainer on torch's own threads): it
# priced today's dedicated runs (512-token graphs, 2 trainer threads) 10-19% slow, its stacks rates
# carried that, and its ratio over dedicated came out +15% on 11 same-machine pairs (sessions 39, 42).
STACKS_TRAINER_PROFILE = "h200-xeon16-graphed-stacks-audit-trainer-sessions30-39-qwen3-0.6b"
# The profile above with decode.scale refitted on 22 dedicated runs of sessions 31-38 at today's
# settings (nodus fit --decode-scale-only: 1.054) and both stacks rates fitted again on it, on the
# same runs (nodus fit-stacks --no-left-out: two engines 0.743, a lone trainer 0.888). On the 24
# runs held out (sessions 39-42, six machines): 7.7% / 7.8% MAPE, worst 18.8%, bias -0.4% (the
# profile above: 7.5% / 7.4%, worst 21.4%, bias +3.1%); the held-out days' dedicated runs -9 to +5%
# (above: -13 to -15% on session 42's); the ratio over dedicated on 11 same-machine pairs 7.9% off,
# bias +1.8% (above: 15.4%, +15.1%). experiments/results/h200/session42/README.md, section 4.
STACKS_DECODE_PROFILE = "h200-xeon16-graphed-stacks-audit-trainer-decode31-38-sessions30-39-qwen3-0.6b"
# #5's protocol for two stacks: fitted on runs of at most 4 jobs a GPU only. The pair's-rate profile
# of sessions 30-38 (above its trainer rate, STACKS_PAIR_PROFILE) with decode.scale refitted on the
# same 22 dedicated runs (1.054) and the stacks' three MPS rates fitted together on session 35's three
# two-stack runs of 2 and 4 jobs, to their mean generation and train-step times (nodus fit-stacks
# --rate phases, session 50): two engines 0.857, a lone trainer beside engines 0.921, an engine beside
# it 0.473. Held out: every two-stack run of 8 and 16 jobs of sessions 30-49 (81 runs, 10
# configurations): 5.0% / 4.9% MAPE (replay / sampled), worst 13.2%, bias -0.1%, tau 0.17; per
# configuration 4.1%, worst 11.4%, bias +1.4%, tau 0.60 (1.00 over the 15 of 45 pairs measured apart
# beyond noise); the machine's speed known 3.5%, worst 12.1% (60 runs); trains 9.0% off (bias +1.7%),
# generations 8.2% (+0.2%). Its predecessor (the same base, the two-engine rate alone fitted to
# steps/GPU-h: 0.825; h200-xeon16-graphed-stacks-audit-decode31-38-j2j4-session35-qwen3-0.6b) was at
# 5.1% / 5.1%, worst 15.6%, per configuration 5.3%, worst 10.1%, tau 0.42, with trains +24.6% and
# generations -7.8%: right in steps/GPU-h by errors that cancel, and 4-16% low on offset stacks.
# calibration/reports/stacks-h200-session35-j2j4-phases-decode31-38.md and
# validation-h200-stacks-protocol.md; the earlier profile: experiments/results/h200/session43/README.md.
STACKS_PROTOCOL3_PROFILE = "h200-xeon16-graphed-stacks-audit-decode31-38-j2j4phases-session35-qwen3-0.6b"
# Since session 57, #5's protocol profile: the same base and runs, with a fourth rate fitted with the
# three (nodus fit-stacks --rate phases, the two-trainer rate started where the three fit without
# it): two engines 0.855, a lone trainer beside engines 0.946, an engine beside it 0.480, each of two
# trainers training together 0.680 (the many-clients rule before it: 0.727). On the same 81 held-out
# runs: 4.7% / 4.6% MAPE, worst 12.2%, bias -0.2%, tau 0.15; per configuration 3.6%, worst 9.3%,
# bias +1.5%, tau 0.47 (1.00 over the 15 pairs measured apart); the machine's speed known 3.3%; train
# steps beside the other stack's throughout -6.6% (the three-rate profile: -7.4%), beside none +0.8%
# (+3.3%). calibration/reports/stacks-h200-session35-j2j4-phases4-decode31-38.md and
# validation-h200-stacks-protocol-trainers.md.
STACKS_PROTOCOL4_PROFILE = "h200-xeon16-graphed-stacks-audit-decode31-38-j2j4phases4-session35-qwen3-0.6b"
# Since session 64, #5's protocol profile: the same, with the host's handoff from a generation to its
# train step (train.handoff_s_per_sequence 0.0707 ms, _per_audited 0.1104 ms, on runs of one stack;
# handoff_stacks_factor 1.399 with two stacks or more; nodus fit-handoff on session 35's three fit
# runs and its dedicated runs, and session 33's dedicated runs under both audits, all at most 4 jobs a
# GPU). On the same 81 held-out runs: per configuration 3.6% / 3.5% (replay / sampled), worst 7.5% /
# 6.8%, bias +0.5% / +0.3%, tau 0.56 / 0.51 (1.00 over the 15 pairs measured apart); per run 4.7% /
# 4.7%, worst 13.4%, bias -1.2%. With session 71's three runs (84 runs, 11 configurations): 3.5% /
# 3.4%, worst 7.5%, bias +0.7% / +0.5%, tau 0.64 / 0.56 (1.00 over 16). calibration/reports/
# handoff-h200-protocol.md and validation-h200.md.
STACKS_PROTOCOL_PROFILE = "h200-xeon16-graphed-stacks-audit-decode31-38-j2j4phases4-handoff-session35-qwen3-0.6b"
# The shipped profile for two stacks (arm.stacks 2, shared-sync + MPS, the graphed trainer below
# normal, packed rows): `nodus sim --stacks N` takes it under MPS when no profile is chosen. Since
# session 58 the protocol profile: on the 22 two-stack runs of 8 and 16 jobs held out from both it
# and the decode profile above (sessions 40-49, seven machines) 4.6% MAPE, worst 12.1%, bias -0.3%
# against 7.2%, 18.8%, +4.3%; the ratio over the same machine's dedicated runs (7 pairs) 5.6% off
# against 10.3%; the machine's speed known 3.7% against 6.0%
# (calibration/reports/validation-h200-stacks-sessions40-49-*.md).
STACKS_PROFILE = STACKS_PROTOCOL_PROFILE
# The H100 80GB's two-stack profile: session 56's (session 53's H100 fit on two dedicated runs, with
# the stacks rates of `nodus fit-stacks --rate phases --tie-engines` on five 2-4-job runs) and, since
# session 60, the engine bench's slowdowns by engine size on an H100 (nodus calibrate-engines, two
# runs pooled: an engine and the other stack's lone trainer beside each other, and two engines), which
# its stacks rates follow past the fit runs' 128 sequences. On sessions 53-57's eight held-out runs:
# MAPE 4.3%, worst 12.7%, bias +3.9%, Kendall tau 0.71, against 5.1%, 14.3%, +4.9%, 0.50 without the
# bench (calibration/reports/validation-h100-stacks-bench60.md; session 56's profile stays shipped).
# Its error bar in session 66: the 31 runs of sessions 51-66 held out from its fit, on five
# machines, 10.8% MAPE per run (bias +10.7%), 2.3% with each machine's speed known
# (calibration/reports/validation-h100-stacks-bench60-sessions51-66.md).
# Since session 67 the shipped H100 profile is that one refitted by #5's protocol on one H100 day
# (session 67: `nodus fit --decode-scale-only` on its two dedicated runs, `nodus fit-stacks --rate
# phases --tie-engines` on its 2- and 4-job two-stack runs, `nodus fit-handoff` on the five; the
# flat handoff and one response a prompt audited, the reference workload's settings), the bench's
# slowdowns by engine size kept. On the 40 runs of sessions 51-67 it was not fitted on (twelve
# days, 13 machines): 5.4% MAPE per run, bias +2.7%, worst 13.9%; per configuration 5.3%, tau 0.68
# (0.95 over the pairs the runs tell apart); 3.4% with each machine's speed known. On the 32 runs
# of more than 4 jobs held out from both it is 5.6% where session 60's profile is 12.0% (bias +4.4%
# against +11.9%) (calibration/reports/validation-h100-stacks-session67.md). Those were all stack
# runs: session 69's one-stack arms of 8 jobs it prices +13.7% to +30.2% (its one-engine-one-trainer
# rates and decode shape are the H200's). Annotated since session 73 on the 59 runs of sessions
# 51-73 it was not fitted on (12 machines): 9.0% per run, bias +7.2%; runs of several stacks 5.8%
# (49 runs, bias +3.6%; session 73's two-stack continuous runs on a contended host 7.2%), one stack
# +13.7% to +45.6% (10 runs: sessions 69 and 72, 72's on a contended host); with each machine's speed
# known 3.5%; arm by arm in validation.arms
# (calibration/reports/validation-h100-stacks-session67-sessions51-73.md; before session 72's and
# 73's runs, 46 runs, 7.1%: validation-h100-stacks-session67-sessions51-69.md).
H100_STACKS_PROFILE = "h100-xeon16-graphed-stacks-tied-session67-qwen3-0.6b"
# The H100 80GB's one-stack profile (one engine and one trainer: shared-sync, overlap, with and
# without MPS), by #5's protocol on session 70's H100 day: `nodus calibrate --trainer-graphs` on the
# H100 (decode 8-512 sequences, 1 and 8 adapters; the trainer's terms from the three points timed
# graphed, its capture out of memory at the fourth), the audit term of nodus fit-audit as the stacks
# profile above has it, and `nodus fit --step-floor` on that day's seven runs of 1-4 jobs (a dedicated
# pair, overlap and shared-sync with and without MPS, a row per response): since session 71 each decode
# step costs max(curves x 0.920, 3.77 ms), the engine's per-step host floor fitted with the scale on
# the lone 64- and 256-sequence generations. On session 69's six one-stack runs of 8 jobs (another
# day's machine) it was not fitted on: 3.5% per run, bias +3.1%, worst +10.4% (overlap without MPS),
# per configuration 2.8%, tau 0.67. Session 70's profile without the floor (one scale, x1.275, from the
# dedicated runs' 64-sequence generations) priced lone large generations 27-33% long and the same runs
# at 4.8%, bias -4.4%, worst -13.6% (shared-sync without MPS); the stacks profile above +18.9%
# (calibration/reports/validation-h100-onestack-floor-session70.md, validation-h100-onestack-session70.md).
# It has no two-stack rates (nodus fit-stacks) and no packed-row attention term: sp4 runs are flagged.
H100_ONESTACK_PROFILE = "h100-xeon16-graphed-calibrated-onestack-floor-session70-qwen3-0.6b"

# A GPU of at most this much memory (GiB) is priced as the H100 80GB (79.2-79.6 GiB total; an H200
# reads 140.4): the device lends both, and each has its own shipped profiles.
H100_MAX_TOTAL_GIB = 100.0


def stacks_under_mps(policy: str | None, sharing: str | None, stacks: int | None) -> bool:
    """Whether an arm runs several engine + trainer stacks under MPS (arm.stacks > 1, not
    timeslice, whose stacks are its groups): the arms the stacks profiles price."""
    return (stacks or 1) > 1 and sharing == "mps" and policy != "timeslice"


def shipped_profile(trainer_graphs: bool, corun_priority: str | None = None, stacks_mps: bool = False,
                    gpu_total_gib: float | None = None, dedicated: bool = False) -> str:
    """The shipped profile that describes an arm: by its trainer (``trainer_graphs``: the graphed
    trainer's profiles; a graphed run against the eager trainer's profile read 4672 for a measured
    6459 in session 15's log), and for a graphed arm that co-runs engine and trainer under MPS, the
    one fitted at its trainer's priority (``corun_priority``; None: nothing co-runs). A graphed arm
    of several stacks under MPS (``stacks_mps``, not timeslice) takes the stacks profile (session
    39's device log printed 7182 for two-stack runs of 8421-8865 on the profile without a two-engine
    rate). On an H100 80GB (``gpu_total_gib`` at most ``H100_MAX_TOTAL_GIB``; None: the H200) a
    graphed arm takes the H100's own profiles: the stacks one for stacks under MPS, else the
    one-stack one (session 73's H100 log printed the H200 stacks profile's 7915 against 8150 for
    two-stack continuous against shared-sync, which measured 7669 against 7511 mean; the H100
    stacks profile replays them in that order). A graphed ``dedicated`` arm takes the stacks
    profile too, so that a stacked arm's ratio is over a dedicated figure of the same profile. On
    the H200 that profile grew from the one-stack profile (session 16's runs) with the engine's
    scale refitted on sessions 31-38's dedicated runs; on the 25 held-out dedicated runs of sessions
    39-71 it was 3.1% per configuration (13.2% per run, contended hosts among them) against the
    one-stack profile's 7.4% (14.0%); session 71's seven: 5.5% against 11.4%. On the H100's 18
    dedicated runs of sessions 51-72, 5.4% per configuration (10.8% per run) against the one-stack
    profile's 6.4% (11.4%). `gpu_arms` prices its arms by it and `nodus validate` recorded runs
    (``calibration.run_settings.run_profile``)."""
    if trainer_graphs and gpu_total_gib is not None and gpu_total_gib <= H100_MAX_TOTAL_GIB:
        return H100_STACKS_PROFILE if stacks_mps or dedicated else H100_ONESTACK_PROFILE
    if trainer_graphs and (stacks_mps or dedicated):
        return STACKS_PROFILE
    if trainer_graphs and corun_priority == "normal":
        return GRAPHED_NORMAL_PRIORITY_PROFILE
    return DEFAULT_PROFILES["graphed" if trainer_graphs else "eager"]


GPUS: tuple[str, ...] = ("h200", "h100")  # the GPUs with shipped profiles (--gpu)


def planning_profile(gpu: str, stacks_mps: bool) -> str:
    """The shipped profile `nodus sim`, `nodus sweep` and `nodus plan` take unless told (--profile,
    or a config's ``profile``) for the GPU the plan is for (--gpu): on the H200 the default profile
    (the eager trainer's), or the stacks profile for stacks under MPS (``stacks_mps``); on an H100
    80GB the H100's own, the graphed trainer's (the only trainer measured there): its stacks profile
    for stacks under MPS, else its one-stack profile (``shipped_profile``)."""
    if gpu not in GPUS:
        raise ConfigError(f"--gpu {gpu!r}: choose from {', '.join(GPUS)} (the GPUs with shipped profiles; "
                          "--profile names any other)")
    if gpu == "h100":
        return shipped_profile(True, None, stacks_mps, H100_MAX_TOTAL_GIB)
    return STACKS_PROFILE if stacks_mps else DEFAULT_PROFILE


class RunConfig(_Model):
    """Everything one run needs; `resolved()` fills defaults that depend on other fields."""

    jobs: list[JobSpec]
    arm: ArmSpec = ArmSpec()
    engine: EngineSpec = EngineSpec()
    trainer: TrainerSpec = TrainerSpec()
    audit: AuditSpec = AuditSpec()
    seed: int = 1
    profile: str = DEFAULT_PROFILE  # shipped profile name or path to a profile JSON

    @model_validator(mode="after")
    def _cross_checks(self) -> "RunConfig":
        n = len(self.jobs)
        if n == 0:
            raise ValueError("jobs=0: a workload needs at least one job")
        if self.arm.policy == "overlap" and self.arm.groups < 2:
            raise ValueError(f"arm.groups={self.arm.groups} with policy='overlap': overlap needs groups >= 2 "
                             "(one group is policy='shared-sync')")
        if self.arm.groups > n and self.arm.policy in ("overlap", "timeslice"):
            raise ValueError(f"arm.groups={self.arm.groups} > jobs={n}: every group needs at least one job")
        if self.arm.stacks > 1:
            if self.arm.policy in ("dedicated", "timeslice"):
                raise ValueError(f"arm.stacks={self.arm.stacks} with policy={self.arm.policy!r}: "
                                 + ("a dedicated job has its own GPU" if self.arm.policy == "dedicated" else
                                    "timeslice's stacks are its groups (arm.groups)"))
            per = self.arm.groups if self.arm.policy == "overlap" else 1
            if self.arm.stacks * per > n:
                raise ValueError(f"arm.stacks={self.arm.stacks} x {per} group(s) a stack > jobs={n}: every stack's "
                                 "every group needs at least one job")
            stacked = [j.stack for j in self.jobs if j.stack is not None]
            if stacked and (len(stacked) != n or set(stacked) != set(range(self.arm.stacks))):
                raise ValueError(f"jobs[].stack={sorted(set(stacked))}: pin every job to one of stacks "
                                 f"0..{self.arm.stacks - 1}, using each, or none")
            if any(j.group is not None for j in self.jobs) and self.arm.policy != "overlap":
                raise ValueError(f"jobs[].group with arm.stacks={self.arm.stacks} and policy={self.arm.policy!r}: "
                                 "only overlap has groups within a stack; pin none")
            if any(j.group is not None for j in self.jobs) and not stacked:
                raise ValueError(f"jobs[].group with arm.stacks={self.arm.stacks}: pin each job's stack too "
                                 "(jobs[].stack), or none (jobs are split by their predicted work)")
            if stacked and self.arm.policy == "overlap":
                for st in range(self.arm.stacks):
                    got = {j.group for j in self.jobs if j.stack == st}
                    if got != set(range(self.arm.groups)):
                        raise ValueError(f"jobs[].group={sorted(got, key=str)} in stack {st}: pin every job of each "
                                         f"stack to one of groups 0..{self.arm.groups - 1}, using each")
        elif any(j.stack is not None for j in self.jobs):
            raise ValueError(f"jobs[].stack with arm.stacks={self.arm.stacks}: a stack pin needs arm.stacks > 1")
        sync_stacks = self.arm.stacks >= 2 and self.arm.policy == "shared-sync"  # what lockstep and offset need
        if self.arm.lockstep and not sync_stacks:
            raise ValueError(f"arm.lockstep with arm.stacks={self.arm.stacks} and policy={self.arm.policy!r}: lockstep "
                             "holds each stack's generation for the other stacks' publishes; it needs policy "
                             "'shared-sync' on arm.stacks >= 2")
        if self.arm.hold_apart and not sync_stacks:
            raise ValueError(f"arm.hold_apart with arm.stacks={self.arm.stacks} and policy={self.arm.policy!r}: it "
                             "holds stacks apart; it needs policy 'shared-sync' on arm.stacks >= 2")
        if self.arm.offset_stacks and not sync_stacks:
            raise ValueError(f"arm.offset_stacks with arm.stacks={self.arm.stacks} and policy={self.arm.policy!r}: it "
                             "starts each stack when the one before has generated; it needs policy 'shared-sync' "
                             "on arm.stacks >= 2")
        if self.arm.hold_apart and not self.arm.offset_stacks:
            raise ValueError(f"arm.hold_apart={self.arm.hold_apart} without arm.offset_stacks: it holds apart stacks "
                             "that offset_stacks started apart; set offset_stacks: true too (nodus sim/run "
                             "--hold-apart sets both)")
        if self.arm.offset_stacks and self.arm.lockstep:
            raise ValueError("arm.offset_stacks with arm.lockstep: lockstep holds the stacks in step, "
                             "offset_stacks starts them out of step; choose one")
        if self.arm.max_active is not None and self.arm.policy == "dedicated":
            raise ValueError(f"arm.max_active={self.arm.max_active} with policy='dedicated': each job has a GPU of "
                             "its own; the cap is for jobs sharing one")
        if self.arm.max_active is not None and self.arm.lockstep:
            raise ValueError("arm.max_active with arm.lockstep: every stack would wait for a job yet to get a "
                             "slot; run the stacks free (no lockstep)")
        if self.arm.max_lead is not None and self.arm.policy not in ("continuous", "overlap"):
            raise ValueError(f"arm.max_lead={self.arm.max_lead} with policy={self.arm.policy!r}: it bounds how far "
                             "a job or group runs ahead of the others in its stack, which only 'continuous' and "
                             "'overlap' let them do; drop it or choose one of those")
        arrivals = [j.arrive_s or 0.0 for j in self.jobs]
        if max(arrivals) > 0:
            if min(arrivals) > 0:
                raise ValueError(f"jobs[].arrive_s: the first job arrives at {min(arrivals):g} s, but a run's GPU is "
                                 "booked from its start: shift the arrivals so the first is 0")
            if self.arm.lockstep:
                raise ValueError("jobs[].arrive_s with arm.lockstep: every stack would wait for a job yet to "
                                 "arrive; run the stacks free (no lockstep)")
        pinned = [j.group for j in self.jobs if j.group is not None]
        if pinned and self.arm.policy in ("overlap", "timeslice") and self.arm.stacks == 1:
            if len(pinned) != n:
                raise ValueError("jobs[].group: pin every job to a group or none")
            if max(pinned) >= self.arm.groups or len(set(pinned)) != self.arm.groups:
                raise ValueError(f"jobs[].group={sorted(set(pinned))} must use each of groups 0..{self.arm.groups - 1}")
        ids = [j.id for j in self.jobs if j.id is not None]
        if len(ids) != len(set(ids)):
            raise ValueError(f"jobs[].id must be unique, got {ids}")
        return self

    def trainer_packing(self) -> int:
        """The responses a packed row holds as the trainer runs this config: trainer.share_prompts
        capped at the most responses a job samples per prompt (a prompt drawn twice in one step then
        never packs wider than the warm-up captured); 0 where that is 1 or less: plain rows."""
        return packed_rows(min(self.trainer.share_prompts, max(j.responses_per_prompt for j in self.jobs)))

    def resolved(self) -> "RunConfig":
        """Return a copy where every job has its id and seed filled in."""
        jobs = []
        for i, j in enumerate(self.jobs):
            jobs.append(j.model_copy(update={
                "id": j.id or f"job{i}",
                "seed": j.seed if j.seed is not None else self.seed * 1000 + i,
            }))
        return self.model_copy(update={"jobs": jobs})


def grpo_settings(job: JobSpec, trainer: "TrainerSpec") -> dict:
    """A job's resolved update settings, by the trainer's names (real.trainer.JobConfig): its own
    where set, else nodus's defaults (grpo loss, clip 0.2 both ways, no KL, AdamW without weight
    decay, LoRA alpha twice the rank, the trainer's gradient clip). dr_grpo's constant length is
    the job's max_new_tokens, as TRL's max_completion_length."""
    loss = job.loss_type or "grpo"
    eps = job.epsilon if job.epsilon is not None else 0.2
    return {"alpha": job.lora_alpha if job.lora_alpha is not None else 2.0 * job.lora_rank,
            "loss_type": loss, "epsilon_low": eps,
            "epsilon_high": job.epsilon_high if job.epsilon_high is not None else eps,
            "beta": job.beta or 0.0, "weight_decay": job.weight_decay or 0.0,
            "max_grad_norm": job.max_grad_norm if job.max_grad_norm is not None else trainer.max_grad_norm,
            "max_completion_length": job.max_new_tokens if loss == "dr_grpo" else None}


def default_jobs(n: int, steps: int = 20, **job_fields) -> list[JobSpec]:
    """n jobs cycling through the task families, the reference workload shape."""
    if n < 1:
        raise ConfigError(f"jobs={n}: a workload needs at least one job")
    return [JobSpec(task=TASK_NAMES[i % len(TASK_NAMES)], steps=steps, id=f"job{i}", **job_fields)
            for i in range(n)]


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown key {loc!r}"
        elif "input" in e and e["type"] not in ("missing",) and not isinstance(e["input"], (dict, list)):
            msg = f"{msg} (got {loc}={e['input']!r})"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def build_config(data: dict, source: str = "config") -> RunConfig:
    """Validate a dict into a resolved RunConfig, raising ConfigError with a readable message."""
    try:
        return RunConfig.model_validate(data).resolved()
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def load_config(path: str | Path) -> dict:
    """Read a YAML or JSON config file into a dict (validation happens in build_config)."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top, got {type(data).__name__}")
    return data


def with_default_packing(cfg: RunConfig, graphed: bool) -> RunConfig:
    """``cfg`` with trainer.share_prompts = ``AUTO_SHARE_PROMPTS``, capped at the most responses a
    job samples per prompt, where the config leaves the field unset, the trainer is the graphed one
    (``graphed``) and that packs rows (a cap of 1: plain rows, ``cfg`` as it is); otherwise ``cfg``
    as it is. A config or --share-prompts that sets it, 0 included, is kept. A config without the
    field gets the default, run folders recorded before session 20 among them."""
    if not graphed or "share_prompts" in cfg.trainer.model_fields_set:
        return cfg
    share = packed_rows(min(AUTO_SHARE_PROMPTS, max(j.responses_per_prompt for j in cfg.jobs)))
    if not share:
        return cfg
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"share_prompts": share})})
