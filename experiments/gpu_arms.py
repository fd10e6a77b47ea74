"""Every arm through the real backend on one GPU, with the simulator's prediction beside each.

    PYTHONPATH=/opt/nodus-site:. python experiments/gpu_arms.py --out $OUT/arms --jobs 8 --steps 5 --seeds 1

Timing runs: a Qwen3-0.6B-shaped model with random weights saved once (so engine and trainer hold
the same weights and the logprob audit means something), token-id prompts, response lengths
forced to each task's length model (`--mode synthetic`). Arms that share a sharing mode and stack
count share one set of processes (engine start is not billed to any arm). Writes per-arm run
folders, `arms.json` (per arm, per seed: steps_per_gpu_hour, ratio_vs_dedicated, ...) and the
simulator's prediction for the same configurations under `--profile`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from pathlib import Path

ARMS = {  # name: (policy, groups, sharing); grouped by the processes they need
    "dedicated": ("dedicated", 1, "none"),
    "shared-sync": ("shared-sync", 1, "none"),
    "overlap": ("overlap", 2, "none"),
    "overlap+mps": ("overlap", 2, "mps"),
    "shared-sync+mps": ("shared-sync", 1, "mps"),
    "timeslice": ("timeslice", 2, "none"),
    # Each job its own group; the trainer takes every job whose rollouts are in (nodus.runner.plan).
    "continuous": ("continuous", 1, "none"),
    "continuous+mps": ("continuous", 1, "mps"),
}


# What a run costs on the H200 before an invocation has measured its own (sessions 29-31): a new
# cluster's start and its priming step took 219-276 s for one stack and 230-398 s for two (a GPU's
# engines start one after another); a priming step on running processes 8-137 s; a run's wall
# 1.2-2.4x the simulator's GPU-seconds for it (each job's setup, evaluation and last publish lie
# outside the measured window).
START_S = (150.0, 125.0)  # a new cluster: a + b x stacks
PRIME_S = 60.0
WALL_OVER_SIM = 2.0


class Estimates:
    """Seconds a run will take (``--deadline``, ``--plan``): the invocation's own measurements where it
    has them (a start of the same sharing mode and stack count; its priming steps; the same arm's largest wall over
    the simulator's GPU-seconds, else any arm's), the H200's figures above until then.

    ``path`` (``--estimates``): a JSON file of starts and run factors measured by earlier invocations
    on this machine, read at the start and rewritten after each measurement, so that the next call
    on a warm machine (its compile cache and page cache warm: session 43's starts took 110-256 s
    against the defaults' 275-400 s) plans with them. Each start and each factor keeps the slowest
    measured (a deadline errs toward skipping). A file that does not read as one is refused by name."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.start: dict[tuple[str, int], float] = {}  # (sharing, stacks) -> a start and priming step here
        self.prime: list[float] = []  # priming steps on running processes here
        self.factor: dict[str, float] = {}  # arm name -> a run's wall over its simulated GPU-seconds
        if path is not None and path.exists():
            try:
                data = json.loads(path.read_text())
                self.start = {(k.split("/")[0], int(k.split("/")[1])): float(v) for k, v in data["start"].items()}
                self.factor = {k: float(v) for k, v in data["factor"].items()}
            except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
                raise SystemExit(f"gpu_arms: --estimates {path}: not an estimates file ({type(err).__name__}: {err}); "
                                 "remove it to start from the H200 defaults") from None

    def prime_s(self, action: str, sharing: str, stacks: int) -> float:
        """A priming step's seconds after the pool's ``action`` (ClusterPool.plan: "start" includes the
        start of ``stacks`` stacks under ``sharing``)."""
        if action == "start":
            return self.start.get((sharing, stacks), START_S[0] + START_S[1] * stacks)
        return max(self.prime, default=PRIME_S)

    def run_s(self, name: str, sim_gpu_s: float) -> float:
        return (self.factor.get(name) or max(self.factor.values(), default=WALL_OVER_SIM)) * sim_gpu_s

    def primed(self, action: str, sharing: str, stacks: int, seconds: float) -> None:
        if action == "start":
            self.start[(sharing, stacks)] = max(self.start.get((sharing, stacks), 0.0), seconds)
            self._save()
        else:
            self.prime.append(seconds)

    def ran(self, name: str, sim_gpu_s: float, seconds: float) -> None:
        if sim_gpu_s > 0:  # the arm's slowest run yet: a deadline errs toward skipping
            self.factor[name] = max(self.factor.get(name, 0.0), seconds / sim_gpu_s)
            self._save()

    def _save(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"start": {f"{k[0]}/{k[1]}": v for k, v in sorted(self.start.items())},
                                             "factor": dict(sorted(self.factor.items()))}, indent=1))


def interleave_rounds(order: list, rounds: int, default_jobs: int = 0) -> list[tuple[tuple, int]]:
    """(spec, round) in run order: each block of arms that share a set of processes (same sharing
    mode, timeslice or not, stacks and a stacked arm's jobs, ``default_jobs`` where it names none:
    ``order`` is sorted that way) run ``rounds`` times in turn, A B A B, so
    repeats share the host's state without restarting the processes between them."""
    if rounds < 1:
        raise SystemExit(f"--rounds {rounds}: at least 1")

    def block(sp):
        return ARMS[sp[0]][0] == "timeslice", arm_stacks(sp), ARMS[sp[0]][2], stacked_jobs(sp, default_jobs)

    out, i = [], 0
    while i < len(order):
        j = i
        while j < len(order) and block(order[j]) == block(order[i]):
            j += 1
        out += [(sp, r) for r in range(1, rounds + 1) for sp in order[i:j]]
        i = j
    return out


def arm_stacks(spec) -> int:
    """A ``parse_arm`` spec's engine + trainer stacks (its ``kN``; 1 without)."""
    return spec[6].get("stacks", 1)


def stacked_jobs(spec, default_jobs: int = 0) -> int:
    """A stacked arm's job count (its ``jN``, else ``default_jobs``), 0 for one stack: each stack's
    engine is sized for its own stack's jobs (``max_num_seqs``), so two-stack arms of 8 and 16 jobs
    need different processes (session 31), where one stack's engine serves every job count."""
    return (spec[1] or default_jobs) if arm_stacks(spec) > 1 else 0


def invocation_graph_size(specs: list, job_counts: list[int], workload) -> int | None:
    """The CUDA-graph size for every arm of one invocation: the largest a new config of any of its
    arms (``parse_arm`` specs, at each job count it runs) gets from nodus.config.size_engine_graphs,
    None where none gets one. ``workload(n)``: the invocation's config dict for n jobs."""
    from nodus.simulate import config_from_args

    sized = []
    for sp in specs:
        policy, groups, sharing = ARMS[sp[0]]
        for n in [sp[1]] if sp[1] else job_counts:
            if (sp[2] or groups) <= n:  # more groups than jobs: the arm skips that count
                cfg = config_from_args(workload(n), policy=policy, groups=sp[2] or groups, sharing=sharing, steps=1)
                sized.append(cfg.engine.cuda_graph_max_tokens or 0)
    return max(sized, default=0) or None


def largest_arm(specs: list, job_counts: list[int]) -> int:
    """The most jobs any arm of the invocation runs (an arm's own jN, else each of ``job_counts``, --jobs)."""
    return max(n for sp in specs for n in ([sp[1]] if sp[1] else job_counts))


def pool_slots(engine_slots: int | None, specs: list, job_counts: list[int]) -> int:
    """The adapter slots every engine of an invocation gets: ``engine_slots`` (--engine-slots) or the
    largest arm's jobs. It is every arm's ``engine.max_loras`` (so no arm gets an engine of its own
    sized to its groups, ``nodus.runner.size_engine_slots``): the engine runs at most that many
    adapters in a decode step (one group's at 8 jobs in 2 groups on 4), and keeps every job's adapter
    loaded (``nodus.realrun.ClusterPool`` min_cpu_loras)."""
    if engine_slots is None:
        return largest_arm(specs, job_counts)
    if engine_slots < 1:
        raise SystemExit(f"gpu_arms: --engine-slots {engine_slots}: an engine needs at least 1 adapter slot")
    return engine_slots


