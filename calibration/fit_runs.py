"""`nodus fit`: refit a profile's trainer and publish costs from recorded real runs.

    nodus fit RUN_DIR... --base PROFILE --out PROFILE.json [--fit-max-jobs 4]

A microbenchmark (`nodus calibrate`) times the trainer on uniform rows and nothing else; a real
step also pads long-tailed rows, saves every adapter inside the train phase and computes its
audit. This fits what the simulator charges for those phases on the runs themselves, using only
runs with at most `fit_max_jobs` jobs per GPU (a dedicated arm is one job per GPU), so that the
shared 8- and 16-job runs stay held out for `nodus validate`.

Train: seconds = a * micro-batches + b * padded tokens + c * adapters + d * extra tokens of the
runs' multi-adapter layout (padded: regrouping; masked: each token times the other adapters of its
micro-batch), relative-error least squares, non-negative, with the micro-batches packed exactly as
the trainer packs them (`nodus.microbatch`); the profile records which layout d is of. When every
fitted step has the same adapter count, c cannot be told from a and is kept from the base
profile; runs with one job per step never regroup, which leaves d at 0. In runs of 1-4 identical
jobs a step's adapters, micro-batches and tokens grow together, so which of them carries the cost
is barely determined, yet it decides the prediction at 8 and 16 jobs: the terms kept are those
that predict steps left out of the fit (cross-validation over every subset holding a or b; ties
go to fewer terms), the others are 0 (`train_fit.term_selection`). By default one run is left out
at a time; `term_selection="extrapolate"` instead predicts the largest steps from the smaller ones,
as the profile will be used (`_select_train_terms`; on sessions 21-24's protocols one day better,
one slightly worse, two the same: `experiments/protocol_days.sh`).

Publish: seconds = a fixed part + a part per adapter, fitted on the publishes that no train step
on their GPU overlapped for more than half their time (least squares, each publish's error over its
run's mean publish, each run weighing the same; publishes of one size keep the base's split,
scaled to their mean); those it did overlap, their seconds over that fitted cost (their totals,
each run weighing the same), give the publish's co-run factor (a freed trainer's next step slows
a publish 4-7x on the H200). Means, not medians: steps per GPU-hour sees the total.

MPS settings: the rates below are those of the MPS settings the runs used (thread percentages,
the trainer's priority; the priority counts only in runs that co-run engine and trainer), which
the profile records (`sharing.controls`); runs of two settings are refused.

The simulator's work is seconds alone without MPS; a recorded train step that overlapped the
engine ran at a sharing rate. Each step is split into its time alone and its time beside a
generation on the same GPU, and its work is rate_alone * alone + rate_corun * co-run. Under MPS
both rates are unknowns of the same linear fit (they are identifiable because dedicated runs, one
job alone without MPS, pin the cost model); a rate whose time is under 15% of its mode's steps is
kept from the base profile.

The engine's rates come the same way, from every generation episode of the fitted runs: a
generate action (one job's requests or several), or several actions whose times overlapped on one
engine (two offset groups whose generations outlast their train steps share the engine's batches),
merged. Its work is the simulator's alone time (no MPS) of exactly its requests (each job's
prompts, prompt tokens and recorded response lengths, each action submitted at its recorded offset
in the episode, the run's max_num_seqs and max_loras) at the fitted decode scale, idle gaps left
out, and its seconds split into alone and beside a train step. (Within a merged episode the alone
replay's batch at each moment is not quite the run's, since the run's co-run slowed the first
action before the next one joined: rates fitted to within a few percent on simulated runs.) Without MPS the alone rate is 1 and none_corun.engine is
fitted; under MPS mps_alone.engine and mps_corun.engine; the same 15% rule keeps a rate from the
base. Dedicated runs without MPS are that alone case: they fit decode.scale (seconds = fixed +
scale * decode steps, over their one-job generations, to their total seconds) and are left out
of the rates. (An earlier
method matched one-job MPS generations to a dedicated run's same job, step and lengths and took
the dedicated seconds as the work: it saw only one-job generations of replayed seeds, so it never
fitted none_corun.engine and fitted mps_corun.engine at 1 job per generation only; the work as the
simulator's own alone time is what the simulator will charge, so the rates are consistent with it.)
Prefill and the decode curves are kept from the base profile, and so is any rate the runs do not
cover.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
from pathlib import Path

import numpy as np

from calibration.validate import jobs_per_gpu, load_recorded
from nodus.accounting import covered_length, union_length
# (corun_key as corun_policy: loops below name a profile field corun_key)
from nodus.config import (NO_CORUN_POLICIES, ConfigError, EngineSpec, corun_key as corun_policy,
                          engine_graph_max_tokens, packed_rows, stacks_of)
from nodus.microbatch import microbatch_costs, step_rows


MIN_RATE_SHARE = 0.15  # a sharing rate is fitted only where this share of its mode's time exercises it
PUBLISH_BESIDE_TRAIN = 0.5  # a publish counts as beside a train step past this share of its time
# Per sharing mode of a run: its alone rate's key (None: alone without MPS, the work itself) and its
# co-run rate's key in the profile's sharing section; the trainer's and the engine's fits both use it.
SHARING_MODES = (("none", None, "none_corun"), ("mps", "mps_alone", "mps_corun"))


def _actions(spans: list[dict], phases: tuple[str, ...]) -> dict[tuple, list[dict]]:
    """Spans grouped into actions: (phase, gpu, group, start, end) -> the jobs' spans of that action."""
    actions: dict[tuple, list[dict]] = {}
    for s in spans:
        if s["phase"] in phases:
            actions.setdefault((s["phase"], s["gpu"], s["group"], s["start_s"], s["end_s"]), []).append(s)
    return actions


def _busy(spans: list[dict], phase: str) -> dict[int, list[tuple[float, float]]]:
    """Per GPU, the intervals in which an action of ``phase`` ran."""
    per: dict[int, list[tuple[float, float]]] = {}
    for _, gpu, _, start, end in _actions(spans, (phase,)):
        per.setdefault(gpu, []).append((start, end))
    return per


def _generation_actions(spans: list[dict]) -> dict[tuple, list[dict]]:
    """Generate spans grouped into the engine's actions: (gpu, stack, group, step) -> the jobs'
    spans, in the order the action submitted them. A job's span ends when its own sequences do,
    so the jobs of one action need not share an end (nor, in the simulator, a start)."""
    actions: dict[tuple, list[dict]] = {}
    for s in spans:
        if s["phase"] == "generate":
            actions.setdefault((s["gpu"], s.get("stack", 0), s["group"], s["attrs"].get("step")), []).append(s)
    return actions


def generate_samples(run_dir: Path, recorded: tuple | None = None) -> list[dict]:
    """Per generation episode of a run: a generate action (one job or several), or several whose
    times overlapped on one GPU (the engine batched their requests together, as two offset groups
    do when generation outlasts training), merged. Each: its requests (job, prompts, prompt tokens
    each, response lengths, ``offset_s`` after the episode's start when its action was submitted,
    ``action`` its index in the episode), seconds from the first start to the last end, the seconds
    of it that a train step on the same GPU overlapped, the number of actions, and the run's engine
    limits. ``recorded``: the run's ``load_recorded`` result, when the caller has it already."""
    cfg, _, spans = recorded or load_recorded(run_dir)
    train = _busy(spans, "train")
    per_engine: dict[tuple, list[tuple[float, float, list[dict]]]] = {}  # (gpu, stack): one engine
    for k, members in _generation_actions(spans).items():
        start, end = min(m["start_s"] for m in members), max(m["end_s"] for m in members)
        per_engine.setdefault(k[:2], []).append((start, end, members))
    specs = {j.get("id"): j for j in cfg["jobs"]}
    engine = cfg.get("engine") or {}
    spec = EngineSpec.model_validate(engine)
    max_num_seqs, graph_max = spec.max_num_seqs, engine_graph_max_tokens(spec)
    out = []
    for (gpu, _), actions in sorted(per_engine.items()):
        episodes: list[list[tuple[float, float, list[dict]]]] = []
        for act in sorted(actions, key=lambda a: a[0]):
            if episodes and act[0] < max(a[1] for a in episodes[-1]):
                episodes[-1].append(act)
            else:
                episodes.append([act])
        for ep in episodes:
            start, end = ep[0][0], max(a[1] for a in ep)
            requests = []
            for i, (a_start, _, members) in enumerate(ep):
                for m in members:
                    lengths = tuple(m["attrs"].get("response_tokens") or ())
                    ptoks = m["attrs"].get("prompt_tokens")
                    requests.append({"job": m["job"], "prompts": specs.get(m["job"], {}).get("prompts_per_step", 8),
                                     "prompt_tokens_each": max(1, round(ptoks / len(lengths))) if lengths and ptoks else None,
                                     "lengths": lengths, "offset_s": a_start - start, "action": i})
            dur = end - start
            corun = covered_length(start, end, train.get(gpu, []))
            out.append({"step": ep[0][2][0]["attrs"].get("step"), "requests": requests, "actions": len(ep),
                        "s": dur, "alone_s": dur - corun, "corun_s": corun, "sharing": cfg["arm"]["sharing"],
                        "max_num_seqs": max_num_seqs, "graph_max_tokens": graph_max,
                        "max_loras": engine.get("max_loras") or len({r["job"] for r in requests}),
                        "audit": cfg.get("audit")})
    return out


def engine_kernel_configs(summary: dict) -> dict | None:
    """The LoRA kernel configs a run's engine recorded at start (``lora_kernel_configs`` of its
    worker info: folder, GPU, source), or None (vLLM's defaults, or a run before the record)."""
    for d in summary.get("diagnostics", []):
        for name, w in (d.get("workers") or {}).items():
            if name.startswith("engine") and w.get("lora_kernel_configs"):
                return dict(w["lora_kernel_configs"])
    return None


def trainer_layout(summary: dict) -> str:
    """The multi-adapter layout a run's trainer used (its workers' diagnostics): masked or padded;
    `auto` counts as masked (it takes the masked path while a micro-batch has few adapters); a run
    without it (the simulator's) as padded, the layout profiles assumed before they named one."""
    for d in summary.get("diagnostics", []):
        for name, info in (d.get("workers") or {}).items():
            if name.startswith("trainer") and isinstance(info, dict) and info.get("lora_layout"):
                return "padded" if info["lora_layout"] == "padded" else "masked"
    return "padded"


