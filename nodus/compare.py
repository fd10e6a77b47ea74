"""Compare run folders arm against baseline: throughput ratios, paired learning CIs, A/A spread, gate.

A run folder holds `summary.json` (written by a backend): policy, sharing, groups, seed,
steps_per_gpu_hour and per_job {job_id: {task, seed, rewards: [per-step mean reward],
eval: {accuracy, correct: [0/1 per eval item, in eval-set order]}}}. Runs group into arms by
(policy, sharing, groups). Within an arm the first run of a seed (in the order given) is the one
compared; a second run of the same arm and seed is its A/A repeat and only measures noise: its
throughput against the first run's (the A/A spread) and its learning against the first run's
(`aa_learning`, the same paired CIs; the learning noise floor when the repeat differs in batching).

Pairing, always within one seed: eval correctness per (job, eval item), arm minus baseline;
training reward per job, the mean over the steps both runs have. The accuracy CI resamples whole
(job, seed) clusters when there are at least MIN_CLUSTERS of them (items answered by one adapter
are correlated), otherwise single items; the report says which. The reward CI resamples
(job, seed) pairs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nodus.config import packed_rows, stacks_of
from nodus.stats import aa_spread, gate_verdict, paired_bootstrap_ci

MIN_CLUSTERS = 5  # fewer (job, seed) clusters give a cluster bootstrap too few distinct resamples
DEFAULT_BASELINE = "dedicated"


@dataclass(frozen=True)
class JobResult:
    """One job's learning outcome in one run."""

    task: str
    seed: int
    rewards: tuple[float, ...]  # per-step mean training reward, in step order
    accuracy: float  # eval accuracy as the backend reported it
    correct: tuple[int, ...]  # 0/1 per eval item, in eval-set order


@dataclass(frozen=True)
class RunSummary:
    """A run folder's summary.json, validated."""

    path: str  # the run folder, as given
    policy: str
    sharing: str
    groups: int
    seed: int
    steps_per_gpu_hour: float
    jobs: dict[str, JobResult]
    share_prompts: int = 0  # the run config's trainer.share_prompts
    stacks: int = 1  # the arm's engine + trainer stacks (arm.stacks)

    @property
    def arm(self) -> str:
        return arm_label(self.policy, self.sharing, self.groups, self.share_prompts, self.stacks)


def arm_label(policy: str, sharing: str, groups: int, share_prompts: int = 0, stacks: int = 1) -> str:
    """policy/sharing/groups, /kN on N engine + trainer stacks (arm.stacks), +spK where the trainer
    packed each prompt's responses K to a row (trainer.share_prompts): neither is a repeat of the
    same arm without it."""
    share = packed_rows(share_prompts)
    return (f"{policy}/{sharing}/g{groups}" + (f"/k{stacks}" if stacks > 1 else "")
            + (f"+sp{share}" if share else ""))


def _get(obj: object, key: str, kinds: type | tuple[type, ...], where: str, file: Path):
    """obj[key] checked against kinds; ValueError naming the file and the dotted field otherwise."""
    name = f"{where}.{key}" if where else key
    if not isinstance(obj, dict) or key not in obj:
        raise ValueError(f"{file}: missing field {name!r}")
    value = obj[key]
    numeric = kinds in (int, float) or kinds == (int, float)
    if not isinstance(value, kinds) or (numeric and isinstance(value, bool)):
        raise ValueError(f"{file}: field {name!r} has {type(value).__name__} {value!r}, "
                         f"expected {getattr(kinds, '__name__', kinds)}")
    return value


def _job(job_id: str, record: object, file: Path) -> JobResult:
    where = f"per_job.{job_id}"
    rewards = _get(record, "rewards", list, where, file)
    if not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in rewards):
        raise ValueError(f"{file}: field '{where}.rewards' must be a list of numbers")
    ev = _get(record, "eval", dict, where, file)
    correct = _get(ev, "correct", list, f"{where}.eval", file)
    if not all(c in (0, 1) for c in correct):
        raise ValueError(f"{file}: field '{where}.eval.correct' must be a list of 0/1")
    return JobResult(
        task=_get(record, "task", str, where, file),
        seed=_get(record, "seed", int, where, file),
        rewards=tuple(float(r) for r in rewards),
        accuracy=float(_get(ev, "accuracy", (int, float), f"{where}.eval", file)),
        correct=tuple(int(c) for c in correct),
    )