def engine_section(slots: int, graph_max_tokens: int | None) -> dict:
    """Every arm's config ``engine``: the invocation's adapter slots (the simulator admits that many
    adapters a step), so that no arm gets a new engine sized to its own groups
    (``nodus.runner.size_engine_slots``), and its CUDA-graph size where given."""
    return {**({"cuda_graph_max_tokens": graph_max_tokens} if graph_max_tokens else {}), "max_loras": slots}


def slots_key(engine_slots: int, jobs: int) -> str:
    """'-ls<N>' for an arm whose engine has other than one adapter slot per job: more (the invocation's
    largest arm sizes the pool's engine, ``nodus.realrun.ClusterPool`` min_loras; session 21: 8-job arms
    on a 16-job call's engine ran 6-13% slower) or fewer (--engine-slots below the arm's jobs); ''
    otherwise."""
    return f"-ls{engine_slots}" if engine_slots != jobs else ""


def own_seed_notes(arms: list[tuple[str, list[int] | None]], seeds_arg: str | None) -> list[str]:
    """A line for each arm (its --arms text and its own seeds, parse_arm's) whose own seeds (:sN)
    are not all among an explicit --seeds: the arm runs its own, and --seeds does not reach it
    (session 63 asked --seeds 2 of an arm named :s1 and ran seed 1 again)."""
    if seeds_arg is None:
        return []
    asked = {int(s) for s in seeds_arg.split(",") if s}
    notes = []
    for text, own in arms:
        if own and not set(own) <= asked:
            notes.append(f"note: arm {text} names its own seed(s) {','.join(map(str, own))} (:sN) and runs "
                         f"those; --seeds {seeds_arg} applies only to arms without one")
    return notes


def parse_arm(text: str) -> tuple[str, int | None, int | None, list[int] | None, int | None, bool | None, dict]:
    """'overlap+mps:j16:g3:s1:m32768:free:cg:lowpri:t50' -> ('overlap+mps', 16, 3, [1], 32768, False,
    {'trainer_graphs': True, 'trainer_priority': 'below-normal', 'trainer_thread_pct': 50}); a bare
    name leaves jobs, groups, seeds and micro-batch tokens to --jobs, --groups, --seeds and
    --mb-tokens (sN may repeat: :s1:s2). `wait` / `free`: arm.trainer_waits_for_publish True / False
    (None, the default True, unless asked; `free`: the trainer takes the next train while the engine
    loads the last adapters). The last field: this arm's trainer settings over the command line's
    (`cg` / `nocg`: --trainer-graphs on / off; `lowpri`: MPS client priority below-normal; `tN`: the
    trainer's MPS active thread percentage; `cpuN`: torch's CPU threads in the trainer, cpu0 torch's default): arms that
    differ only in these share the engines, and only the trainer processes restart between them; and
    `aN`, the logprob audit every N-th step of
    each job (`a0`: none), `rK`, the audit of the first K responses of each prompt, `np`, the
    engine's adapter loads into pageable host memory, and `flat` / `peft`, the adapter handoff (flat
    files, the default, or PEFT folders) (settings of the run loop only: no process restarts). `kN`
    (arm.stacks), `lock` (arm.lockstep: a shared-sync kN arm's stacks in lockstep), `off`
    (arm.offset_stacks: a shared-sync kN arm's stacks started out of step), `holdF` (arm.hold_apart:
    offset stacks held apart, F in hundredths of a cycle, hold50: exactly out of step; sets off) and
    `spK` (trainer.share_prompts) and `leadK` (arm.max_lead: a continuous or overlap arm's jobs or
    groups at most K steps ahead) are the run config's, carried in the same dict, as are `nN` (this
    arm's steps a job, over --steps) and `lsN`: a kN
    arm's engine adapter slots (each stack's engine), in place of one per job of a stack, so that
    arms of several job counts run on one engine (one cluster start)."""
    name, *opts = text.strip().split(":")
    if name not in ARMS:
        raise SystemExit(f"--arms: unknown arm {name!r}; choose from {', '.join(ARMS)}")
    jobs = groups = mb = None
    wait: bool | None = None
    seeds: list[int] | None = None
    trainer: dict = {}
    for o in opts:
        if o in ("wait", "free"):
            wait = o == "wait"
        elif re.fullmatch(r"sp[0-9]+", o):
            # The run config's trainer.share_prompts (each prompt's responses K to a row, the
            # prompt once): the trainers keep running, the step is the run's own.
            trainer["share_prompts"] = int(o[2:])
        elif o in ("cg", "nocg"):
            trainer["trainer_graphs"] = o == "cg"
        elif o == "lowpri":
            trainer["trainer_priority"] = "below-normal"
        elif re.fullmatch(r"k[1-9][0-9]*", o):
            # The run config's arm.stacks: N engine + trainer stacks splitting the jobs (their own
            # processes: the pool starts a cluster of N stacks).
            if ARMS[name][0] in ("dedicated", "timeslice") and int(o[1:]) > 1:
                raise SystemExit(f"--arms {text!r}: {o!r}: {name} runs no shared stacks (dedicated: a GPU a job; "
                                 "timeslice: its groups are its stacks)")
            trainer["stacks"] = int(o[1:])
        elif o == "lock":
            # The run config's arm.lockstep (shared-sync on kN): each stack's next generation waits
            # for every stack's publish. A schedule of the run, not a process setting.
            trainer["lockstep"] = True
        elif o == "off":
            # The run config's arm.offset_stacks (shared-sync on kN): stack k starts when stack k-1's
            # first generation ends. A schedule of the run, not a process setting.
            trainer["offset_stacks"] = True
        elif re.fullmatch(r"hold[1-9][0-9]?", o) and int(o[4:]) <= 50:
            # The run config's arm.hold_apart (in hundredths of a cycle), with the offset start it needs.
            trainer["hold_apart"] = int(o[4:]) / 100
            trainer["offset_stacks"] = True
        elif re.fullmatch(r"lead[0-9]+", o):
            # The run config's arm.max_lead: a continuous (or overlap) arm's jobs (groups) at most K
            # steps ahead of the least advanced of their stack. A schedule of the run, not a process setting.
            if ARMS[name][0] not in ("continuous", "overlap"):
                raise SystemExit(f"--arms {text!r}: {o!r} bounds how far a job runs ahead of the others in its "
                                 "stack: a continuous or overlap arm only")
            trainer["max_lead"] = int(o[4:])
        elif re.fullmatch(r"n[1-9][0-9]*", o):
            # This arm's steps a job, over --steps: one call runs dedicated runs of 5 steps beside
            # two-stack runs of 20 (session 42's --steps 20 gave its dedicated run 20 too: 220 s, and
            # the deadline skipped the two-stack runs after it).
            trainer["steps"] = int(o[1:])
        elif re.fullmatch(r"ls[1-9][0-9]*", o):
            # A kN arm's engine adapter slots (vLLM max_loras of each stack's engine), in place of
            # one per job of its stack: arms of several job counts on one engine (one cluster start).
            trainer["engine_slots"] = int(o[2:])
        elif re.fullmatch(r"cpu(0|[1-9][0-9]*)", o):
            trainer["trainer_cpu_threads"] = int(o[3:])
        elif len(o) > 1 and o[0] == "t" and o[1:].isdigit() and 1 <= int(o[1:]) <= 100:
            trainer["trainer_thread_pct"] = int(o[1:])
        elif len(o) > 1 and o[0] == "a" and o[1:].isdigit():
            # A run-loop setting: every process kept. a0: no audit; aN: audit every N-th step.
            trainer.update({"audit_logprobs": False} if int(o[1:]) == 0
                           else {"audit_logprobs": True, "audit_every": int(o[1:])})
        elif o == "np":
            # A run-loop setting too: the engine loads published adapters into pageable host memory.
            trainer["publish_pinned"] = False
        elif o in ("flat", "peft"):
            # A run-loop setting too (every process kept): new adapter versions reach the engines as
            # flat files (real/flat_adapter.py: one write, one read; RealOptions' default since session
            # 65) or as PEFT safetensors folders (every run before it that did not ask for :flat).
            trainer["adapter_format"] = "flat" if o == "flat" else "safetensors"
        elif len(o) > 1 and o[0] == "r" and o[1:].isdigit() and int(o[1:]) >= 1:
            # A run-loop setting too: the first K responses of each prompt audited (an audit, also
            # under --no-audit).
            trainer.update({"audit_logprobs": True, "audit_responses": int(o[1:])})
        elif len(o) > 1 and o[0] in "jgsm" and o[1:].isdigit() and (int(o[1:]) >= 1 or o[0] == "s") \
                and (o[0] != "m" or int(o[1:]) >= 256):
            if o[0] == "j":
                jobs = int(o[1:])
            elif o[0] == "g":
                groups = int(o[1:])
            elif o[0] == "m":
                mb = int(o[1:])
            else:
                seeds = (seeds or []) + [int(o[1:])]
        else:
            raise SystemExit(f"--arms {text!r}: {o!r} is not jN (job count), gG (groups), sN (seed), "
                             "mN (trainer micro-batch tokens, >= 256), wait or free (trainer waits for each publish, the "
                             "default, or takes the next train at once), cg or nocg (trainer graphs), lowpri (trainer "
                             "at below-normal MPS priority), cpuN (torch's CPU threads in the trainer), tN (trainer "
                             "MPS thread percentage, 1-100), aN (the engine's logprobs audited every N-th step; a0: "
                             "never), rK (the first K responses of each prompt audited), np (published adapters "
                             "loaded unpinned), flat or peft (adapters handed over as flat files, the default, "
                             "or as PEFT folders), "
                             "kN (N engine + trainer stacks splitting the jobs), lock (a kN "
                             "shared-sync arm's stacks in lockstep), off (a kN shared-sync arm's stacks started out "
                             "of step), holdF (off, the stacks then held F hundredths of a cycle apart, 1-50), "
                             "leadK (a continuous or overlap arm's jobs at most K steps ahead of their stack's "
                             "least advanced: arm.max_lead), "
                             "nN (this arm's steps a job, over --steps), lsN (a kN "
                             "arm's engine adapter slots, in place of one per job of a stack) or spK "
                             "(each prompt's responses trained K to a row, the prompt once)")
    sync_stacks = trainer.get("stacks", 1) >= 2 and ARMS[name][0] == "shared-sync"  # what lock and off need
    if trainer.get("lockstep") and not sync_stacks:
        raise SystemExit(f"--arms {text!r}: lock holds each stack's generation for the other stacks' publishes: "
                         "a shared-sync arm on kN stacks (N >= 2) only")
    if trainer.get("offset_stacks") and (not sync_stacks or trainer.get("lockstep")):
        raise SystemExit(f"--arms {text!r}: off starts each stack when the one before has generated (holdF "
                         "too): a shared-sync arm on kN stacks (N >= 2) only, and not with lock")
    if "engine_slots" in trainer and trainer.get("stacks", 1) < 2:
        # Before any run: an arm on one engine takes the pool's slots, which every arm shares.
        raise SystemExit(f"--arms {text!r}: ls{trainer['engine_slots']} sets a kN arm's engine adapter slots; "
                         "an arm on one engine takes the pool's (--engine-slots)")
    return name, jobs, groups, seeds, mb, wait, trainer