def train_samples(run_dir: Path, recorded: tuple | None = None,
                  layout: str | None = None) -> tuple[list[dict], list[dict]]:
    """Per train action of a run: its micro-batches' padded tokens, extra tokens of its trainer's
    multi-adapter layout (``layout``, default the run's own), adapter count and seconds (alone and
    beside a generation on its GPU); and per publish action its wait per adapter and whether a train
    step on its GPU overlapped it for more than ``PUBLISH_BESIDE_TRAIN`` of its time."""
    cfg, summary, spans = recorded or load_recorded(run_dir)
    layout = layout or trainer_layout(summary)
    engine, trainer = _busy(spans, "generate"), _busy(spans, "train")
    cap = cfg["trainer"]["max_tokens_per_microbatch"]
    gen = {(s["gpu"], s["job"], s["attrs"].get("step")): s for s in spans if s["phase"] == "generate"}
    samples, publish = [], []
    for (phase, gpu, _, start, end), members in sorted(_actions(spans, ("train", "publish")).items()):
        if phase == "publish":
            beside = covered_length(start, end, trainer.get(gpu, [])) > PUBLISH_BESIDE_TRAIN * (end - start)
            publish.append({"s_per_adapter": (end - start) / len(members), "adapters": len(members),
                            "s": end - start, "beside_train": beside})
            continue
        rows = []
        for m in members:
            g = gen.get((gpu, m["job"], m["attrs"].get("step")))
            if g is None:
                raise ConfigError(f"{run_dir}: train span of {m['job']} step {m['attrs'].get('step')} "
                                  "has no generate span to take its rows from")
            rows.append(step_rows(g["attrs"]["prompt_tokens"], g["attrs"]["n_sequences"], g["attrs"]["response_tokens"]))
        mbs, regroup = microbatch_costs(rows, cap, layout)
        corun = covered_length(start, end, engine.get(gpu, []))
        samples.append({"microbatches": len(mbs), "padded_tokens": sum(mbs), "regroup_tokens": regroup,
                        "adapters": len(members), "s": end - start, "alone_s": end - start - corun,
                        "corun_s": corun, "sharing": cfg["arm"]["sharing"]})
    return samples, publish