def load_run(path: str | Path, learning: bool = True) -> RunSummary:
    """A run folder's validated summary; FileNotFoundError or ValueError naming the path.
    ``learning=False``: throughput only (an A/A repeat's), its jobs' rewards and eval not read."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"run dir not found: {folder}")
    file = folder / "summary.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found (is {folder} a finished run?)")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e.msg} at line {e.lineno})") from None
    per_job = _get(data, "per_job", dict, "", file)
    if not per_job:
        raise ValueError(f"{file}: field 'per_job' is empty")
    sph = float(_get(data, "steps_per_gpu_hour", (int, float), "", file))
    if not sph > 0:
        raise ValueError(f"{file}: field 'steps_per_gpu_hour' must be positive, got {sph}")
    return RunSummary(
        path=str(path),
        policy=_get(data, "policy", str, "", file),
        sharing=_get(data, "sharing", str, "", file),
        groups=_get(data, "groups", int, "", file),
        seed=_get(data, "seed", int, "", file),
        steps_per_gpu_hour=sph,
        jobs={job_id: _job(job_id, rec, file) for job_id, rec in per_job.items()} if learning else {},
        share_prompts=config_share_prompts(folder / "config.json"),
        stacks=stacks_of(data.get("arm")),
    )


def config_share_prompts(config: Path) -> int:
    """The run config's trainer.share_prompts (0 where the run folder has no config or the field)."""
    if not config.is_file():
        return 0
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{config}: not valid JSON ({e.msg} at line {e.lineno})") from None
    value = (data.get("trainer") or {}).get("share_prompts") or 0
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{config}: field 'trainer.share_prompts' must be an integer >= 0, got {value!r}")
    return value


def _resolve_baseline(arms: dict[str, dict[int, list[RunSummary]]], baseline: str, paths) -> str:
    """The baseline arm's label: `baseline` is an arm label or a policy name owning one arm."""
    if baseline in arms:
        return baseline
    matches = [label for label, seeds in arms.items()
               if next(iter(seeds.values()))[0].policy == baseline]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ValueError(f"no baseline run: no run has arm or policy {baseline!r} among "
                         f"{', '.join(map(str, paths))} (arms: {', '.join(arms)})")
    raise ValueError(f"baseline {baseline!r} matches several arms ({', '.join(matches)}); "
                     "pass one of these labels")


def _pair_learning(arm: RunSummary, base: RunSummary):
    """Per-item accuracy differences with their (job, seed) labels, and per-job reward differences."""
    acc, labels, reward = [], [], []
    for job_id, b in sorted(base.jobs.items()):
        a = arm.jobs.get(job_id)
        if a is None:
            raise ValueError(f"job {job_id!r} is in {base.path} but not in {arm.path}: "
                             "arms must run the same jobs")
        if len(a.correct) != len(b.correct):
            raise ValueError(f"job {job_id!r}: {len(a.correct)} eval items in {arm.path} but "
                             f"{len(b.correct)} in {base.path}: eval sets differ")
        steps = min(len(a.rewards), len(b.rewards))
        if steps == 0:
            raise ValueError(f"job {job_id!r}: no training rewards in "
                             f"{arm.path if not a.rewards else base.path}")
        acc.extend(np.subtract(a.correct, b.correct).tolist())
        labels.extend([(job_id, base.seed)] * len(b.correct))
        # Compare over the same steps: a run cut short must not look better for missing late steps.
        reward.append(float(np.mean(a.rewards[:steps]) - np.mean(b.rewards[:steps])))
    if extra := sorted(set(arm.jobs) - set(base.jobs)):
        raise ValueError(f"jobs {extra} are in {arm.path} but not in {base.path}")
    return acc, labels, reward


def _ci_dict(ci: tuple[float, float, float], n: int, resample: str) -> dict:
    return {"mean": ci[0], "lo": ci[1], "hi": ci[2], "n": n, "resample": resample}


def _throughput(runs: list[RunSummary]) -> float:
    """A seed's steps per GPU-hour: the mean over its repeats, so the order runs are named in
    (a shell glob puts `dedicated-aa` before `dedicated`) never picks the baseline."""
    return float(np.mean([r.steps_per_gpu_hour for r in runs]))