def _microbatch_fit(mem: tuple[float, float] | None, engine_memory: float, stacks: int, mb_tokens: int,
                    graphed: bool) -> int | None:
    """The largest micro-batch (tokens, at most ``mb_tokens``) at which an arm's graphed trainers fit
    beside its engines on a GPU with ``mem`` (free, total GiB), None where none does; ``mb_tokens``
    itself where there is nothing to check (the memory unknown, the trainer eager)."""
    from real.backend import microbatch_that_fits

    if mem is None or not graphed:
        return mb_tokens
    return microbatch_that_fits(mem[0], mem[1], engine_memory, stacks, mb_tokens)


def memory_skip(mem: tuple[float, float] | None, engine_memory: float, stacks: int, mb_tokens: int,
                graphed: bool) -> str | None:
    """Why an arm's graphed trainers would not fit beside its engines on a GPU with ``mem`` (free,
    total GiB at the invocation's start), naming the micro-batch (``:mN``) that would; None when they
    fit, the trainer is eager, or the memory is unknown. Session 49's H100: two stacks at 0.35 with
    8k-token trainers ran 414 s of device time to train eager (real.backend.microbatch_that_fits)."""
    from real.backend import gpu_memory_need_gib, trainer_gib_estimate

    fits = _microbatch_fit(mem, engine_memory, stacks, mb_tokens, graphed)
    if fits == mb_tokens:
        return None
    free, total = mem
    need = gpu_memory_need_gib(total, engine_memory, stacks, trainer_gib_estimate(mb_tokens))
    return (f"{stacks} graphed trainer(s) at {mb_tokens}-token micro-batches beside {engine_memory:g} of the GPU for "
            f"engines ask ~{need:.0f} GiB of {free:.1f} GiB free: they would train eager; "
            + (f":m{fits} fits" if fits else "no micro-batch fits: lower --engine-memory")
            + " (--allow-eager runs it anyway)")


def microbatch_to_fit(mem: tuple[float, float] | None, engine_memory: float, stacks: int, mb_tokens: int,
                      graphed: bool) -> int | None:
    """--shrink-to-fit: the smaller micro-batch that fits where ``mb_tokens`` would not (the one
    ``memory_skip`` names); None otherwise (it fits, nothing to check, or nothing fits). Session 72's
    H100 skipped two calls' runs at the 16k default that 8k would have run."""
    fits = _microbatch_fit(mem, engine_memory, stacks, mb_tokens, graphed)
    return fits if fits and fits < mb_tokens else None


def check_share_prompts(specs: list, share: int, trainer_graphs: bool) -> None:
    """Before any work: --share-prompts >= 0, and every arm that packs prompts (its spK, else
    --share-prompts) runs the graphed trainer (its :cg, else --trainer-graphs), as the real backend
    requires."""
    if share < 0:
        raise SystemExit(f"gpu_arms: --share-prompts {share}: responses a row holds, an integer >= 0 (0: none)")
    for name, *_, trainer in specs:
        k = trainer.get("share_prompts", share)
        if k > 1 and not trainer.get("trainer_graphs", trainer_graphs):
            raise SystemExit(f"gpu_arms: arm {name} packs prompts (share_prompts={k}) without the graphed trainer: "
                             "add :cg to the arm or --trainer-graphs")


def sim_profile(given: str | None, trainer_graphs: bool, corun_priority: str | None = None,
                stacks_mps: bool = False, gpu_total_gib: float | None = None, dedicated: bool = False) -> str:
    """The profile an arm's simulated figure uses: the one asked for, else the shipped one that
    describes the arm (``nodus.config.shipped_profile``: by its trainer, its trainer's priority
    where it co-runs under MPS, stacks under MPS, a dedicated arm, and the GPU's total memory), as
    `nodus validate` picks for a recorded run (``calibration.run_settings.run_profile``)."""
    from nodus.config import shipped_profile

    return given or shipped_profile(trainer_graphs, corun_priority, stacks_mps, gpu_total_gib, dedicated)


def dedicated_key(name: str, keys) -> str | None:
    """Of an invocation's arm ``keys``, the dedicated run an arm key ``name`` is measured over: a
    dedicated key of the same job count (its ``-jN``) whose settings (the key's ``-`` parts) the
    arm has too, the one with the most (``overlap+mps-cg-lowpri`` -> ``dedicated-cg``, not plain
    ``dedicated``; MPS settings such as ``-lowpri`` have no dedicated counterpart); None if none."""
    def count(parts: list[str]) -> str | None:  # the key's job count part, "jN"
        return next((p for p in parts if re.fullmatch(r"j\d+", p)), None)

    parts = re.sub(r"-r\d+$", "", name).split("-")[1:]  # a repeat round: over the same dedicated run
    fits = []
    for k in keys:
        kp = k.split("-")
        if kp[0] != "dedicated" or "aa" in kp or count(kp) != count(parts):
            continue
        if set(kp[1:]) <= set(parts):
            fits.append((len(kp), k))
    return max(fits)[1] if fits else None