def nonneg_rel_lstsq(X: np.ndarray, y: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
    """argmin sum(((X w - y) / scale)^2) over w >= 0 (scale defaults to y: relative error): the
    best unconstrained fit over every subset of free coefficients (few columns, so exhaustive)."""
    scale = y if scale is None else scale
    A, t = X / scale[:, None], y / scale
    best, best_err = np.zeros(X.shape[1]), float(np.sum(t ** 2))
    for k in range(1, X.shape[1] + 1):
        for cols in itertools.combinations(range(X.shape[1]), k):
            w, *_ = np.linalg.lstsq(A[:, cols], t, rcond=None)
            if np.any(w < 0):
                continue
            full = np.zeros(X.shape[1])
            full[list(cols)] = w
            err = float(np.sum((A @ full - t) ** 2))
            if err < best_err:
                best, best_err = full, err
    return best


def graphless_points(path: str | Path, graph_max_tokens: int | None = None) -> tuple[int, list[dict]]:
    """(graph size, steps): decode steps measured past the measuring engine's CUDA-graph sizes, from
    a JSON of decode rows (``{"decode": [{"batch", "adapters", "step_s"}, ...]}``: a phase-profile
    measurement, or a profile whose ``measurements.calibrate`` holds such rows under ``decode`` and
    ``graphless``): per adapter count, the row of the largest batch above the graph size. The graph
    size is the one the file records (``nodus calibrate`` does), else ``graph_max_tokens``, else
    vLLM's default at ``max_num_seqs`` >= 256, 512; a given one other than the recorded is refused."""
    data = json.loads(Path(path).read_text())
    cal = (data.get("measurements") or {}).get("calibrate") or {}
    recorded = cal.get("graph_max_tokens")
    if recorded and graph_max_tokens and graph_max_tokens != recorded:
        raise ValueError(f"{path}: measured on an engine with CUDA graphs up to {recorded} tokens, not the "
                         f"{graph_max_tokens} given (--graph-max-tokens): leave it out")
    if graph_max_tokens is not None and graph_max_tokens < 1:
        raise ValueError(f"--graph-max-tokens {graph_max_tokens}: a CUDA-graph size is >= 1 token")
    graph_max_tokens = recorded or graph_max_tokens or 512
    rows = data["decode"] if isinstance(data.get("decode"), list) else \
        (cal.get("decode") or []) + (cal.get("graphless") or []) if cal else None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: no decode rows (a list under 'decode' or 'measurements.calibrate.decode')")
    best: dict[int, dict] = {}
    for r in rows:
        try:
            b, a, s = int(r["batch"]), int(r["adapters"]), float(r["step_s"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: a decode row without batch, adapters and step_s: {r!r}") from None
        if b > graph_max_tokens and s > 0 and (a not in best or b > best[a]["batch"]):
            best[a] = {"adapters": a, "batch": b, "step_s": s}
    if not best:
        raise ValueError(f"{path}: no decode row past {graph_max_tokens} tokens (the CUDA-graph sizes): "
                         "measure a batch above them (nodus calibrate does)")
    return graph_max_tokens, [best[a] for a in sorted(best)]


def _refuse_other_engine(rd: Path, controls: dict, command: str, audit_ok: bool = False) -> None:
    """Refuse (ConfigError, naming ``command``) a run whose engine is not the one a profile describes:
    logprobs returned on fewer steps or responses than every response of every step (unless
    ``audit_ok``: the base prices the audit, ``sim.profile.audit_priced``, and the fit replays each
    run with its own), or vLLM's core in a process of its own."""
    if controls.get("audit") and not audit_ok:
        raise ConfigError(f"{command}: {rd}'s engine returned logprobs on fewer steps or responses (audit "
                          f"{controls['audit']}; --audit-every / --audit-responses / --no-audit) than the runs a "
                          "profile describes (every response of every step), and the base profile does not price "
                          "a lighter audit (decode.logprob_s_per_seq 0): its generations would fit a cheaper "
                          "engine; fit runs at the default audit, or on a base fitted by nodus fit-audit")
    if controls.get("engine_core_process"):
        raise ConfigError(f"{command}: {rd}'s engine ran its core in a process of its own (--engine-core-process); "
                          "a profile describes an engine in one process: fit runs without it")


def _add_hosts(hosts: list, summary: dict) -> None:
    """Append the hosts a run's diagnostics record that ``hosts`` does not hold yet."""
    for d in summary.get("diagnostics", []):
        if d.get("host") and d["host"] not in hosts:
            hosts.append(d["host"])


def _engine_curves_assumption(kernels: str, curves_kernels: str, scale: float, fitted: bool) -> dict:
    """Assumption ``engine-curves-from-base``: an engine of ``kernels`` LoRA kernel configs priced by
    decode curves measured with ``curves_kernels`` ones, times ``scale`` (``fitted`` on dedicated runs'
    generations, or kept from the base)."""
    return {"id": "engine-curves-from-base", "value": curves_kernels,
            "what": f"the engine ran the {kernels} LoRA kernel configs, the decode curves were measured with "
                    f"the {curves_kernels} ones: they are those curves times decode.scale ({scale:.3f}, "
                    f"{'fitted on' if fitted else 'kept from the base: no'} dedicated runs' generations), "
                    "prefill is the base's unscaled; nodus calibrate with the same kernels measures them"}


def _note_carried(prof: dict, key: str, now: str | None, what, base_value: str | None = None) -> None:
    """Keep the profile's assumption ``key`` (its ``value``: where the base's terms were measured) in
    step with a fit whose runs are of ``now``: added, with ``what(origin)`` as its text, when the
    origin (the assumption's value where the base carries one, else ``base_value``, the base's own)
    differs from ``now``; dropped when it does not."""
    held = next((x for x in prof["assumptions"] if x["id"] == key), None)
    origin = held["value"] if held else base_value
    prof["assumptions"] = [x for x in prof["assumptions"] if x["id"] != key]
    if origin is not None and now is not None and origin != now:
        prof["assumptions"].append({"id": key, "value": origin, "what": what(origin)})


def fit(runs: list[str | Path], base: str, fit_max_jobs: int = 4, trainer_mode: str | None = None,
        lora_kernels: str | None = None, graphless_from: str | Path | None = None,
        graph_max_tokens: int | None = None, scales_only: bool = False,
        term_selection: str = "runs", step_floor: bool = False) -> dict:
    """A profile: the base's, with trainer and publish costs fitted on the eligible runs.

    ``trainer_mode`` (default: the base's ``train.step_mode``): the trainer the runs used and the
    fitted train terms describe. Another mode than the base's re-describes the trainer from the
    runs alone (a graphed trainer's profile from an eager base, before ``nodus calibrate
    --trainer-graphs`` has measured one); the trainer's co-run and MPS rates the runs do not fit
    stay the base trainer's, and the profile says so (assumption ``trainer-rates-from-base``).

    ``lora_kernels`` (default: the base's, ``environment.lora_kernel_configs``): the engine's LoRA
    kernel configs the runs used ("default" or "tuned"). Another than the base's fits that engine
    onto the base: the decode curves keep the base's shape and the dedicated runs' generations fit
    their scale (``decode.scale``, so a fit set without a dedicated run is refused), the engine's
    rates are fitted as always, prefill is the base's; the profile records the runs' configs and
    says so (assumption ``engine-curves-from-base``).

    ``graphless_from`` (a JSON of measured decode rows, ``graphless_points``): the steps past the
    engine's CUDA graphs that a run queueing past max_num_seqs pays (``decode.graphless``; assumption
    ``graphless-flat``), set before the engine's scale and rates are fitted; ``graph_max_tokens``:
    the graph size of the engine that measured them, when the file does not record it.

    ``step_floor``: fit the engine's per-step host floor (``decode.step_floor_s``) together with
    ``decode.scale`` on the runs' lone generations of several batch sizes (``_decode_scale_floor``)
    instead of the scale alone on the dedicated runs'.

    The runs' adapter handoff (``RealOptions.adapter_format``, one per fit) is the one the fitted
    train and publish terms describe (``environment.adapter_format``).

    ``scales_only``: carry the base to another day's host instead of refitting its terms. The
    base's cost shapes and sharing rates are kept; the runs fit three scales: the trainer's terms
    times one factor (relative least squares over their train steps), ``decode.scale`` (their
    dedicated generations: a dedicated run is needed) and the publish cost per adapter. The day's
    dedicated runs alone (1 job, inside the fit set's 1-4 jobs) then carry a profile to that day
    (assumption ``day-scales``): what a dedicated run cannot separate stays in the base's proportion
    (the per-adapter train cost, scaled with the other terms) or the base's (the co-run and MPS
    rates), where a full refit on dedicated runs would guess it. Sessions 13-15 measured it over
    four day-to-day carries: not reliably better than the base unchanged (README).

    ``term_selection``: how the train terms the runs support are chosen (``_select_train_terms``):
    "runs" leaves one run out, "extrapolate" scores each subset on the larger steps fitted on the
    smaller ones."""
    from sim.profile import (LORA_KERNELS, STEP_MODES, Profile, add_source, audit_priced, drop_base_validation,
                             drop_two_engine_rate, profile_adapter_format, profile_dict, profile_lora_kernels,
                             profile_step_mode, set_assumption)
    from calibration.run_settings import run_controls, settings_text, sharing_controls

    if term_selection not in TERM_SELECTIONS:
        raise ConfigError(f"nodus fit: term selection {term_selection!r}: choose one of {', '.join(TERM_SELECTIONS)}")

    prof = profile_dict(base)  # read once: the checks below read it, the fit changes it
    base_mode = profile_step_mode(prof)
    want_mode = trainer_mode or base_mode
    if want_mode not in STEP_MODES:
        raise ConfigError(f"nodus fit: --trainer-mode {want_mode!r}; choose one of {', '.join(STEP_MODES)}")
    base_kernels = profile_lora_kernels(prof)
    want_kernels = lora_kernels or base_kernels
    if want_kernels not in LORA_KERNELS:
        raise ConfigError(f"nodus fit: --lora-kernels {want_kernels!r}; choose one of {', '.join(LORA_KERNELS)}")
    kernel_configs = None  # what the runs' engines recorded (the profile's, when they differ from the base)
    used, skipped, samples, publish, gens, commits, hosts = [], [], [], [], [], set(), []
    slots: set = set()  # the runs' engines' adapter slots (engine_max_loras; None: not recorded)
    cpu_caps: dict = {}  # the runs' trainers' capped CPU threads (None: torch's own count) -> runs
    layouts: dict[str, list[str]] = {}
    handoffs: dict[str, list[str]] = {}  # adapter handoff (RealOptions.adapter_format) -> runs
    gpus: dict[str, list[str]] = {}  # the GPU each run recorded (diagnostics' gpu, since session 51) -> runs
    mps_runs: list[tuple[str, dict, bool]] = []  # MPS runs: run, its MPS settings, whether it co-runs
    for rd in map(Path, runs):
        recorded = load_recorded(rd)
        cfg, summary, _ = recorded
        if jobs_per_gpu(cfg) > fit_max_jobs:
            skipped.append(str(rd))
            continue
        controls = run_controls(summary)
        mode, kernels = controls.get("trainer_step_mode", "eager"), controls.get("lora_kernels", "default")
        if mode != want_mode:
            raise ConfigError(f"nodus fit: {rd} trained {mode} but the fitted profile's trainer is {want_mode} "
                              f"({'--trainer-mode' if trainer_mode else 'the base profile, train.step_mode'}): fit "
                              "runs of one trainer (a graphed trainer's base: nodus calibrate --trainer-graphs; or "
                              "--trainer-mode graphed to fit its terms onto another base)")
        _refuse_other_engine(rd, controls, "nodus fit", audit_priced(prof))
        if controls.get("engine_cpu_threads"):
            raise ConfigError(f"nodus fit: {rd}'s engine ran {controls['engine_cpu_threads']} torch CPU threads "
                              "(--engine-cpu-threads); a profile records no engine thread cap: fit runs on torch's "
                              "own count")
        if stacks_of(cfg["arm"]) > 1:
            raise ConfigError(f"nodus fit: {rd} ran {cfg['arm']['stacks']} engine + trainer stacks (arm.stacks): its "
                              "generations ran beside another engine, which no profile term describes; fit one-stack "
                              "runs")
        share = packed_rows((cfg.get("trainer") or {}).get("share_prompts"))
        if share:
            raise ConfigError(f"nodus fit: {rd} trained each prompt once (trainer.share_prompts={share}); a "
                              "profile's train terms describe a row per response: fit runs without it")
        if controls.get("publish_pinned") is False:
            raise ConfigError(f"nodus fit: {rd}'s engine loaded published adapters into pageable host memory "
                              "(publish_pinned false, :np); a profile describes vLLM's pinned loads: fit runs "
                              "without it")
        # The handoff the fitted train (the trainer's save) and publish (the engine's load) terms describe.
        handoffs.setdefault(controls.get("adapter_format", "safetensors"), []).append(str(rd))
        if kernels != want_kernels:
            hint = ("the runs mix two engines: fit the runs of one" if lora_kernels else
                    f"or --lora-kernels {kernels} to fit that engine onto this base")
            said = "--lora-kernels" if lora_kernels else "the base profile, environment.lora_kernel_configs"
            raise ConfigError(f"nodus fit: {rd}'s engine ran {kernels} LoRA kernel configs but the fitted profile's "
                              f"engine is the {want_kernels} kernels' ({said}): "
                              "fit runs of one engine (nodus calibrate measures the engine with the tuned configs "
                              f"nodus ships, --no-tuned-lora-kernels without; {hint})")
        cpu_caps.setdefault(controls.get("trainer_cpu_threads"), []).append(str(rd))
        kernel_configs = kernel_configs or engine_kernel_configs(summary)
        if cfg["arm"].get("sharing") == "mps":
            # The trainer's priority counts only in runs that co-run engine and trainer.
            policy = corun_policy(cfg["arm"].get("policy"), cfg["arm"].get("stacks"))
            mine = sharing_controls(controls, policy)
            mps_runs.append((str(rd), mine, policy not in NO_CORUN_POLICIES))
        layout = trainer_layout(summary)
        layouts.setdefault(layout, []).append(str(rd))
        s, p = train_samples(rd, recorded, layout)
        samples += [dict(x, run=str(rd)) for x in s]
        publish += [dict(x, run=str(rd)) for x in p]
        gens += [dict(g, dedicated=cfg["arm"]["policy"] == "dedicated") for g in generate_samples(rd, recorded)]
        used.append(str(rd))
        commits.add(summary.get("git_commit") or "unrecorded")
        _add_hosts(hosts, summary)
        slots.update(d.get("engine_max_loras") for d in summary.get("diagnostics", []))
        for d in summary.get("diagnostics", []):
            if (d.get("gpu") or {}).get("name"):
                gpus.setdefault(d["gpu"]["name"], []).append(str(rd))
    if len(layouts) > 1:
        raise ConfigError("nodus fit: the runs' trainers used different multi-adapter layouts ("
                          + "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(layouts.items()))
                          + "); fit the runs of one layout")
    if len(gpus) > 1:
        raise ConfigError("nodus fit: the runs ran on different GPUs ("
                          + "; ".join(f"{k}: {', '.join(sorted(set(v)))}" for k, v in sorted(gpus.items()))
                          + "); fit the runs of one GPU")
    if len(handoffs) > 1:
        raise ConfigError("nodus fit: the runs' trainers handed adapters to the engine in different formats ("
                          + "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(handoffs.items()))
                          + "), which the train and publish terms include; fit the runs of one handoff")
    if len(cpu_caps) > 1:
        raise ConfigError("nodus fit: the runs' trainers ran different CPU thread counts ("
                          + "; ".join(f"{n or 'torch default'}: {', '.join(v)}"
                                      for n, v in sorted(cpu_caps.items(), key=lambda kv: kv[0] or 0))
                          + "), which move the train step beside the engine (session 28: 2 threads trained in "
                          "half the time of 16); fit the runs of one setting")
    mps_settings = _mps_settings(mps_runs)
    if len(mps_settings) > 1:
        raise ConfigError("nodus fit: the MPS runs used different MPS settings ("
                          + "; ".join(f"{settings_text(dict(k))}: {', '.join(v)}"
                                      for k, v in sorted(mps_settings.items()))
                          + "), which move the co-run rates the fit sets; fit the runs of one setting")
    runs_mps = next(iter(mps_settings), None)
    co_runs = any(c for _, _, c in mps_runs)
    base_ctrl = dict(prof["sharing"].get("controls") or {})
    # Without a co-running MPS run the runs say nothing of the trainer's priority.
    base_mps = tuple(sorted((k, v) for k, v in base_ctrl.items() if co_runs or k != "trainer_priority"))
    if scales_only and runs_mps is not None and runs_mps != base_mps:
        raise ConfigError("nodus fit --scales-only keeps the base's MPS rates, fitted under "
                          f"{settings_text(dict(base_mps))}: its MPS runs ran {settings_text(dict(runs_mps))} "
                          f"({', '.join(mps_settings[runs_mps])})")
    runs_cap, base_cap = next(iter(cpu_caps), None), (prof.get("environment") or {}).get("trainer_cpu_threads")
    if scales_only and runs_cap != base_cap:
        raise ConfigError(f"nodus fit --scales-only keeps the base's train terms and rates, measured with the trainer "
                          f"on {base_cap or 'torch default'} CPU threads (environment.trainer_cpu_threads): its runs "
                          f"ran {runs_cap or 'torch default'}")
    if len(samples) < 3:
        raise ConfigError(f"nodus fit: {len(samples)} train steps in runs with <= {fit_max_jobs} jobs per GPU "
                          f"(need >= 3); held out: {skipped}")
    y = np.array([s["s"] for s in samples])
    mb = np.array([s["microbatches"] for s in samples], dtype=float)
    tok = np.array([s["padded_tokens"] for s in samples], dtype=float)
    ad = np.array([s["adapters"] for s in samples], dtype=float)
    rg = np.array([s["regroup_tokens"] for s in samples], dtype=float)
    base_layout = prof["train"].get("extra_tokens_layout", "padded")
    if scales_only and (want_mode != base_mode or want_kernels != base_kernels or next(iter(layouts)) != base_layout):
        raise ConfigError(f"nodus fit --scales-only keeps the base's terms: its runs must use the base's trainer "
                          f"({base_mode}, {base_layout} layout) and LoRA kernels ({base_kernels}), not {want_mode}, "
                          f"{next(iter(layouts))} / {want_kernels}")
    sharing = prof["sharing"]
    mode = np.array([s["sharing"] for s in samples])
    alone = np.array([s["alone_s"] for s in samples])
    corun = np.array([s["corun_s"] for s in samples])
    rates: dict[str, float] = {}
    if scales_only:
        a, b, c, d, train_scale = _scaled_train_terms(prof, y, mb, tok, ad, rg, mode, alone)
        names, w, c_source = [], {}, "base profile times the runs' train scale"
        selection = None
    else:
        a, b, c, d, names, w, c_source, selection = _fitted_train_terms(
            prof, y, mb, tok, ad, rg, mode, alone, corun, rates, run=[s["run"] for s in samples],
            scheme=term_selection)
        train_scale = None
    work = a * mb + b * tok + c * ad + d * rg
    # The step's predicted seconds: its work at the rates it ran under.
    pred = work / _trainer_rate(sharing, mode, alone, y)
    rel = (pred - y) / y
    if graphless_from is not None:
        # Steps past the CUDA-graph sizes (a mid-batch admission at a nearly full batch, in runs that
        # queue more sequences than max_num_seqs) run without graphs: set before the engine's fits.
        prof["decode"]["graph_max_tokens"], prof["decode"]["graphless"] = graphless_points(graphless_from,
                                                                                         graph_max_tokens)
    decode_fit = _decode_scale_floor(gens, prof) if step_floor else _decode_scale(gens, prof)
    if want_kernels != base_kernels and decode_fit is None:
        raise ConfigError(f"nodus fit: --lora-kernels {want_kernels} fits that engine onto a base of the {base_kernels} "
                          "kernels through decode.scale, which only dedicated runs' generations fit (>= 3 of one job "
                          "alone without MPS): add a dedicated run of the same engine")
    if scales_only:
        if decode_fit is None:
            raise ConfigError("nodus fit --scales-only: the engine's scale (decode.scale) is fitted on dedicated runs' "
                              "generations (>= 3 of one job alone without MPS): add a dedicated run of the day")
        engine_fit = None
    else:
        engine_rates, engine_fit = _engine_rates(gens, prof)
        rates.update(engine_rates)
    prof["train"]["per_microbatch"] = {"a_s": float(a), "b_s_per_unit": float(b)}
    prof["train"]["s_per_adapter"] = float(c)
    prof["train"]["s_per_regroup_token"] = float(d)
    prof["train"]["extra_tokens_layout"] = next(iter(layouts), "padded")
    prof["train"]["max_profiled_tokens"] = int(max(tok.max(), prof["train"].get("max_profiled_tokens") or 0))
    pub_fit = _publish_fit(publish, prof["publish"])
    if scales_only:
        prof["assumptions"] = [x for x in prof.get("assumptions", []) if x["id"] != "day-scales"] + [
            {"id": "day-scales", "value": train_scale,
             "what": f"the base's cost shapes and sharing rates, carried to the fitted runs' host by three scales "
                     f"(nodus fit --scales-only on {len(used)} run(s)): every train term x {train_scale:.3f} (the "
                     f"per-adapter one too, in proportion), decode.scale {decode_fit['base_scale']:.3f} -> "
                     f"{decode_fit['scale']:.3f}, publish "
                     + (f"{prof['publish']['save_s_per_publish']:.4f} s + "
                        f"{prof['publish']['save_s_per_adapter']:.4f} s per adapter"
                        if pub_fit["save_s_per_adapter"] is not None else "kept from the base (no publish in the runs)")
                     + "; the co-run and MPS rates are the base day's"}]
    prof["assumptions"] = [x for x in prof.get("assumptions", []) if x["id"] != "sharing-controls-mixed"]
    if runs_mps is not None and any(k.startswith("mps_") for k in rates):
        new = dict(runs_mps)
        if not co_runs and "trainer_priority" in base_ctrl:
            new["trainer_priority"] = base_ctrl["trainer_priority"]  # the co-run rates stay the base's
        sharing["controls"] = new  # the MPS rates fitted are now these settings'
        # MPS rates kept from the base that a changed setting moves (the priority: the co-run ones).
        changed = {k for k in set(new) | set(base_ctrl) if new.get(k) != base_ctrl.get(k)}
        kept = [f"{m}.{side}" for m in ("mps_alone", "mps_corun") for side in ("engine", "trainer")
                if f"{m}.{side}" not in rates]
        moved = [k for k in kept if any(c != "trainer_priority" or k.startswith("mps_corun") for c in changed)]
        if moved:
            prof["assumptions"].append(
                {"id": "sharing-controls-mixed", "value": None,
                 "what": f"the MPS rates {', '.join(moved)} are the base profile's, fitted under "
                         f"{settings_text(base_ctrl)}; the rates fitted here are of "
                         f"{settings_text(new)} (sharing.controls): runs that exercise them "
                         "under these settings would fit them"})
    dropped = _drop_refitted_batch_rates(sharing, rates)
    if rates:
        # One entry for this fit, replacing a base's own (a refit of a refit would pile them up):
        # it names the rates fitted now and the values of the others, kept from the base.
        keep = [x for x in prof.get("assumptions", []) if x["id"] not in ("sharing-from-base", "sharing-partly-fitted")]
        for x in keep:
            if x["id"] == "sharing-constant":  # no longer one measured configuration's
                x["what"] = ("co-run and MPS rates are constants per mode, the same for every batch size, token "
                             "count and number of jobs (nodus fit fits them on recorded runs of 1-4 jobs)")
        fitted = ", ".join(f"{k} {v:.3f}" for k, v in sorted(rates.items()))
        others = ", ".join(f"{m}.{side} {sharing[m][side]:.3f}" for m in ("none_corun", "mps_alone", "mps_corun")
                           for side in ("engine", "trainer") if f"{m}.{side}" not in rates)
        keep.append({"id": "sharing-partly-fitted", "value": None,
                     "what": f"sharing rates fitted on recorded runs by nodus fit ({fitted}); "
                             + (f"the others are the base profile's ({others})" if others else "no other rate")
                             + (f"; the base's by-engine-batch {', '.join(dropped)} rates gave way to them"
                                if dropped else "")})
        prof["assumptions"] = keep
    prof["train"]["step_mode"] = want_mode
    if want_mode != base_mode:
        kept = [f"{m}.trainer {sharing[m]['trainer']:.3f}" for m in ("none_corun", "mps_alone", "mps_corun")
                if f"{m}.trainer" not in rates]
        prof["assumptions"] = [x for x in prof.get("assumptions", []) if x["id"] != "trainer-rates-from-base"] + [
            {"id": "trainer-rates-from-base", "value": None,
             "what": f"the train terms describe the {want_mode} trainer (nodus fit on its runs), but the base profile "
                     f"measured the {base_mode} one: the trainer's co-run and MPS rates not fitted here are that "
                     f"trainer's ({', '.join(kept) if kept else 'none'}); nodus calibrate-sharing on a "
                     f"{want_mode} profile measures them"}]
    # Which kernels the decode curves were measured with: the base's, or what an earlier such fit said.
    carried = next((x for x in prof.get("assumptions", []) if x["id"] == "engine-curves-from-base"), None)
    curves_kernels = carried["value"] if carried else base_kernels
    if want_kernels != base_kernels:
        # An engine record of the runs' (or, for runs that recorded none but were tuned through the
        # environment, a note of that); "default" clears the base's record.
        prof["environment"]["lora_kernel_configs"] = (
            (kernel_configs or {"source": "--engine-env", "note": "the runs' engine environment named the folder"})
            if want_kernels == "tuned" else None)
    prof["assumptions"] = [x for x in prof.get("assumptions", []) if x["id"] != "engine-curves-from-base"]
    if want_kernels != curves_kernels:
        prof["assumptions"].append(_engine_curves_assumption(want_kernels, curves_kernels,
                                                             prof["decode"].get("scale", 1.0), decode_fit is not None))
    if graphless_from is not None:
        name = Path(graphless_from).name
        measured = ", ".join(f"{p['step_s'] * 1e3:.1f} ms at batch {p['batch']} with {p['adapters']} adapters"
                             for p in prof["decode"]["graphless"])
        prof["assumptions"] = [x for x in prof["assumptions"] if x["id"] != "graphless-flat"] + [
            {"id": "graphless-flat", "value": None,
             "what": f"a decode step past the engine's CUDA-graph sizes ({prof['decode']['graph_max_tokens']} tokens) "
                     f"costs what one was measured at ({measured}, {name}) times decode.scale, whatever its batch: "
                     "launch-bound"}]
        if f"graphless steps from {name}" not in prof["environment"].get("sources", []):
            add_source(prof, f"graphless steps from {name}")  # (a base may have them)
    # The day its costs are: the runs' (a base's note of its own day does not describe this fit).
    prof["assumptions"] = [x for x in prof["assumptions"] if x["id"] != "host-day"] + [
        {"id": "host-day", "value": None,
         "what": f"fitted on {len(used)} run(s) of one host on one day (nodus fit, {datetime.date.today().isoformat()}): "
                 "hosts of one kind have measured up to a quarter apart from day to day (README, 'Fit and "
                 "validate'), so absolute steps per GPU-hour carry that spread; for a plan in absolute terms, "
                 "refit on the day's own 1-4-job runs"}]
    if decode_fit is not None:
        # The decode scale describes the runs' engine: its adapter slots where every run recorded the
        # same (nodus validate names a run on other slots), else unknown.
        prof["environment"]["engine_max_loras"] = next(iter(slots)) if len(slots) == 1 else None
    # The train terms describe the runs' trainers: their capped CPU threads (None: torch's own count).
    prof["environment"]["trainer_cpu_threads"] = runs_cap
    # The GPU the runs recorded and their adapter handoff, each where another than the base's: what
    # the fit does not set stays the base's, measured on its GPU and with its handoff, which the
    # profile says (an assumption naming where those terms came from, kept through later fits until
    # one fits runs of that GPU or handoff again). The GPU's memory is then looked up by its name.
    base_gpu = prof["environment"].get("gpu")
    runs_gpu = next(iter(gpus), base_gpu)
    if runs_gpu != base_gpu:
        prof["environment"]["gpu"], prof["environment"]["gpu_memory_gib"] = runs_gpu, None
    _note_carried(prof, "gpu-from-base", runs_gpu,
                  lambda origin: f"the runs ran on an {runs_gpu}, the base profile's terms were measured on an "
                                 f"{origin}: those this fit did not set (the decode and prefill curves' shape, the "
                                 "sharing rates it left to the base) are that GPU's", base_gpu)
    base_handoff = profile_adapter_format(prof)
    handoff = next(iter(handoffs), base_handoff)
    _note_carried(prof, "handoff-from-base", handoff, lambda origin: (
        f"the runs handed adapters over as {handoff} files, the base's train terms were measured with the {origin} "
        "handoff: the terms this fit kept (all of them, scaled to the runs' train steps, under --scales-only) "
        "include that handoff's save; the publish cost is the runs'"), base_handoff)
    prof["environment"]["adapter_format"] = handoff
    # The profile is dated by its newest change, the fit (its sources keep what the base was).
    prof["environment"]["date"] = datetime.date.today().isoformat()
    floored = (f" (--step-floor: each decode step max(curves x {decode_fit['scale']:.3f}, "
               f"{decode_fit['step_floor_s'] * 1e3:.2f} ms))" if step_floor else "")
    add_source(prof, f"nodus fit on {len(used)} run(s){floored}")
    if step_floor:
        sizes = ", ".join(str(z["sequences"]) for z in decode_fit["sizes"])
        set_assumption(prof, {
            "id": "decode-step-floor", "value": decode_fit["step_floor_s"],
            "what": f"every decode step takes at least {decode_fit['step_floor_s'] * 1e3:.2f} ms "
                    "(decode.step_floor_s, the engine's host loop), whatever its batch, adapters and context, fitted "
                    f"with decode.scale on lone generations of {sizes} sequences (nodus fit --step-floor); beside a "
                    "train step the floor is slowed by the engine's sharing rate as the rest of the step"})
    drop_two_engine_rate(prof)  # fitted beside the terms just refitted: stale now
    # The fitted costs are the runs' host's (launch-bound train steps, per-step engine work).
    if len(hosts) == 1:
        prof["environment"]["host"] = hosts[0]
    elif hosts:
        prof["environment"]["host"] = {"hosts": hosts, "note": "the fitted runs came from several hosts"}
    drop_base_validation(prof)
    prof.setdefault("measurements", {})["fit_runs"] = {
        "runs": used, "held_out": skipped, "fit_max_jobs": fit_max_jobs, "train_steps": len(samples),
        "train_fit": {"a_s_per_microbatch": float(a), "b_s_per_padded_token": float(b),
                      "c_s_per_adapter": float(c), "c_source": c_source,
                      "scale": train_scale,  # --scales-only: the base's terms times this; else None
                      "d_s_per_regroup_token": float(d),
                      "d_source": ("fitted" if "d" in names else c_source if scales_only
                                   else "0 (no multi-adapter micro-batch in the fitted runs)" if rg.max() == 0
                                   else "0: left out, it did not predict the steps left out of the fit "
                                        "(cross-validation)"),
                      "d_layout": prof["train"]["extra_tokens_layout"],
                      # Which terms cross-validation kept, by which scheme (None: not run,
                      # --scales-only), with each candidate's score.
                      "term_selection": selection,
                      "mape": float(np.mean(np.abs(rel))), "worst": float(np.max(np.abs(rel))),
                      # Fitted terms the non-negative fit pinned at 0: what the runs did not
                      # separate (e.g. padded tokens that only moved with the micro-batch count).
                      "at_zero": [n for n in names if w[n] == 0.0]},
        "sharing_fit": rates,
        "run_commits": sorted(commits),  # the code the fitted runs came from
        "publish_s_per_adapter": pub_fit["save_s_per_adapter"],  # None: kept from the base
        "publish_s_per_publish": pub_fit["save_s_per_publish"],
        "publish_corun_factor": pub_fit["corun_factor"],  # None: kept from the base
        "publish_corun_samples": {k: v for k, v in pub_fit.items() if k not in ("save_s_per_adapter", "corun_factor")},
        "decode_fit": decode_fit,
        # Per sharing mode: generate actions fitted, the engine's rates after the fit, which of them
        # were fitted, and the actions' predicted-seconds error at the base's rates and at these.
        "engine_fit": engine_fit,
        "padded_tokens_range": [int(tok.min()), int(tok.max())]}
    Profile.model_validate(prof)
    return prof


def _trainer_rate(sharing: dict, mode: np.ndarray, alone: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each train step's rate (work seconds per second): alone and co-running, weighted by its time
    spent each way, at the sharing mode it ran under."""
    r_alone = np.where(mode == "mps", sharing["mps_alone"]["trainer"], 1.0)
    r_corun = np.where(mode == "mps", sharing["mps_corun"]["trainer"], sharing["none_corun"]["trainer"])
    alone_frac = np.where(y > 0, alone / y, 1.0)
    return alone_frac * r_alone + (1 - alone_frac) * r_corun


def _scaled_train_terms(prof, y, mb, tok, ad, rg, mode, alone) -> tuple:
    """The base's train terms times the one factor that best fits the steps (relative least
    squares: min sum((k * predicted / measured - 1)^2)), and that factor."""
    t = prof["train"]
    base = (t["per_microbatch"]["a_s"], t["per_microbatch"]["b_s_per_unit"], t["s_per_adapter"],
            t.get("s_per_regroup_token", 0.0))
    pred = (base[0] * mb + base[1] * tok + base[2] * ad + base[3] * rg) / _trainer_rate(prof["sharing"], mode, alone, y)
    ratio = pred[y > 0] / y[y > 0]
    k = float(ratio.sum() / (ratio ** 2).sum())
    return (*(k * v for v in base), k)


TRAIN_TERMS = ("a", "b", "c", "d")  # per micro-batch, per padded token, per adapter, per extra token


def _mps_settings(mps_runs: list[tuple[str, dict, bool]]) -> dict[tuple, list[str]]:
    """The MPS runs grouped by their MPS settings (sorted items -> runs). A run that never co-runs
    (shared-sync) leaves the trainer's priority open: it joins the settings of the co-running runs
    that agree with it on the rest (the defaults' priority when none co-runs)."""
    corun = {tuple(sorted(m.items())) for _, m, c in mps_runs if c}
    groups: dict[tuple, list[str]] = {}
    for rd, mine, co in mps_runs:
        key = tuple(sorted(mine.items()))
        if not co:
            fits = [k for k in corun if {n: v for n, v in k if n != "trainer_priority"} == mine]
            key = fits[0] if len(fits) == 1 else key
        groups.setdefault(key, []).append(rd)
    return groups


def _solve_train(sharing: dict, y, feats: dict, terms: tuple, fixed: np.ndarray, mode, alone,
                 corun) -> tuple[dict, dict]:
    """The ``terms`` (names of ``feats`` columns) and the trainer's unknown sharing rates fitted on
    the steps (relative, non-negative least squares); ``fixed``: work each step has outside
    the fitted terms (the base's per-adapter cost, when the runs cannot fit it). A rate the fit
    pins at 0 (no rate at all) is the base's instead, as the engine's are. Returns every term's
    weight (0 for one not fitted) and the rates fitted; ``sharing`` is not changed."""
    from_base: set[str] = set()
    while True:
        cols, names = [feats[t] for t in terms], list(terms)
        # Work (seconds alone, no MPS) = rate_alone * alone_s + rate_corun * corun_s, per sharing
        # mode. Known rates move to the right-hand side; unknown ones become columns with -time.
        rhs, anchor = -fixed, np.zeros(len(y))
        rate_cols: list[str] = []
        for m, alone_key, corun_key in SHARING_MODES:
            on = mode == m
            if not on.any():
                continue
            for key, t in ((alone_key, alone), (corun_key, corun)):
                t_m = np.where(on, t, 0.0)
                if key is None:  # alone without MPS: the work itself
                    anchor = anchor + t_m
                elif t_m.sum() >= MIN_RATE_SHARE * y[on].sum() and f"{key}.trainer" not in from_base:
                    cols.append(-t_m)
                    names.append(f"{key}.trainer")
                    rate_cols.append(f"{key}.trainer")
                else:
                    rhs = rhs + sharing[key]["trainer"] * t_m
        if not (anchor > 0).any():
            raise ConfigError("nodus fit: every fitted train step ran beside the engine or under MPS; "
                              "a run with the trainer alone without MPS (a dedicated arm) pins the cost model")
        w = dict(zip(names, nonneg_rel_lstsq(np.stack(cols, 1), rhs + anchor, scale=y)))
        zero = {k for k in rate_cols if w[k] <= 0}
        if not zero:
            break
        from_base |= zero
    return {t: float(w.get(t, 0.0)) for t in TRAIN_TERMS}, {k: float(w[k]) for k in rate_cols}


TERM_SELECTIONS = ("runs", "extrapolate")  # how the train terms are chosen (_select_train_terms)


def _rank(X: np.ndarray) -> int:
    """Column rank of ``X`` with each column scaled to its largest magnitude (features of seconds,
    tokens and counts differ by orders of magnitude); a zero column adds nothing."""
    peak = np.abs(X).max(0)
    return int(np.linalg.matrix_rank(X[:, peak > 0] / peak[peak > 0])) if (peak > 0).any() else 0


def _select_train_terms(sharing, y, feats, optional, fixed, mode, alone, corun, run,
                        scheme: str = "runs") -> tuple[tuple, dict]:
    """Which of the ``optional`` train terms the runs support: every subset holding a or b, scored
    by cross-validation, the others 0. In runs of 1-4 identical jobs the adapters, micro-batches
    and tokens of a step grow together, so a fit of every term can put a cost on the wrong one,
    which then extrapolates wrongly to 8 or 16 jobs.

    ``scheme`` "runs" (the default): leave one run out (fitted on the other runs, scored on the
    left-out run's steps, averaged over runs). That scores how a subset interpolates among the
    fit's own sizes. "extrapolate" scores it the way the profile is used instead: fitted on
    the steps of fewer adapters than a size and scored on the steps of that size (the mean relative
    error of those steps, averaged over the sizes). Only the sizes whose smaller steps tell every
    optional term apart (full column rank) are folds, and every subset is scored on those same
    folds: a dedicated run's 1-adapter steps alone cannot tell a per-adapter cost from a fixed one,
    so with steps of 1, 2 and 4 adapters the one fold predicts the 4-adapter steps from the rest.
    Where no size makes a fold it leaves one run out. On the H200's five one-day protocols
    (sessions 21-25, ``experiments/protocol_days.sh``; session 24's runs with plain rows) the held-out
    8- and 16-job runs came out at 6.9 / 2.2 / 11.2 / 3.5 / 22.2% per run with "extrapolate" against
    6.5 / 2.2 / 11.2 / 5.7 / 14.6% with "runs": better on the day it was built on, worse on its first
    day out of sample (session 25) and slightly on one other, so it is not the default.

    The sharing rates are those of the fit of every term on every run (a step's work is its seconds
    at them): a fold without some run may not pin a rate. Ties go to fewer terms. Returns the chosen
    terms and a record: the scheme used, its folds, each subset's score (``cv_mape``; None when
    leaving one run out has fewer than two runs, and every optional term is kept) and the choice."""
    if scheme not in TERM_SELECTIONS:
        raise ConfigError(f"nodus fit: term selection {scheme!r}: choose one of {', '.join(TERM_SELECTIONS)}")
    folds: list[tuple[np.ndarray, np.ndarray]] = []
    if scheme == "extrapolate":
        size = feats["c"]
        every = np.stack([feats[t] for t in optional], 1)
        folds = [(size < s, size == s) for s in sorted(set(size.tolist()))[1:]]
        folds = [(train, test) for train, test in folds if _rank(every[train]) == len(optional)]
        if not folds:
            scheme = "runs"  # no smaller steps pin every term: nothing to extrapolate from
    runs = sorted(set(run))
    if scheme == "runs":
        folds = [(run != r, run == r) for r in runs]
        if len(folds) < 2:
            return tuple(optional), {"scheme": scheme, "folds": len(folds), "cv_mape": None,
                                     "chosen": "+".join(optional)}
    _, fitted = _solve_train(sharing, y, feats, tuple(optional), fixed, mode, alone, corun)
    sh = {k: dict(v) if isinstance(v, dict) else v for k, v in sharing.items()}
    for key, v in fitted.items():
        sh[key.split(".")[0]]["trainer"] = v
    work = y * _trainer_rate(sh, mode, alone, y) - fixed  # each step's work in the terms
    subsets = [c for k in range(1, len(optional) + 1) for c in itertools.combinations(optional, k)
               if "a" in c or "b" in c]
    cv = {}
    for c in subsets:
        X = np.stack([feats[t] for t in c], 1)
        errs = []
        for train, test in folds:
            w = nonneg_rel_lstsq(X[train], work[train], scale=y[train])
            errs.append(float(np.mean(np.abs(X[test] @ w - work[test]) / (work[test] + fixed[test]))))
        cv["+".join(c)] = float(np.mean(errs))
    best = min(subsets, key=lambda c: (round(cv["+".join(c)], 6), len(c)))
    return best, {"scheme": scheme, "folds": len(folds), "cv_mape": cv, "chosen": "+".join(best)}


def _fitted_train_terms(prof, y, mb, tok, ad, rg, mode, alone, corun, rates, run=None,
                        scheme: str = "runs") -> tuple:
    """The train terms (a per micro-batch, b per padded token, c per adapter, d per regrouped
    token) and the trainer's unknown sharing rates fitted on the steps; the rates fitted are set in
    ``prof["sharing"]`` and ``rates``. ``run``: each step's run, for the choice of terms
    (``_select_train_terms``; without it every term the runs vary is fitted). Returns a, b, c, d,
    the fitted columns' names, their values, where c came from and the term selection's record."""
    base_c = prof["train"]["s_per_adapter"]
    feats = {"a": mb, "b": tok, "c": ad, "d": rg}
    # A coefficient is fitted only where the runs vary its feature apart from the others: one
    # adapter count everywhere leaves c to the base profile, no regrouping leaves d at 0.
    optional = ["a", "b"]
    if len(set(ad)) > 1:
        optional.append("c")
    if rg.max() > 0:
        optional.append("d")
    fixed = np.zeros(len(y)) if "c" in optional else base_c * ad
    sharing = prof["sharing"]
    selection = None
    terms = tuple(optional)
    if run is not None:
        terms, selection = _select_train_terms(sharing, y, feats, tuple(optional), fixed, mode, alone, corun,
                                               np.asarray(run), scheme)
    w, fitted = _solve_train(sharing, y, feats, terms, fixed, mode, alone, corun)
    for key, v in fitted.items():
        rates[key] = v
        sharing[key.split(".")[0]]["trainer"] = v
    a, b, d = w["a"], w["b"], w["d"]
    if "c" not in optional:
        c, c_source = base_c, "base profile (one adapter count in the fitted runs)"
    elif "c" in terms:
        c, c_source = w["c"], "fitted"
    else:
        c, c_source = 0.0, "0: left out, it did not predict the steps left out of the fit (cross-validation)"
    names = list(terms) + list(fitted)
    return a, b, c, d, names, {**w, **fitted}, c_source, selection


def _publish_fit(publish: list[dict], pub: dict) -> dict:
    """Sets ``pub`` (the profile's publish section) from the runs' publishes: its cost from those
    alone, its co-run factor from those beside a train step (kept from the base without both
    kinds); returns the counts, medians and what was fitted (None: kept).

    The cost: seconds = save_s_per_publish + save_s_per_adapter * adapters, non-negative least
    squares with each run weighing the same (a dedicated run's 40 one-adapter publishes would
    otherwise outvote a shared run's 5), each publish's error relative to its run's mean publish:
    within a run the fit then prices the mean, which steps per GPU-hour sees (a publish's error
    relative to itself, or the median, priced session 52's H100 publishes, half at 0.03 s and half
    near 0.09 s, at 0.033 s against a mean of 0.052). A publish's fixed part (the round trip to the
    engine, the sync) does not grow with its adapters, so a per-adapter price alone, fitted on
    one-adapter publishes, overcharges a 16-adapter one. Publishes of one size cannot split the two:
    the base's split is kept, both parts times one factor (the runs' measured seconds over the
    base's, each run weighing the same). The co-run factor: the publishes beside a train step, their
    seconds over the fitted cost of their size, the same way (under 1 is noise: the simulator's
    factor slows, never speeds)."""
    publish = [p for p in publish if p["s"] > 0]  # a zero-length span says nothing of the cost
    alone = [p for p in publish if not p["beside_train"]]
    beside = [p for p in publish if p["beside_train"]]
    med = (lambda v: float(np.median(v)) if v else None)  # noqa: E731
    med_alone = med([p["s_per_adapter"] for p in alone])
    med_beside = med([p["s_per_adapter"] for p in beside])
    fixed0, save0 = pub.get("save_s_per_publish", 0.0), pub["save_s_per_adapter"]
    if fixed0 <= 0 and save0 <= 0:  # a base that charges nothing: a price per adapter
        fixed0, save0 = 0.0, 1.0
    cost = (lambda ps, f, a: np.array([f + a * p["adapters"] for p in ps]))  # noqa: E731

    def per_run(ps: list[dict]) -> np.ndarray:  # 1 / the publish's run's count: each run weighs 1
        runs = [p.get("run", "") for p in ps]
        return np.array([1.0 / runs.count(r) for r in runs])

    def over(ps: list[dict], f: float, a: float) -> float:  # measured seconds over priced, runs alike
        w = per_run(ps)
        return float((w * np.array([p["s"] for p in ps])).sum() / (w * cost(ps, f, a)).sum())

    save, fixed, ratio, factor = None, None, None, None
    if alone:
        n = np.array([p["adapters"] for p in alone], dtype=float)
        y = np.array([p["s"] for p in alone])
        runs = [p.get("run", "") for p in alone]
        run_mean = {r: float(np.mean([p["s"] for p in alone if p.get("run", "") == r])) for r in set(runs)}
        # Squared: each run's errors over its mean publish, 1/count per run.
        scale = np.array([run_mean[r] for r in runs]) / np.sqrt(per_run(alone))
        if len(set(n)) > 1:
            fixed, save = (float(v) for v in nonneg_rel_lstsq(np.stack([np.ones(len(n)), n], 1), y, scale=scale))
        else:  # one size: the base's split, scaled
            k = over(alone, fixed0, save0)
            fixed, save = fixed0 * k, save0 * k
        if beside and save + fixed > 0:
            ratio = over(beside, fixed, save)
            factor = max(ratio, 1.0)
            pub["corun_factor"] = factor
    elif beside:
        # No publish alone to tell the two apart: the base's factor and split, scaled to these.
        k = over(beside, fixed0, save0)
        k /= pub.get("corun_factor", 1.0)
        fixed, save = fixed0 * k, save0 * k
    if save is not None:
        pub["save_s_per_adapter"] = save
        pub["save_s_per_publish"] = fixed
    return {"alone": len(alone), "beside_train": len(beside), "alone_s_per_adapter": med_alone,
            "beside_train_s_per_adapter": med_beside, "beside_over_alone": ratio,
            "save_s_per_adapter": save, "save_s_per_publish": fixed, "corun_factor": factor}


class _AloneEngine:
    """A profile validated once for ``_alone_generation_s`` at many (scale, floor) pairs: the joint
    fit of ``decode.scale`` and ``decode.step_floor_s`` replays each lone generation tens of times."""

    def __init__(self, prof: dict):
        from sim.profile import Profile

        self.model = Profile.model_validate(prof)

    def seconds(self, gen: dict, scale: float, floor: float | None = None) -> float:
        upd = {"scale": scale} if floor is None else {"scale": scale, "step_floor_s": floor}
        model = self.model.model_copy(update={"decode": self.model.decode.model_copy(update=upd)})
        return _alone_generation_s(None, gen, scale, model=model)


def _alone_generation_s(prof: dict | None, gen: dict, scale: float, model=None) -> float:
    """Seconds the simulator's engine is busy on one generation episode alone on the GPU (no MPS):
    ``gen`` (a ``generate_samples`` episode) has its ``requests`` (every job's prompts, prompt tokens
    each and response lengths) submitted to an idle engine, each action's ``offset_s`` after the
    first (0 when not given), with the run's ``max_num_seqs``, ``max_loras`` and
    ``graph_max_tokens``, every decode step at ``scale`` times the profile's curves, and the run's
    audit (``audit``: the sequences not returning logprobs priced less, where the profile prices it,
    ``decode.logprob_s_per_seq``), each step at least the profile's ``decode.step_floor_s``. An idle
    gap between actions (the alone engine done before the next one came) is not counted: the work is
    the union of the actions' submit-to-done intervals. ``model``: the validated profile to use as it
    is (``_AloneEngine``), instead of ``prof`` at ``scale``."""
    import simpy

    from nodus.config import AuditSpec
    from sim.engine import SimEngine
    from sim.gpu import SharedGPU
    from sim.profile import CostModel, Profile

    if model is None:
        model = Profile.model_validate(dict(prof, decode=dict(prof["decode"], scale=scale)))
    env = simpy.Environment()
    done: dict[str, float] = {}
    eng = SimEngine(env, SharedGPU(env, "none", model.sharing), CostModel(model, "nodus fit"),
                    max_num_seqs=gen["max_num_seqs"], max_loras=gen["max_loras"],
                    graph_max_tokens=gen["graph_max_tokens"],
                    on_done=lambda action: done.__setitem__(action.action_id, env.now),
                    audit=AuditSpec(**gen["audit"]) if gen.get("audit") else None)
    actions: dict[int, list[dict]] = {}
    for r in gen["requests"]:
        # Version 1 of each job's adapter: the engine loads it before the job's first request, as a
        # run's step does (a job in two actions of one merged episode loads it once).
        eng.publish(r["job"], 1)
        actions.setdefault(r.get("action", 0), []).append(r)
    offsets = {i: min(r.get("offset_s", 0.0) for r in rs) for i, rs in actions.items()}

    def submit():  # after the engine's loop went idle, as between a run's steps (a cold prefill)
        yield env.timeout(0)
        for i in sorted(actions, key=lambda i: offsets[i]):
            if offsets[i] > env.now:
                yield env.timeout(offsets[i] - env.now)
            eng.submit(f"gen{i}", [(r["job"], gen.get("step") or 0, 1, r["prompts"], r["prompt_tokens_each"],
                                    list(r["lengths"]))
                                   for r in actions[i]])
    env.process(submit())
    env.run()
    return union_length([(offsets[i], done[f"gen{i}"]) for i in actions])


def _complete(g: dict) -> bool:
    """Whether a generation recorded every request's lengths and prompt tokens (the work needs them)."""
    return all(r["lengths"] and r["prompt_tokens_each"] for r in g["requests"])


# A generation is "lone" (the engine alone on the GPU, as a dedicated run's) where a train step
# overlapped at most this share of it: a shared-sync run's, or an offset run's first.
LONE_CORUN_SHARE = 0.01


def _lone_generations(gens: list[dict]) -> list[dict]:
    """The complete generations that ran with the engine alone on the GPU and no MPS."""
    return [g for g in gens if g["sharing"] == "none" and _complete(g) and g["corun_s"] <= LONE_CORUN_SHARE * g["s"]]


def _sequences(g: dict) -> int:
    return sum(len(r["lengths"]) for r in g["requests"])


def _scale_at(engine: _AloneEngine, rows: list[dict], weights: np.ndarray, floor: float, s0: float,
              tol: float = 1e-4) -> tuple[float, np.ndarray] | None:
    """The decode.scale at which the rows' weighted relative error sums to 0 with the per-step
    floor ``floor`` (the error grows with the scale: a bracket from ``s0``, then false position),
    and the rows' predicted seconds at it; ``s0`` itself where it is such a scale (also when the
    rows' steps all sit on the floor there, so no scale is told); None where no scale in
    [s0/2^12, s0*2^12] gets there (a floor so high that the rows are priced long with every step at it)."""
    y = np.array([g["s"] for g in rows])

    def bias(scale: float) -> tuple[float, np.ndarray]:
        pred = np.array([engine.seconds(g, scale, floor) for g in rows])
        return float(np.sum(weights * (pred / y - 1))), pred

    b0, p0 = bias(s0)
    if abs(b0) < tol:  # also where every step sits on the floor around s0: the scale is not told, s0 kept
        return s0, p0
    lo, hi = s0 / 1.25, s0 * 1.25
    (b_lo, p_lo), (b_hi, p_hi) = bias(lo), bias(hi)
    for _ in range(12):  # move the bracket until it holds the root
        if abs(b_lo) < tol or abs(b_hi) < tol:
            return (lo, p_lo) if abs(b_lo) < abs(b_hi) else (hi, p_hi)
        if b_lo <= 0 <= b_hi:
            break
        if b_lo > 0:
            lo, hi, b_hi, p_hi = lo / 2, lo, b_lo, p_lo
            b_lo, p_lo = bias(lo)
        else:
            lo, hi, b_lo, p_lo = hi, hi * 2, b_hi, p_hi
            b_hi, p_hi = bias(hi)
    if not b_lo <= 0 <= b_hi:
        return None
    for _ in range(40):  # Illinois false position
        if abs(b_lo) < tol:
            return lo, p_lo
        if abs(b_hi) < tol or hi - lo < tol * hi:
            return hi, p_hi
        m = hi - b_hi * (hi - lo) / (b_hi - b_lo)
        b_m, p_m = bias(m)
        if b_m < 0:
            lo, b_lo, p_lo = m, b_m, p_m
            b_hi /= 2
        else:
            hi, b_hi, p_hi = m, b_m, p_m
            b_lo /= 2
    return (lo, p_lo) if abs(b_lo) < abs(b_hi) else (hi, p_hi)


def _decode_scale(gens: list[dict], prof: dict) -> dict | None:
    """decode.scale from the dedicated runs' generations (one job alone, no MPS): seconds =
    fixed (prefill, adapter load) + scale * decode, the scale that gives the generations' total
    seconds (their sum over the sum of the simulated ones): steps per GPU-hour sees that total. A
    relative-error fit weighs a short generation as a long one and, where long generations run
    slower per step (session 52's H100: -2% per generation came out -4.8% on the total), prices the
    total short. A base with a per-step floor (``decode.step_floor_s``, kept) has its scale solved
    with the floor in place. Sets it in ``prof`` and returns the fit's summary, with the total's error
    before and after; None (scale kept) without such generations."""
    rows = [g for g in gens if g["dedicated"] and g["sharing"] == "none" and _complete(g)]
    if len(rows) < 3:
        return None
    y_a = np.array([g["s"] for g in rows])
    base_scale = prof["decode"].get("scale", 1.0)
    floor = prof["decode"].get("step_floor_s") or 0.0
    if floor > 0:
        engine = _AloneEngine(prof)
        plain = np.array([engine.seconds(g, 1.0) for g in rows])
        at_base_s = np.array([engine.seconds(g, base_scale) for g in rows])
        solved = _scale_at(engine, rows, y_a / y_a.sum(), floor, base_scale)
        if solved is None:
            raise ConfigError(f"nodus fit: the dedicated generations run faster than the base's step floor "
                              f"(decode.step_floor_s {floor * 1e3:.2f} ms) allows at any decode.scale: fit the "
                              "floor on this host's runs (nodus fit --step-floor)")
        scale, after_s = solved
    else:
        fixed, dec = [], []
        for g in rows:
            t1 = _alone_generation_s(prof, g, 1.0)
            t2 = _alone_generation_s(prof, g, 2.0)
            dec.append(t2 - t1)
            fixed.append(t1 - (t2 - t1))
        fixed_a, dec_a = np.array(fixed), np.array(dec)
        scale = float((y_a - fixed_a).sum() / dec_a.sum()) if dec_a.sum() > 0 else 0.0
        scale = scale if scale > 0 else base_scale
        plain, at_base_s, after_s = fixed_a + dec_a, fixed_a + base_scale * dec_a, fixed_a + scale * dec_a
    before = plain / y_a - 1  # the curves unscaled (decode.scale 1)
    at_base = at_base_s / y_a - 1  # the base's scale
    after = after_s / y_a - 1
    prof["decode"]["scale"] = scale
    return {"scale": scale, "generations": len(rows), "base_scale": base_scale, "step_floor_s": floor,
            "mape_before": float(np.mean(np.abs(before))), "mape_after": float(np.mean(np.abs(after))),
            "bias_before": float(np.mean(before)), "bias_after": float(np.mean(after)),
            "mape_base": float(np.mean(np.abs(at_base))), "bias_base": float(np.mean(at_base)),
            "total_before": float(plain.sum() / y_a.sum() - 1),
            "total_after": float(after_s.sum() / y_a.sum() - 1)}


FLOOR_GRID = 16  # step floors tried from 0 to the lone generations' slowest mean step, then refined around the best
FLOOR_TOL_S = 2e-6  # to this many seconds


def _decode_scale_floor(gens: list[dict], prof: dict) -> dict:
    """decode.scale and the per-step host floor ``decode.step_floor_s`` together, from the lone
    generations (the engine alone, no MPS: dedicated runs', shared-sync runs', an offset run's
    first) of at least two batch sizes: a step costs max(curves x scale, floor), so a batch whose
    GPU step is under the host's work pays the floor and a larger one the curves. One scale alone,
    fitted on a small batch's host-bound steps, prices a large batch long by the ratio of the
    curves (session 70's H100: 256-sequence generations +27%).

    Each batch size (sequences in the generation) weighs the same; for each floor on a grid the
    scale is the one of zero weighted bias, and the floor kept is the one of least weighted squared
    relative error. Sets both in ``prof``; returns the fit's summary with each size's error at the
    base's (scale, floor) and at the fitted ones. Raises ConfigError where the generations do not
    tell a floor from a scale (one batch size, or sizes within 2x of each other)."""
    rows = _lone_generations(gens)
    sizes: dict[int, list[dict]] = {}
    for g in rows:
        sizes.setdefault(_sequences(g), []).append(g)
    sizes = {n: v for n, v in sizes.items() if len(v) >= 2}
    if len(sizes) < 2 or max(sizes) < 2 * min(sizes):
        raise ConfigError("nodus fit --step-floor: the floor and the scale are told apart by lone generations (the "
                          "engine alone, no MPS: dedicated or shared-sync runs) of batch sizes at least 2x apart, "
                          "two or more of each; these runs have "
                          + (", ".join(f"{len(v)} of {n} sequences" for n, v in sorted(sizes.items())) or "none"))
    rows = [g for n in sorted(sizes) for g in sizes[n]]
    w = np.array([1.0 / (len(sizes) * len(sizes[_sequences(g)])) for g in rows])
    y = np.array([g["s"] for g in rows])
    engine = _AloneEngine(prof)
    base_scale = prof["decode"].get("scale", 1.0)
    base_floor = prof["decode"].get("step_floor_s") or 0.0
    base_pred = np.array([engine.seconds(g, base_scale, base_floor) for g in rows])
    # No step is slower than its generation's seconds over its longest response.
    top = max(g["s"] / max(max(r["lengths"]) for r in g["requests"]) for g in rows)
    tried: dict[float, tuple[float, float, np.ndarray]] = {}

    def trial(floor: float) -> float:
        if floor not in tried:
            near = [f for f in tried if tried[f][2] is not None]
            solved = _scale_at(engine, rows, w, floor,
                               tried[min(near, key=lambda f: abs(f - floor))][1] if near else base_scale)
            tried[floor] = ((math.inf, math.nan, None) if solved is None
                            else (float(np.sum(w * (solved[1] / y - 1) ** 2)), solved[0], solved[1]))
        return tried[floor][0]

    grid = np.linspace(0.0, top, FLOOR_GRID + 1)
    for f in grid:
        trial(float(f))
    step = grid[1] - grid[0]
    best = min(tried, key=trial)
    # Golden section within the grid's neighbours of the best (the error is smooth in the floor there).
    a, b = max(best - step, 0.0), best + step
    phi = (math.sqrt(5) - 1) / 2
    c, d = b - phi * (b - a), a + phi * (b - a)
    while b - a > FLOOR_TOL_S:
        if trial(c) < trial(d):
            b, d = d, c
            c = b - phi * (b - a)
        else:
            a, c = c, d
            d = a + phi * (b - a)
    floor = min(tried, key=trial)
    _, scale, pred = tried[floor]
    prof["decode"]["scale"] = scale
    prof["decode"]["step_floor_s"] = floor

    def err(p: np.ndarray, sel: np.ndarray) -> dict:
        e = p[sel] / y[sel] - 1
        return {"mape": float(np.mean(np.abs(e))), "bias": float(np.mean(e))}

    by_size = []
    for n, v in sorted(sizes.items()):
        sel = np.array([_sequences(g) == n for g in rows])
        by_size.append({"sequences": n, "generations": len(v), "adapters": sorted({len(g["requests"]) for g in v}),
                        "dedicated": sum(g["dedicated"] for g in v), "measured_s": float(y[sel].mean()),
                        "base": err(base_pred, sel), "fitted": err(pred, sel)})
    e_base, e_fit = base_pred / y - 1, pred / y - 1
    return {"scale": scale, "step_floor_s": floor, "generations": len(rows), "base_scale": base_scale,
            "base_step_floor_s": base_floor, "sizes": by_size,
            "floors_tried": [[f, tried[f][1], tried[f][0]] for f in sorted(tried) if tried[f][2] is not None],
            "mape_base": float(np.average(np.abs(e_base), weights=w)),
            "bias_base": float(np.average(e_base, weights=w)),
            "mape_after": float(np.average(np.abs(e_fit), weights=w)),
            "bias_after": float(np.average(e_fit, weights=w))}


def _engine_rates(gens: list[dict], prof: dict) -> tuple[dict[str, float], dict]:
    """The engine's sharing rates from the fitted runs' generate actions, as the trainer's: per
    sharing mode, work = rate_alone * alone_s + rate_corun * corun_s, with the work the
    simulator's alone time (no MPS) of exactly the action's requests at the profile's (fitted)
    decode scale. Without MPS the alone rate is 1; a rate whose time is under ``MIN_RATE_SHARE``
    of its mode's generation time is kept from the base. Dedicated runs without MPS (the alone,
    no-MPS case: they pin the decode scale) are left out. Sets the rates in ``prof["sharing"]``;
    returns them by key and the fit's summary per mode."""
    sharing = prof["sharing"]
    rows = [g for g in gens if _complete(g) and not (g["dedicated"] and g["sharing"] == "none")]
    scale = prof["decode"].get("scale", 1.0)
    rates: dict[str, float] = {}
    summary: dict[str, dict] = {}
    for mode, alone_key, corun_key in SHARING_MODES:
        sel = [g for g in rows if g["sharing"] == mode]
        if not sel:
            continue
        work = np.array([_alone_generation_s(prof, g, scale) for g in sel])
        y = np.array([g["s"] for g in sel])
        t_alone = np.array([g["alone_s"] for g in sel])
        t_corun = np.array([g["corun_s"] for g in sel])
        total = float(y.sum())

        def rate(key: str | None) -> float:
            return 1.0 if key is None else sharing[key]["engine"]

        before = (rate(alone_key), rate(corun_key))
        cols, names, rhs = [], [], work.copy()
        for key, t in ((alone_key, t_alone), (corun_key, t_corun)):
            if key is not None and t.sum() >= MIN_RATE_SHARE * total:
                cols.append(t)
                names.append(key)
            else:  # alone without MPS (the work itself), or too little time to tell: the base's
                rhs = rhs - rate(key) * t
        fitted = dict(zip(names, map(float, nonneg_rel_lstsq(np.stack(cols, 1), rhs, scale=work)))) if cols else {}
        fitted = {k: v for k, v in fitted.items() if v > 0}  # pinned at 0 by the fit: no rate, the base's
        for key, v in fitted.items():
            sharing[key]["engine"] = v
            rates[f"{key}.engine"] = v
        after = (rate(alone_key), rate(corun_key))

        def err(r: tuple[float, float]) -> np.ndarray:  # predicted seconds at the rates over measured, - 1
            return work / (r[0] * t_alone + r[1] * t_corun) - 1

        e0, e1 = err(before), err(after)
        summary[mode] = {"generations": len(sel), "jobs_per_generation": sorted({len(g["requests"]) for g in sel}),
                         "corun_share": float(t_corun.sum() / total),
                         "rates": {f"{k}.engine": rate(k) for k in (alone_key, corun_key) if k},
                         "fitted": sorted(f"{k}.engine" for k in fitted),
                         "mape_before": float(np.mean(np.abs(e0))), "mape_after": float(np.mean(np.abs(e1))),
                         "bias_before": float(np.mean(e0)), "bias_after": float(np.mean(e1))}
    return rates, summary


def _drop_refitted_batch_rates(sharing: dict, rates: dict[str, float]) -> list[str]:
    """A co-run mode whose rates the runs refitted (constants) no longer takes them by engine batch
    from the base: the simulator would prefer the table and ignore the fit. Returns those modes."""
    modes = sorted({k.split(".")[0] for k in rates if k.split(".")[0] in ("none_corun", "mps_corun")})
    table = sharing.get("corun_by_engine_batch") or []
    dropped = [m for m in modes if any(e.get(m) for e in table)]
    kept = []
    for e in table:
        e = {k: v for k, v in e.items() if k not in modes}
        if any(e.get(m) for m in ("none_corun", "mps_corun")):
            kept.append(e)
    if table:
        sharing["corun_by_engine_batch"] = kept
    return dropped


# How the assumption ``host-day`` names a later refit of the engine's scale on another day's runs.
DECODE_SCALE_DAY = "; the engine's scale (decode.scale) refitted since on "


def fit_decode_scale(runs: list[str | Path], base: str) -> dict:
    """A copy of ``base`` with ``decode.scale`` alone refitted on dedicated runs' generations (one
    job alone, no MPS: ``_decode_scale``); every other term and rate kept.

    For a profile whose engine scale was fitted on runs of another engine setting than the ones it
    is now used for: the stacks profiles' came from session 16's dedicated runs (vLLM's default
    CUDA-graph sizes, the trainer on torch's own threads) and priced today's dedicated runs (512-token
    graphs, 2 trainer threads) 10-19% slow, so a plan's ratio over dedicated came out high. The rates
    that were fitted at the old scale (``nodus fit-stacks``'s two-engine and lone-trainer rates) move
    with it: fit them again on the new profile. Refused: a run that is not dedicated without MPS, ran
    its engine core in a process of its own or other LoRA kernels than the base's, or a cheaper audit
    on a base that does not price it (``sim.profile.audit_priced``; on one that does, each generation
    is replayed with its run's audit)."""
    from sim.profile import add_source, audit_priced, profile_dict, profile_lora_kernels, set_assumption
    from calibration.run_settings import run_controls

    prof = profile_dict(base)
    base_kernels = profile_lora_kernels(prof)
    gens, used, hosts = [], [], []
    for rd in map(Path, runs):
        recorded = load_recorded(rd)
        cfg, summary, _ = recorded
        arm = cfg["arm"]
        if arm.get("policy") != "dedicated" or arm.get("sharing", "none") != "none" or stacks_of(arm) > 1:
            raise ConfigError(f"nodus fit --decode-scale-only: {rd} is a {arm.get('policy')} run under "
                              f"{arm.get('sharing')} sharing; decode.scale is fitted on dedicated runs without MPS "
                              "(one job alone on the engine)")
        controls = run_controls(summary)
        _refuse_other_engine(rd, controls, "nodus fit --decode-scale-only", audit_priced(prof))
        kernels = controls.get("lora_kernels", "default")
        if kernels != base_kernels:
            raise ConfigError(f"nodus fit --decode-scale-only: {rd}'s engine ran {kernels} LoRA kernel configs, the "
                              f"base's engine the {base_kernels} ones: fit runs of the base's engine")
        gens += [dict(g, dedicated=True) for g in generate_samples(rd, recorded)]
        used.append(str(rd))
        _add_hosts(hosts, summary)
    if not used:
        raise ConfigError("nodus fit --decode-scale-only: no runs given")
    fitted = _decode_scale(gens, prof)
    if fitted is None:
        raise ConfigError(f"nodus fit --decode-scale-only: {len(gens)} complete generation(s) in {len(used)} run(s); "
                          "need >= 3")
    prof.setdefault("measurements", {})["decode_scale_fit"] = dict(fitted, runs=used, hosts=hosts)
    carried = next((x for x in prof.get("assumptions", []) if x["id"] == "engine-curves-from-base"), None)
    if carried:  # its text names the scale: the new one
        set_assumption(prof, _engine_curves_assumption(base_kernels, carried["value"], fitted["scale"], True))
    day = next((x for x in prof.get("assumptions", []) if x["id"] == "host-day"), None)
    if day:  # the base's day describes its other terms; the engine's scale is now these runs' day
        what = day["what"].split(DECODE_SCALE_DAY)[0]
        set_assumption(prof, dict(day, what=f"{what}{DECODE_SCALE_DAY}{len(used)} dedicated run(s) of "
                                            f"{datetime.date.today().isoformat()} (nodus fit --decode-scale-only)"))
    add_source(prof, f"nodus fit --decode-scale-only on {len(used)} run(s): decode.scale {fitted['base_scale']:.3f} "
                     f"-> {fitted['scale']:.3f}")
    return prof


def fit_to_file(runs: list[str | Path], base: str, out: str | Path, fit_max_jobs: int = 4,
                trainer_mode: str | None = None, lora_kernels: str | None = None,
                graphless_from: str | Path | None = None, graph_max_tokens: int | None = None,
                scales_only: bool = False, term_selection: str = "runs", step_floor: bool = False) -> dict:
    from sim.profile import refuse_existing, write_profile

    refuse_existing(out, "nodus fit")
    prof = fit(runs, base, fit_max_jobs, trainer_mode, lora_kernels, graphless_from, graph_max_tokens, scales_only,
               term_selection, step_floor)
    write_profile(prof, out, "nodus fit")
    return prof