def _per_seed_rows(seeds: dict[int, list[RunSummary]], base_seeds: dict[int, list[RunSummary]]):
    rows = []
    for seed, runs in sorted(seeds.items()):
        run = runs[0]
        base = base_seeds.get(seed)
        rows.append({
            "seed": seed,
            "run": run.path,
            "repeats": len(runs),
            "steps_per_gpu_hour": _throughput(runs),
            "ratio": _throughput(runs) / _throughput(base) if base else None,
            "accuracy": float(np.mean([j.accuracy for j in run.jobs.values()])),
            "mean_reward": float(np.mean([np.mean(j.rewards) if j.rewards else np.nan
                                          for j in run.jobs.values()])),
        })
    return rows


def _aa(seeds: dict[int, list[RunSummary]]) -> dict | None:
    pairs = [(runs[0].steps_per_gpu_hour, runs[1].steps_per_gpu_hour)
             for _, runs in sorted(seeds.items()) if len(runs) >= 2]
    if not pairs:
        return None
    spread = aa_spread([p[0] for p in pairs], [p[1] for p in pairs])
    spread["seeds"] = [s for s, runs in sorted(seeds.items()) if len(runs) >= 2]
    return spread


def _aa_learning(seeds: dict[int, list[RunSummary]], n_boot: int, alpha: float, boot_seed: int) -> dict | None:
    """Learning differences between an arm's repeat and its first run, over the seeds that have
    one: the same paired CIs as against the baseline. Repeats that differ in nothing (seeded
    sampling, the same batching) give exactly 0; repeats that differ in batching only (e.g.
    `gpu_arms.py --aa-mb-tokens`) give the learning noise floor bf16 rounding leaves."""
    acc, labels, reward, used = [], [], [], []
    for seed, runs in sorted(seeds.items()):
        if len(runs) >= 2:
            a, lab, r = _pair_learning(runs[1], runs[0])
            acc += a
            labels += lab
            reward += r
            used.append(seed)
    if not used:
        return None
    acc_ci, reward_ci = _learning_cis(acc, labels, reward, n_boot, alpha, boot_seed)
    return {"seeds": used, "acc_diff": acc_ci, "reward_diff": reward_ci}


def _learning_cis(acc, labels, reward, n_boot, alpha, boot_seed) -> tuple[dict, dict]:
    """Paired bootstrap CIs of the accuracy differences (whole (job, seed) clusters when there are
    enough, else single items) and of the per-job reward differences."""
    clustered = len(set(labels)) >= MIN_CLUSTERS
    acc_ci = _ci_dict(paired_bootstrap_ci(acc, n_boot, alpha, boot_seed, clusters=labels if clustered else None),
                      len(acc), "(job, seed) clusters" if clustered else "eval items")
    reward_ci = _ci_dict(paired_bootstrap_ci(reward, n_boot, alpha, boot_seed), len(reward), "(job, seed) pairs")
    return acc_ci, reward_ci