def make_random_model(path: Path, shape: str) -> Path:
    """Save a random-weight Qwen3 of the given shape (config + safetensors, no tokenizer)."""
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    shapes = {
        "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                           head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                           max_position_embeddings=4096),
        "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, intermediate_size=512, vocab_size=4096, tie_word_embeddings=True,
                      max_position_embeddings=2048),
    }
    cfg = Qwen3Config(**shapes[shape], torch_dtype="bfloat16", rope_theta=1e6)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return path


def state_text(summary: dict) -> str:
    """What a run recorded of its engine and host, for its progress line: the mean engine step and
    its spread across generations, the share of the engines' busy time in GC, and the busiest
    thread's share of a core and its process's name ('' for a run without them)."""
    from calibration.run_health import contention_text, contention_why, run_engine_steps, run_host_monitor

    out = ""
    es = run_engine_steps(summary)
    if es and es.get("mean_step_ms") is not None:
        out += f", engine step {es['mean_step_ms']:.2f} ms"
        if es.get("step_ms_spread"):
            out += f" (generations {es['step_ms_spread']:.2f}x apart"
            out += f", GC {es['gc_share']:.1%})" if es.get("gc_share") is not None else ")"
    hm = run_host_monitor(summary) or {}
    busiest = hm.get("busiest_thread") or {}
    if busiest.get("core_frac") is not None:
        where = (busiest.get("process") or busiest.get("name") or "?").split(":")[0]
        out += f", busiest thread {busiest['core_frac']:.0%} of a core ({where})"
    # A contended host, said while the call runs (session 45: dedicated runs at 16-20% steal were
    # seen only in the table afterwards, after 1000 s of device time on that machine).
    why = contention_why(hm)
    if why:
        out += f"; CONTENDED HOST ({contention_text(why)}): its ratios measure the host"
    return out


def phase_seconds(runs: list[list]) -> dict[str, float]:
    """The mean seconds of each phase's actions over a run's spans (one action per stack and
    interval: a train step of four jobs is four spans of one interval), e.g. {"generate": 1.9,
    "train": 1.04, "publish": 0.18}: the figures the adapter handoff (``:flat``) moves."""
    actions: dict[str, set] = {}
    for spans in runs:
        for sp in spans:
            # A dedicated run's jobs each had a GPU of their own: their spans stay apart by run.
            actions.setdefault(sp.phase, set()).add((id(spans), sp.stack, sp.start_s, sp.end_s))
    return {phase: sum(e - s for _, _, s, e in acts) / len(acts) for phase, acts in sorted(actions.items())}