def compare_runs(
    run_dirs: list[str],
    baseline: str | None = None,
    n_boot: int = 10_000,
    alpha: float = 0.05,
    boot_seed: int = 0,
    min_ratio: float = 2.0,
    spread_mult: float = 5.0,
    min_lower: float = -0.05,
    aa_runs: list[str] | None = None,
) -> dict:
    """The comparison report of run folders: per arm and seed, throughput and its ratio to the
    baseline of the same seed; per arm, paired CIs of eval-accuracy and mean-reward differences,
    the A/A spread and the gate verdict. `baseline` is an arm label ("dedicated/none/g1") or a
    policy name; it defaults to the arm with policy "dedicated".

    `aa_runs`: A/A repeats recorded apart from the compared runs (another call or day: two or more
    runs of one arm and seed), the noise floor where the compared arm and its baseline have no
    repeats of their own. They never enter the ratios or the learning CIs."""
    if not run_dirs:
        raise ValueError("compare_runs needs at least one run dir")
    given = _given_aa(aa_runs) if aa_runs else None
    arms: dict[str, dict[int, list[RunSummary]]] = {}
    for path in run_dirs:
        run = load_run(path)
        arms.setdefault(run.arm, {}).setdefault(run.seed, []).append(run)
    base_label = _resolve_baseline(arms, baseline or DEFAULT_BASELINE, run_dirs)
    base_seeds = arms[base_label]
    aa = {label: _aa(seeds) for label, seeds in arms.items()}

    report_arms = []
    for label in [base_label] + [a for a in arms if a != base_label]:
        seeds = arms[label]
        first = next(iter(seeds.values()))[0]
        entry = {"arm": label, "policy": first.policy, "sharing": first.sharing,
                 "groups": first.groups, "baseline": label == base_label,
                 "per_seed": _per_seed_rows(seeds, base_seeds), "aa_spread": aa[label],
                 "aa_learning": _aa_learning(seeds, n_boot, alpha, boot_seed), "vs_baseline": None}
        if label != base_label:
            entry["vs_baseline"] = _vs_baseline(seeds, base_seeds, aa, label, base_label, given,
                                                n_boot, alpha, boot_seed,
                                                dict(min_ratio=min_ratio, spread_mult=spread_mult,
                                                     min_lower=min_lower))
        report_arms.append(entry)
    return {
        "baseline": base_label,
        "runs": [str(p) for p in run_dirs],
        "aa_runs": given,
        "settings": {"n_boot": n_boot, "alpha": alpha, "boot_seed": boot_seed, "min_ratio": min_ratio,
                     "spread_mult": spread_mult, "min_lower": min_lower, "min_clusters": MIN_CLUSTERS},
        "arms": report_arms,
    }


def _given_aa(paths: list[str]) -> dict:
    """The A/A spread of runs given apart from the compared ones (``aa_runs``): per arm and folder
    (a call's repeats pair among themselves, never with another call's), its seeds with two runs or
    more; throughput only, so runs without an eval serve too. An error naming the runs when none has
    a repeat."""
    arms: dict[str, dict[int, list[RunSummary]]] = {}
    for path in paths:
        run = load_run(path, learning=False)
        arms.setdefault(f"{run.arm} in {Path(path).parent}", {}).setdefault(run.seed, []).append(run)
    spreads = {label: sp for label, seeds in arms.items() if (sp := _aa(seeds)) is not None}
    if not spreads:
        raise ValueError(f"--aa-runs: no arm and seed has two runs among {list(map(str, paths))}; an A/A "
                         "needs a repeat of one arm on one seed")
    return {"runs": [str(p) for p in paths], "arms": spreads, "max": max(sp["max"] for sp in spreads.values())}


def _noise(aa: dict[str, dict | None], label: str, base_label: str,
           given: dict | None = None) -> tuple[float | None, str]:
    """The A/A spread to judge an arm's gain against, and where it came from.

    Run-to-run noise is a property of the machine and the measurement more than of one arm, so
    the arm's own or the baseline's repeats are preferred; else the widest of the repeats given apart
    from the compared runs (``aa_runs``) and any other compared arm's repeats (conservative)."""
    own = [aa[x]["max"] for x in (label, base_label) if aa[x] is not None]
    if own:
        return max(own), "arm and baseline repeats"
    other = [s["max"] for s in aa.values() if s is not None]
    if given:  # with any other compared arm's repeats: the wider of the two
        if other and max(other) > given["max"]:
            return max(other), "other arms' repeats (wider than the given A/A runs')"
        return given["max"], "the given A/A runs (" + ", ".join(given["arms"]) + ")"
    if other:
        return max(other), "other arms' repeats"
    return None, "no A/A repeats"


def _vs_baseline(seeds, base_seeds, aa, label, base_label, given, n_boot, alpha, boot_seed, thresholds):
    common = sorted(set(seeds) & set(base_seeds))
    ratios, acc, labels, reward = [], [], [], []
    for seed in common:
        arm_run, base_run = seeds[seed][0], base_seeds[seed][0]
        ratios.append(_throughput(seeds[seed]) / _throughput(base_seeds[seed]))
        a, lab, r = _pair_learning(arm_run, base_run)
        acc += a
        labels += lab
        reward += r
    acc_ci = reward_ci = None
    if common:
        acc_ci, reward_ci = _learning_cis(acc, labels, reward, n_boot, alpha, boot_seed)
    spread, source = _noise(aa, label, base_label, given)

    def as_tuple(ci):
        return (ci["mean"], ci["lo"], ci["hi"]) if ci else None

    gate = gate_verdict(ratios, spread, as_tuple(acc_ci), as_tuple(reward_ci), **thresholds)
    return {
        "seeds": common,
        "unpaired_seeds": sorted(set(seeds) ^ set(base_seeds)),
        "ratios": ratios,
        "acc_diff": acc_ci,
        "reward_diff": reward_ci,
        "noise_spread": spread,
        "noise_source": source,
        "gate": gate,
    }


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _ci_text(ci: dict | None) -> str:
    return "n/a" if ci is None else f"{ci['mean']:+.3f} [{ci['lo']:+.3f}, {ci['hi']:+.3f}]"


def render_compare_markdown(report: dict) -> str:
    """The report of compare_runs as Markdown tables: throughput, learning CIs, gate criteria."""
    pct = round(100 * (1 - report["settings"]["alpha"]))
    lines = [f"# Run comparison (baseline `{report['baseline']}`)", "",
             "## Throughput", "",
             "| arm | seed | steps/GPU-h | ratio vs baseline | eval acc | mean reward | runs |",
             "|---|---|---|---|---|---|---|"]
    for arm in report["arms"]:
        for row in arm["per_seed"]:
            lines.append(f"| {arm['arm']} | {row['seed']} | {_f(row['steps_per_gpu_hour'], '.1f')} | "
                         f"{_f(row['ratio'], '.2f')} | {_f(row['accuracy'])} | "
                         f"{_f(row['mean_reward'])} | {row['repeats']} |")
    lines += ["", f"## Learning vs baseline (arm - baseline, paired {pct}% bootstrap CI)", "",
              "| arm | seeds | eval accuracy diff | mean reward diff | A/A spread (max) | gate |",
              "|---|---|---|---|---|---|"]
    for arm in report["arms"]:
        vs = arm["vs_baseline"]
        if vs is None:
            aa, aal = arm["aa_spread"], arm["aa_learning"]
            if aal:  # the baseline's repeat against its first run: the learning noise floor
                lines.append(f"| {arm['arm']} (baseline; its A/A repeat) | {' '.join(map(str, aal['seeds']))} | "
                             f"{_ci_text(aal['acc_diff'])} | {_ci_text(aal['reward_diff'])} | "
                             f"{_f(aa['max'] if aa else None)} | |")
            else:
                lines.append(f"| {arm['arm']} (baseline) | | | | {_f(aa['max'] if aa else None)} | |")
            continue
        lines.append(f"| {arm['arm']} | {' '.join(map(str, vs['seeds'])) or 'none'} | "
                     f"{_ci_text(vs['acc_diff'])} | {_ci_text(vs['reward_diff'])} | "
                     f"{_f(vs['noise_spread'])} | {'PASS' if vs['gate']['pass'] else 'FAIL'} |")
    given = report.get("aa_runs")
    if given:
        lines += ["", "A/A runs given apart from the compared ones (`--aa-runs`; the noise floor only): "
                  + "; ".join(f"{label} seeds {' '.join(map(str, sp['seeds']))}, spread {_f(sp['max'])}"
                              for label, sp in given["arms"].items())
                  + " (" + ", ".join(given["runs"]) + ")."]
    for arm in report["arms"]:
        vs = arm["vs_baseline"]
        if vs is None:
            continue
        lines += ["", f"### Gate: {arm['arm']} {'PASS' if vs['gate']['pass'] else 'FAIL'}", "",
                  "| criterion | value | threshold | pass | rule |", "|---|---|---|---|---|"]
        for name, c in vs["gate"]["criteria"].items():
            lines.append(f"| {name} | {_f(c['value'])} | {_f(c['threshold'])} | "
                         f"{'yes' if c['pass'] else 'no'} | {c['rule']} |")
        notes = [f"A/A spread from {vs['noise_source']}"]
        if vs["acc_diff"]:
            notes.append(f"accuracy CI resamples {vs['acc_diff']['resample']}")
        if vs["unpaired_seeds"]:
            notes.append(f"seeds without a pair (ignored): {vs['unpaired_seeds']}")
        lines += ["", "; ".join(notes) + "."]
    return "\n".join(lines) + "\n"