def plan_text(planned: list[dict], skipped: list[dict], deadline: float | None, cpus: int | None) -> str:
    """``--plan``'s table: each run in order with what it does to the processes and its estimated
    seconds (Estimates' H200 figures: no run measured), then the runs ``--deadline`` or the memory
    check (``--gpu-memory``) would skip."""
    import os

    where = "" if cpus else " (this machine; --cpus N for the GPU host)"
    lines = [f"plan: {len(planned)} run(s), about {planned[-1]['ends_s'] if planned else 0:.0f} s"
             f"{f' of --deadline {deadline:.0f}' if deadline else ''}; engine thread caps for "
             f"{cpus or len(os.sched_getaffinity(0))} CPUs{where}",
             "", "| # | run | seed | jobs | stacks | processes | priming s | run s | ends at s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(planned, 1):
        what = r["processes"] + (", priming" if r["prime"] and r["processes"] != "start" else "")
        lines.append(f"| {i} | {r['arm']} | {r['seed']} | {r['jobs']} | {r['stacks']} | {what} | "
                     f"{r['prime_s']:.0f} | {r['run_s']:.0f} | {r['ends_s']:.0f} |")
    for r in skipped:
        if "why" in r:  # the memory check (memory_skip)
            lines.append(f"skipped by the memory check: {r['arm']} seed {r['seed']}: {r['why']}")
            continue
        lines.append(f"skipped by --deadline: {r['arm']} seed {r['seed']} ({r['processes']}, about "
                     f"{r['prime_s'] + r['run_s']:.0f} s from {r['elapsed_s']:.0f} s)")
    if deadline and planned and planned[0]["ends_s"] > deadline:
        lines.append(f"the first run alone ends past --deadline (about {planned[0]['ends_s']:.0f} s): it always "
                     "begins, and the limit would stop it")
    return "\n".join(lines)


def _options(args, engine_env, engine_args=()):
    from real.backend import RealOptions

    return RealOptions(model=str(args.model_dir), mode=args.mode, load_format="auto", engine_memory=args.engine_memory,
                       enforce_eager=args.enforce_eager, audit_logprobs=not args.no_audit, audit_every=args.audit_every,
                       audit_responses=args.audit_responses,
                       lora_layout=args.lora_layout, trainer_priority=args.trainer_priority,
                       engine_thread_pct=args.engine_thread_pct, trainer_thread_pct=args.trainer_thread_pct,
                       trainer_cpu_threads=args.trainer_cpu_threads, engine_cpu_threads=args.engine_cpu_threads,
                       engine_env=engine_env,
                       engine_args=tuple(engine_args),
                       tuned_lora_kernels=args.tuned_lora_kernels, engine_core_process=args.engine_core_process,
                       trainer_compile=args.trainer_compile, trainer_graphs=args.trainer_graphs,
                       evaluate=args.mode == "tasks",
                       seeded_sampling=args.mode == "tasks" if args.seeded is None else args.seeded)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/nodus-qwen3-0.6b-random"))
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--jobs", default="8", help="job count, or a comma list (runs each arm at each count)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seeds", default=None,
                    help="comma list of seeds for every arm without its own sN (default 1); an arm's :sN "
                         "runs its own seeds, and a note says so where they are not among --seeds")
    ap.add_argument("--arms", default=",".join(ARMS),
                    help="comma list of arms; NAME:jN:gG:sS runs that arm at N jobs, G groups, on seed S "
                         "only (e.g. shared-sync:j4,overlap+mps:j16:g3:s1)")
    ap.add_argument("--groups", default="2", help="overlap groups, or a comma list (overlap arms run at each)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--engine-memory", type=float, default=0.35)
    ap.add_argument("--profile", default=None,
                    help="the simulator's profile beside each measured arm (default: the shipped profile of the "
                         "arm's trainer, nodus.config.DEFAULT_PROFILES: graphed for :cg / --trainer-graphs; stacks under MPS: "
                         "the stacks profile; on an H100 80GB, by its memory: the H100's stacks or one-stack profile)")
    ap.add_argument("--mode", default="synthetic")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step per job")
    ap.add_argument("--responses", type=int, default=8, help="responses per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--job-fields", type=json.loads, default={},
                    help='JSON of extra job fields, e.g. \'{"learning_rate": 1e-3, "prompt_pool": 8}\'')
    ap.add_argument("--aa", action="store_true",
                    help="run the dedicated arm twice per seed (A/A repeat: the throughput noise floor)")
    ap.add_argument("--aa-seeds", default=None,
                    help="with --aa: the seeds to repeat the dedicated arm on (default: every seed)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the arms of each set of processes this many times in turn (A B A B: same-call "
                         "repeats that share the host's drift; run keys of later rounds get -r<N>)")
    ap.add_argument("--prime", action=argparse.BooleanOptionalAction, default=True,
                    help="before the first measured run on each new set of processes, run that arm for one "
                         "step and discard it (compiles and first-use costs land there: session 4's first "
                         "runs measured up to 20%% slower than their repeats)")
    ap.add_argument("--engine-thread-pct", type=int, default=None,
                    help="MPS active thread percentage of the engine (MPS arms; run keys get -e<pct>)")
    ap.add_argument("--trainer-thread-pct", type=int, default=None,
                    help="MPS active thread percentage of the trainer (MPS arms; run keys get -t<pct>)")
    ap.add_argument("--trainer-cpu-threads", type=int, default=None, metavar="N",
                    help="torch's CPU threads in each trainer process (default: nodus's, 2 on a GPU; 0: torch's, one "
                         "per CPU); run keys get -cpu<N> when capped; an arm's :cpuN wins")
    ap.add_argument("--engine-cpu-threads", type=int, default=None, metavar="N",
                    help="torch's CPU threads in each engine process (0: torch's own, one per CPU; default: that "
                         "with one engine, and with several on a GPU (kN, timeslice's groups) half the CPUs over "
                         "them); run keys get -ecpu<N> when capped")
    ap.add_argument("--engine-env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for the engine processes (e.g. VLLM_TUNED_CONFIG_FOLDER=DIR)")
    ap.add_argument("--tuned-lora-kernels", action=argparse.BooleanOptionalAction, default=True,
                    help="the engine's LoRA kernels with the tuned configs nodus ships for its GPU (real/lora_kernels.py; "
                         "labelled +lk in tables); --no-tuned-lora-kernels: vLLM's defaults (run keys get -vk)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
                    help="a vLLM engine argument for every arm (e.g. specialize_active_lora=true; run keys get -ea)")
    ap.add_argument("--engine-slots", type=int, default=None, metavar="N",
                    help="the engine's adapter slots (vLLM max_loras) for every arm of the invocation (default: the "
                         "largest arm's jobs), each arm's engine.max_loras (at most N adapters a decode step, "
                         "every job's adapter kept loaded); run keys get -ls<N> where N is not an arm's jobs "
                         "(session 22: 4 slots ran 8 jobs in 2 groups as fast as 8; session 23: 16 slots ran them "
                         "11-12%% slower)")
    ap.add_argument("--cuda-graph-max-tokens", type=int, default=None, metavar="N",
                    help="the engine's CUDA graphs up to N tokens a step (config engine.cuda_graph_max_tokens; "
                         "default: 2 x max_num_seqs for every arm of an invocation where one arm's jobs' sequences, "
                         "as many as the engine's slots hold, exceed max_num_seqs (nodus.config.size_engine_graphs; "
                         "--engine-slots 8 at 16 jobs: 512), else vLLM's min(2 x max_num_seqs, 512)); run keys get "
                         "-gm<N> wherever the size is set")
    ap.add_argument("--engine-core-process", action="store_true",
                    help="vLLM's engine core in a process of its own under each engine worker (run keys get -ep)")
    ap.add_argument("--trainer-priority", default="normal", choices=("normal", "below-normal"),
                    help="MPS client priority of the trainer in the MPS arms (their keys get -lowpri)")
    ap.add_argument("--lora-layout", default="masked", choices=("padded", "masked", "auto"))
    ap.add_argument("--aa-mb-tokens", type=int, default=None,
                    help="the A/A repeat's micro-batch cap (default: the same): a repeat that differs only "
                         "in batching measures the learning noise bf16 rounding leaves (nodus compare's "
                         "aa_learning)")
    ap.add_argument("--share-prompts", type=int, default=0, metavar="K",
                    help="trainer.share_prompts of every arm without its own spK: each prompt's responses trained "
                         "K to a row, the prompt once (needs --trainer-graphs; 0: a row per response)")
    ap.add_argument("--mb-tokens", type=int, default=16384,
                    help="trainer micro-batch cap in padded tokens (fewer, larger micro-batches: less "
                         "per-micro-batch overhead, more memory)")
    ap.add_argument("--trainer-compile", action=argparse.BooleanOptionalAction, default=None,
                    help="compile the trainer's element-wise ops (default: on, on a GPU)")
    ap.add_argument("--trainer-graphs", action=argparse.BooleanOptionalAction, default=False,
                    help="each trainer micro-batch one CUDA graph replay (run keys get -cg)")
    ap.add_argument("--no-audit", action="store_true",
                    help="skip the logprob audit: the engine returns no logprobs (run keys get -noaudit)")
    ap.add_argument("--audit-every", type=int, default=1,
                    help="audit every N-th step of each job: only then does the engine return logprobs, whose "
                         "handling is host work on every decode step (run keys get -auditN; an arm's own: :aN)")
    ap.add_argument("--audit-responses", type=int, default=None,
                    help="on an audited step, only the first K responses of each prompt return the engine's logprobs "
                         "and are audited (run keys get -audr<K>; an arm's own: :rK)")
    ap.add_argument("--plan", action="store_true",
                    help="start nothing: list the runs in the order they would run, what each does to the processes "
                         "(start a cluster, restart the trainers, reuse them), whether it primes, and its estimated "
                         "seconds, with run keys as on a GPU (plan a device call before booking it)")
    ap.add_argument("--cpus", type=int, default=None,
                    help="with --plan: the GPU host's CPUs, for the engines' default thread caps in the run keys "
                         "(default: this machine's; the lent H200 has 16)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from the start of this invocation: a run after the first whose estimate (its "
                         "start or priming step and the run) would end later is skipped, not begun, and listed in "
                         "arms.json's 'skipped' (experiments/device_session.sh sets it from ARMS_TIMEOUT)")
    ap.add_argument("--estimates", type=Path, default=None,
                    help="a JSON file of cluster starts and run factors measured by earlier invocations on this "
                         "machine: --deadline and --plan use them before this invocation measures its own, and each "
                         "measurement is written back (experiments/device_session.sh keeps one in ~/.cache/nodus, "
                         "so a later call on a warm machine plans with that machine's starts)")
    ap.add_argument("--gpu-memory", default=None, metavar="FREE,TOTAL",
                    help="the GPU's free and total memory in GiB, for the memory check (default: read with "
                         "nvidia-smi at the start on a GPU; with --plan, the GPU the plan is for, e.g. 77.2,79.2 "
                         "for an H100 80GB or 139.8,140.4 for an H200)")
    ap.add_argument("--allow-eager", action="store_true",
                    help="run an arm whose graphed trainers the memory check says would not fit (they train eager); "
                         "by default such an arm is skipped and listed in arms.json's 'skipped' with why")
    ap.add_argument("--shrink-to-fit", action="store_true",
                    help="run an arm whose graphed trainers the memory check says would not fit at the largest "
                         "micro-batch that does (the run key names it, e.g. -mb8k), instead of skipping it: "
                         "one call's arms for whichever GPU comes (an H100 or an H200)")
    ap.add_argument("--seeded", action=argparse.BooleanOptionalAction, default=None,
                    help="a sampling seed per response (default: on in tasks mode, off for timing)")
    args = ap.parse_args()
    t_start = time.monotonic()  # --deadline counts from here (the caller's timeout counts from the start)
    if args.cpus is not None and not args.plan:
        raise SystemExit("gpu_arms: --cpus is for --plan (a run on the GPU host caps by its own CPUs)")
    if args.deadline is not None and args.deadline <= 0:
        raise SystemExit(f"gpu_arms: --deadline {args.deadline}: give the seconds this invocation may take (> 0)")
    gpu_mem = None
    if args.gpu_memory is not None:
        try:
            gpu_mem = tuple(float(v) for v in args.gpu_memory.split(","))
            assert len(gpu_mem) == 2 and 0 < gpu_mem[0] <= gpu_mem[1]
        except (ValueError, AssertionError):
            raise SystemExit(f"gpu_arms: --gpu-memory {args.gpu_memory!r}: give FREE,TOTAL in GiB, free at most "
                             "total (e.g. 77.2,79.2)")

    from calibration.run_health import run_jit_compiles
    from nodus.cli import engine_arg_pairs, env_pairs
    from nodus.config import (NO_CORUN_POLICIES, ConfigError, corun_key, drop_idle_priority, engine_args_size_graphs,
                              graph_sizes_given, stacks_under_mps)
    from nodus.microbatch import mb_tag
    from nodus.realrun import ClusterPool
    from nodus.runner import n_stacks, run_arm, size_engine_slots, stack_jobs
    from nodus.simulate import config_from_args, simulate, trainer_graph_failures, write_run
    from real.backend import (RUN_SETTINGS, engine_cpu_threads, gpu_memory_gib, run_device, trainer_cpu_threads,
                              with_audit)
    from real.lora_kernels import ENV as LORA_CONFIG_ENV

    try:
        engine_env = tuple(env_pairs(args.engine_env))
        engine_args = engine_arg_pairs(args.engine_arg)
        opts = _options(args, engine_env, engine_args)  # bad settings fail before any model is made
    except (ConfigError, ValueError) as err:
        raise SystemExit(f"gpu_arms: {err}")
    if gpu_mem is None and not args.plan and run_device(opts) == "cuda":
        gpu_mem = gpu_memory_gib()  # before any process: what every arm's processes may have
    if args.plan:  # run keys and thread defaults as on the GPU the plan is for
        opts = dataclasses.replace(opts, device="cuda")
    # An arm may name its own job count and groups (NAME:jN:gG), so that one invocation (one set
    # of processes per sharing mode) runs e.g. the 8-job table and the 2/4/16-job scaling points.
    arm_texts = [a for a in args.arms.split(",") if a]
    specs = [parse_arm(a) for a in arm_texts]
    seed_notes = own_seed_notes([(text, sp[3]) for text, sp in zip(arm_texts, specs)], args.seeds)
    job_counts = [int(x) for x in str(args.jobs).split(",") if x]
    # A stacked arm without its own jN runs every --jobs count: one spec per count, so each count's
    # runs sort with the stacked arms of that count (their engines are sized for it, stacked_jobs).
    specs = [sp[:1] + (n,) + sp[2:] if arm_stacks(sp) > 1 and sp[1] is None and len(job_counts) > 1 else sp
             for sp in specs for n in (job_counts if arm_stacks(sp) > 1 and sp[1] is None else [None])]
    check_share_prompts(specs, args.share_prompts, args.trainer_graphs)
    slots = pool_slots(args.engine_slots, specs, job_counts)
    if not args.plan:
        args.out.mkdir(parents=True, exist_ok=True)
    if args.mode == "synthetic" and not args.plan:
        make_random_model(args.model_dir, args.shape)
    from nodus.config import default_jobs

    def workload(n: int, mb_tokens: int | None = None, wait: bool | None = None, share: int = 0) -> dict:
        return {"arm": {} if wait is None else {"trainer_waits_for_publish": wait},
                "jobs": [j.model_dump(exclude_none=True) for j in default_jobs(
            n, prompts_per_step=args.prompts, responses_per_prompt=args.responses,
            max_new_tokens=args.max_new_tokens, **args.job_fields)],
            # 16k-token micro-batches by default: the trainer peaks at ~46 GiB beside the engine's
            # share, room for timeslice's two trainers (32k: 64 GiB masked, 91 GiB padded, alone).
            "trainer": {"max_tokens_per_microbatch": mb_tokens or args.mb_tokens,
                        **({"share_prompts": share} if share else {})},
            "engine": engine_section(slots, args.cuda_graph_max_tokens)}

    # One CUDA-graph size for the invocation, as one adapter-slot count (min_loras): the largest any
    # arm's config gets (size_engine_graphs), unless given or left to engine args that set their
    # own; so arms of 8 and 16 jobs share one engine (a start costs 100-260 s on the H200).
    if args.cuda_graph_max_tokens is None and not graph_sizes_given(engine_args):
        args.cuda_graph_max_tokens = invocation_graph_size(specs, job_counts, workload)

    def suffix(n: int) -> str:  # arm keys and run folders name the job count when there are several
        return f"-j{n}" if len(job_counts) > 1 or n != job_counts[0] else ""
    # Arms needing the same processes run together; the baseline (no MPS) first, timeslice (two
    # stacks: two engines to start) last.
    # Stacked arms of one job count together: their engines are sized for it (stacked_jobs).
    order = sorted(specs, key=lambda sp: (ARMS[sp[0]][0] == "timeslice", arm_stacks(sp), ARMS[sp[0]][2] != "none",
                                          stacked_jobs(sp, min(job_counts)), ARMS[sp[0]][0] != "dedicated"))
    order = interleave_rounds(order, args.rounds, min(job_counts))
    seeds = [int(s) for s in (args.seeds or "1").split(",")]
    for note in seed_notes:
        print(note, flush=True)
    results: dict = {"jobs": job_counts if len(job_counts) > 1 else job_counts[0], "steps": args.steps, "model_shape": args.shape, "mode": args.mode,
                     "seeded_sampling": opts.seeded_sampling, "enforce_eager": args.enforce_eager,
                     "job_fields": args.job_fields, "lora_layout": args.lora_layout,
                     "trainer_compile": args.trainer_compile, "mb_tokens": args.mb_tokens,
                     "trainer_graphs": args.trainer_graphs, "engine_args": dict(engine_args),
                     "engine_core_process": args.engine_core_process,
                     "aa_mb_tokens": args.aa_mb_tokens, "trainer_priority": args.trainer_priority,
                     "engine_thread_pct": args.engine_thread_pct, "trainer_thread_pct": args.trainer_thread_pct,
                     "trainer_cpu_threads": args.trainer_cpu_threads, "engine_cpu_threads": args.engine_cpu_threads,
                     "engine_env": args.engine_env,
                     "tuned_lora_kernels": args.tuned_lora_kernels,
                     "share_prompts": args.share_prompts, "arms": {},
                     "startup_s": {}, "logprob_agreement": {}, "primed": [], "skipped": [],
                     "deadline_s": args.deadline}
    # Every job's adapter stays loaded, for the largest arm too: no arm needs a new engine for that.
    pool = ClusterPool(opts, min_loras=slots, min_cpu_loras=largest_arm(specs, job_counts))
    results["engine_slots"] = slots
    print(f"engine adapter slots for every arm: {slots}" + (" (--engine-slots)" if args.engine_slots else
                                                            " (the largest arm's jobs)"), flush=True)
    t_all = time.monotonic()
    est = Estimates(args.estimates)
    planned: list[dict] = []  # --plan: the runs in order, with what each costs
    plan_clock = 0.0
    begun = 0  # runs begun (or planned)
    try:
        primed: set = set()
        for (name, arm_jobs, arm_groups, arm_seeds, arm_mb, arm_wait, arm_trainer), rnd in order:
            policy, groups, sharing = ARMS[name]
            # spK is the run config's (trainer.share_prompts), not a process setting.
            arm_share = arm_trainer.get("share_prompts", args.share_prompts)
            stacks = arm_trainer.get("stacks", 1)  # kN: the run config's arm.stacks too
            arm_slots = arm_trainer.get("engine_slots")  # lsN: a kN arm's engine slots (parse_arm: kN only)
            arm_lock = arm_trainer.get("lockstep")  # lock: the run config's arm.lockstep
            arm_off = arm_trainer.get("offset_stacks")  # off: the run config's arm.offset_stacks
            arm_hold = arm_trainer.get("hold_apart")  # holdF: the run config's arm.hold_apart
            arm_steps = arm_trainer.get("steps", args.steps)  # nN: this arm's steps a job
            arm_lead = arm_trainer.get("max_lead")  # leadK: the run config's arm.max_lead
            arm_trainer = {k: v for k, v in arm_trainer.items()
                           if k not in ("share_prompts", "stacks", "engine_slots", "lockstep", "offset_stacks",
                                        "hold_apart", "steps", "max_lead")}
            try:
                # This arm's trainer settings (cg, lowpri, tN): the pool restarts only the trainers.
                arm_opts = dataclasses.replace(opts, **arm_trainer)
            except ValueError as err:
                raise SystemExit(f"gpu_arms: arm {name} {arm_trainer}: {err}")
            # The trainers' CPU threads as they will run (nodus's default resolved: :cpu2 and the
            # default on a GPU are one setting, one key, no restart between them; 0: torch's own).
            cpu_threads = trainer_cpu_threads(arm_opts.trainer_cpu_threads, run_device(arm_opts))
            arm_trainer["trainer_cpu_threads"] = cpu_threads or 0
            arm_opts = pool.opts = dataclasses.replace(arm_opts, trainer_cpu_threads=cpu_threads or 0)
            group_counts = [int(x) for x in str(args.groups).split(",") if x]
            if arm_groups:
                gs = [arm_groups]
            else:
                gs = group_counts if policy == "overlap" else [group_counts[0] if policy == "timeslice" else groups]
            counts = [arm_jobs] if arm_jobs else job_counts
            repeats = [""] + (["-aa"] if args.aa and name == "dedicated" else [])
            aa_seeds = seeds if args.aa_seeds is None else [int(s) for s in args.aa_seeds.split(",")]
            for g, n, seed, rep in ((g, n, s, r) for g in gs for n in counts for s in arm_seeds or seeds
                                    for r in repeats):
                if g * (stacks if policy == "overlap" else 1) > n or stacks > n or (rep and seed not in aa_seeds):
                    continue  # more groups (in every stack) than jobs; an A/A repeat on a seed not asked for
                # An A/A repeat may pack its micro-batches differently (--aa-mb-tokens): the same
                # rollouts and updates up to bf16 rounding, so its learning difference is the noise floor.
                mb = args.aa_mb_tokens if rep else arm_mb

                def arm_config(mb_tokens: int | None):
                    c = config_from_args(workload(n, mb_tokens, arm_wait, arm_share), policy=policy, groups=g,
                                         sharing=sharing, steps=arm_steps, seed=seed,
                                         stacks=stacks if stacks > 1 else None, lockstep=arm_lock,
                                         offset_stacks=arm_off, hold_apart=arm_hold, max_lead=arm_lead)
                    c = engine_args_size_graphs(c, engine_args)  # graph sizes the engine args set stay theirs
                    return with_audit(c, arm_opts)[0]  # the arm's audit (:aN, :rK, --audit-*) in its recorded config

                cfg = arm_config(mb)
                smaller = (microbatch_to_fit(gpu_mem, arm_opts.engine_memory, n_stacks(cfg),
                                             cfg.trainer.max_tokens_per_microbatch, arm_opts.trainer_graphs)
                           if args.shrink_to_fit and not args.allow_eager else None)
                if smaller:
                    # The run key then names the size (-mb8k), as an arm asking :m8192 would.
                    print(f"note: {name} seed {seed}: graphed trainers at {cfg.trainer.max_tokens_per_microbatch}-token "
                          f"micro-batches would not fit beside the engines; run at {smaller} (--shrink-to-fit)",
                          flush=True)
                    mb = smaller
                    arm_mb = arm_mb if rep else smaller
                    cfg = arm_config(mb)
                own_jobs = n
                if stacks > 1:
                    # Each engine of a kN arm serves its own stack's jobs: slots for those
                    # (size_engine_slots), at most the invocation's (its own cluster: no sharing).
                    own_jobs = max(len(ids) for ids in stack_jobs(cfg))
                    per = size_engine_slots(cfg.model_copy(update={"engine": cfg.engine.model_copy(
                        update={"max_loras": None})})).engine.max_loras or own_jobs
                    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(
                        update={"max_loras": arm_slots or min(per, pool.min_loras)})})
                variant = "-eager" if args.trainer_compile is False else ""
                variant += "-cg" if arm_opts.trainer_graphs else ""
                variant += "-ea" if engine_args else ""
                variant += "-ep" if args.engine_core_process else ""
                variant += f"-gm{args.cuda_graph_max_tokens}" if args.cuda_graph_max_tokens else ""
                variant += slots_key(cfg.engine.max_loras if stacks > 1 else pool.min_loras, own_jobs)
                variant += "-ee" if engine_env else ""  # engine environment, e.g. tuned LoRA kernel configs
                # vLLM's default LoRA kernel configs (a folder given through the environment wins).
                variant += "-vk" if not args.tuned_lora_kernels and LORA_CONFIG_ENV not in dict(engine_env) else ""
                if sharing == "mps":
                    variant += "-lowpri" if arm_opts.trainer_priority != "normal" else ""
                    variant += f"-e{args.engine_thread_pct}" if args.engine_thread_pct else ""
                    variant += f"-t{arm_opts.trainer_thread_pct}" if arm_opts.trainer_thread_pct else ""
                # The trainers' CPU threads when capped (nodus's default on a GPU since session 28, or
                # asked); runs before it, and :cpu0, ran torch's own count and have no suffix.
                variant += f"-cpu{cpu_threads}" if cpu_threads else ""
                # The engines' torch CPU threads as they will run: asked, or nodus's default for
                # several engines on a GPU (kN, or timeslice's groups: half the CPUs over them); one
                # engine uncapped: none.
                eth = engine_cpu_threads(args.engine_cpu_threads, run_device(arm_opts), n_stacks(cfg),
                                         cpus=args.cpus)
                variant += f"-ecpu{eth}" if eth else ""
                # The audit away from its default (every step): the engine returns logprobs less often.
                if not arm_opts.audit_logprobs:
                    variant += "-noaudit"
                else:
                    variant += f"-audit{arm_opts.audit_every}" if arm_opts.audit_every != 1 else ""
                    variant += f"-audr{arm_opts.audit_responses}" if arm_opts.audit_responses is not None else ""
                variant += "" if arm_opts.publish_pinned else "-np"  # adapters loaded into pageable memory
                variant += "-flat" if arm_opts.adapter_format == "flat" else ""  # adapters as flat files
                variant += f"-sp{arm_share}" if arm_share > 1 else ""  # each prompt once in the trainer
                variant += f"-k{stacks}" if stacks > 1 else ""  # engine + trainer stacks splitting the jobs
                variant += "-lock" if arm_lock else ""  # the stacks in lockstep (arm.lockstep)
                variant += "-off" if arm_off else ""  # the stacks started out of step (arm.offset_stacks)
                variant += f"-hold{round(arm_hold * 100)}" if arm_hold else ""  # then held apart (arm.hold_apart)
                variant += f"-lead{arm_lead}" if arm_lead is not None else ""  # jobs' lead bound (arm.max_lead)
                named_g = policy == "overlap" and (len(gs) > 1 or (arm_groups is not None and g != 2))
                mb_key = f"-{mb_tag(arm_mb)}" if arm_mb and arm_mb != args.mb_tokens else ""
                key = f"{name}{variant}{rep}{f'-g{g}' if named_g else ''}{mb_key}{'' if arm_wait is None else ('-waitpub' if arm_wait else '-freed')}{suffix(n)}"
                key += f"-n{arm_steps}" if arm_steps != args.steps else ""  # nN: its own steps a job
                key += f"-r{rnd}" if rnd > 1 else ""  # a repeat round (--rounds): the same arm again
                # New trainer settings restart the trainers: a new shape to prime (run-loop settings,
                # such as the audit's cadence, keep every process: nothing new to prime).
                # (The trainer's priority, where nothing co-runs, is whatever the running trainers
                # have: the pool keeps them, nodus.realrun.ClusterPool.)
                shape = (sharing, n_stacks(cfg), cfg.trainer.max_tokens_per_microbatch, cfg.trainer_packing(),
                         tuple(sorted((k, v) for k, v in drop_idle_priority(arm_trainer,
                                                                            corun_key(policy, stacks)).items()
                                      if k not in RUN_SETTINGS)))
                # An lsN arm's engine serves each job count on the same slots: a larger count's first
                # step takes more adapters a step than the smaller one primed (kernels for those).
                shape += (n,) if arm_slots else ()
                # What the run does to the processes (a planning twin of the pool decides, starting none).
                action = pool.shadow().plan(cfg, n_stacks(cfg))
                # Graphed trainers that would not fit beside the engines train eager: skipped, not run
                # (session 49's H100 spent 414 s on such a run), unless --allow-eager.
                too_big = None if args.allow_eager else memory_skip(
                    gpu_mem, arm_opts.engine_memory, n_stacks(cfg), cfg.trainer.max_tokens_per_microbatch,
                    arm_opts.trainer_graphs)
                if too_big:
                    results["skipped"].append({"arm": key, "seed": seed, "why": too_big})
                    print(f"skipped {key} seed {seed}: {too_big}", flush=True)
                    if not args.plan:
                        (args.out / "arms.json").write_text(json.dumps(results, indent=1))
                    continue
                # New processes, trainers restarted or a shape not yet trained at: a priming step first
                # (a restarted trainer captures its graphs again, which a measured window must not hold).
                prime = args.prime and (action != "reuse" or shape not in primed)
                # The simulator's prediction for the run, before it: the estimate of its seconds.
                corun = sharing == "mps" and corun_key(policy, stacks) not in NO_CORUN_POLICIES
                profile = sim_profile(args.profile, arm_opts.trainer_graphs,
                                      arm_opts.trainer_priority if corun else None,
                                      stacks_under_mps(policy, sharing, stacks),
                                      gpu_mem[1] if gpu_mem else None, policy == "dedicated")
                pred = simulate(engine_args_size_graphs(config_from_args(
                    workload(n, arm_mb, arm_wait, arm_share), policy=policy, groups=g, sharing=sharing,
                    steps=arm_steps, stacks=stacks if stacks > 1 else None,
                    lockstep=arm_lock, offset_stacks=arm_off, hold_apart=arm_hold, max_lead=arm_lead,
                    seed=seed, profile=profile).model_copy(update={"audit": cfg.audit}), engine_args))
                # Without a priming step (--no-prime) new processes still cost their start, inside the run.
                prime_s = est.prime_s(action, sharing, n_stacks(cfg)) if prime or action != "reuse" else 0.0
                run_s = est.run_s(name, pred["gpu_seconds"])
                # --plan: the estimates' own clock (the invocation's start and the model's save aside).
                elapsed = plan_clock if args.plan else time.monotonic() - t_start
                if args.deadline is not None and begun and elapsed + prime_s + run_s > args.deadline:
                    # Not begun: a run the limit would stop wastes the device time it ran. (The
                    # first run always begins: the invocation is for it, and nothing is measured yet.)
                    results["skipped"].append({"arm": key, "seed": seed, "processes": action, "prime_s": prime_s,
                                               "run_s": run_s, "elapsed_s": elapsed, "deadline_s": args.deadline})
                    if not args.plan:
                        print(f"[{time.monotonic() - t_all:6.1f}s] skipped {key} seed {seed}: estimated "
                              f"{prime_s + run_s:.0f}s ({action}{', priming' if prime else ''}), "
                              f"{args.deadline - elapsed:.0f}s left of --deadline {args.deadline:.0f}", flush=True)
                        (args.out / "arms.json").write_text(json.dumps(results, indent=1))
                    continue
                begun += 1
                if args.plan:
                    pool.plan(cfg, n_stacks(cfg))
                    if prime:
                        primed.add(shape)
                    plan_clock += prime_s + run_s
                    planned.append({"arm": key, "seed": seed, "jobs": n, "stacks": n_stacks(cfg),
                                    "processes": action, "prime": prime, "prime_s": prime_s, "run_s": run_s,
                                    "ends_s": plan_clock})
                    continue
                if prime:
                    # New processes (or a micro-batch size they have not trained at): one discarded
                    # step of this arm takes the compiles first.
                    primed.add(shape)
                    t0 = time.monotonic()
                    # Dedicated runs its jobs one at a time on the same processes: one job primes them.
                    prime_jobs = cfg.jobs[:1] if policy == "dedicated" else cfg.jobs
                    run_arm(cfg.model_copy(update={"jobs": [j.model_copy(update={"steps": 1}) for j in prime_jobs]}),
                            pool, baseline=False)
                    est.primed(action, sharing, n_stacks(cfg), time.monotonic() - t0)
                    results["primed"].append({"arm": key, "seed": seed, "wall_s": time.monotonic() - t0,
                                              "processes": action, "estimate_s": prime_s})
                    results["startup_s"].update(pool.startup_s())  # a limit during the run keeps them
                    (args.out / "arms.json").write_text(json.dumps(results, indent=1))
                    print(f"[{time.monotonic() - t_all:6.1f}s] primed {key} (discarded): "
                          f"{time.monotonic() - t0:.1f}s", flush=True)
                t0 = time.monotonic()
                summary, runs = run_arm(cfg, pool, baseline=False)
                summary["wall_s"] = time.monotonic() - t0
                if prime or action == "reuse":  # (processes started inside the run are no run's pace)
                    est.ran(name, pred["gpu_seconds"], summary["wall_s"])
                run_dir = args.out / f"{key}-s{seed}"
                if run_dir.exists():
                    run_dir = args.out / f"{key}-s{seed}-{int(time.time())}"
                run_dir.mkdir(parents=True)
                write_run(run_dir, cfg, summary, runs)
                audit = [d for diag in summary.get("diagnostics", []) for d in diag.get("logprob_agreement", [])]
                jit = run_jit_compiles(summary)  # kernels compiled inside the measured window (each a stall)
                eager = trainer_graph_failures(summary)  # trainers whose capture failed: they trained eager
                per_job = summary.get("per_job", {})
                phases = phase_seconds(runs)
                results["arms"].setdefault(key, {})[str(seed)] = {
                    "steps_per_gpu_hour": summary["steps_per_gpu_hour"], "busy": summary["busy"],
                    "rollout_tokens_per_gpu_s": summary["rollout_tokens_per_gpu_s"],
                    "stale_rollouts": summary["stale_rollouts"], "gpu_seconds": summary["gpu_seconds"],
                    "wall_s": summary["wall_s"], "estimate_s": run_s,
                    "sim_steps_per_gpu_hour": pred["steps_per_gpu_hour"],
                    "sim_profile": profile, "sim_outside_profile": pred.get("outside_profile") or [],
                    "engine_jit_compiles": None if jit is None else len(jit),
                    # Trainers asked for CUDA graphs that trained eager (their capture failed).
                    "trainer_graph_failures": eager,
                    "logprob_max_abs": max((a["max_abs"] for a in audit), default=None),
                    "logprob_mean_abs": (sum(a["mean_abs"] for a in audit) / len(audit)) if audit else None,
                    "eval_accuracy": {j: d["eval"]["accuracy"] for j, d in per_job.items() if d.get("eval")},
                    "mean_reward": {j: sum(d["rewards"]) / len(d["rewards"])
                                    for j, d in per_job.items() if d.get("rewards")},
                    "phase_mean_s": phases,  # each phase's mean action (phase_seconds)
                }
                print(f"[{time.monotonic() - t_all:6.1f}s] {key} seed {seed}: "
                      f"{summary['steps_per_gpu_hour']:.0f} steps/GPU-h (sim {pred['steps_per_gpu_hour']:.0f}), "
                      f"stale {summary['stale_rollouts']}, wall {summary['wall_s']:.1f}s"
                      + "".join(f", {p} {phases[p]:.3f} s" for p in ("train", "publish") if p in phases)
                      + state_text(summary)
                      + (f", JIT compiles {len(jit)} ({', '.join(sorted(set(jit)))})" if jit else "")
                      + (f", TRAINED EAGER, graphs failed ({'; '.join(eager)})" if eager else ""),
                      flush=True)
                # Every started cluster's start times (the pool keeps closed ones) with every run: a
                # limit that stops the invocation later leaves them recorded.
                results["startup_s"].update(pool.startup_s())
                (args.out / "arms.json").write_text(json.dumps(results, indent=1))
            results["trainer_restarts"] = {**results.get("trainer_restarts", {}), **pool.trainer_restarts()}
    finally:
        pool.close()
    if args.plan:
        print(plan_text(planned, results["skipped"], args.deadline, args.cpus))
        return
    for name, per in results["arms"].items():
        base_key = dedicated_key(name, results["arms"])
        for seed, d in per.items():
            base = results["arms"].get(base_key, {}).get(seed) if base_key else None
            if d.get("trainer_graph_failures") or (base or {}).get("trainer_graph_failures"):
                base = None  # one side trained eager though keyed graphed (-cg): no like-with-like ratio
            d["ratio_vs_dedicated"] = d["steps_per_gpu_hour"] / base["steps_per_gpu_hour"] if base else None
            d["sim_ratio_vs_dedicated"] = (d["sim_steps_per_gpu_hour"] / base["sim_steps_per_gpu_hour"]
                                           if base else None)
    import torch

    from calibration.measure import environment

    results["env"] = environment("cuda" if torch.cuda.is_available() else "cpu")
    (args.out / "arms.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({n: {s: (round(d["steps_per_gpu_hour"]), d["ratio_vs_dedicated"]) for s, d in per.items()}
                      for n, per in results["arms"].items()}))


if __name__ == "__main__":
    main()
