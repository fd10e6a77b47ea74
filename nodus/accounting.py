"""Accounting: pure functions from phase spans to the metrics a planner compares.

Every occupied GPU is charged from its run's start through the end of the window, the drain
included: a GPU that waits for the slowest job is still booked. ``pace_of`` splits that window into
the jobs' steady pace and the GPU-seconds of their start and drain, which a run of a few steps
weighs more than a long one does (offset stacks start a generation apart).
"""

from __future__ import annotations

from collections import defaultdict

from nodus.messages import Span

def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def covered_length(start: float, end: float, intervals) -> float:
    """How much of ``start``-``end`` the intervals cover (overlaps counted once)."""
    return union_length([(max(s, start), min(e, end)) for s, e in intervals if s < end and e > start])


def window_s(spans: list[Span]) -> float:
    """A run's billed window: from 0 (its GPU is booked at start) to the last span's end."""
    return max((s.end_s for s in spans), default=0.0)


def completed_steps(spans: list[Span]) -> int:
    return sum(1 for s in spans if s.phase == "train" and not s.attrs.get("failed"))


def busy_seconds(spans: list[Span]) -> dict[str, float]:
    """Seconds the engine, the trainer and the GPU (either of them) were busy."""
    gen = [(s.start_s, s.end_s) for s in spans if s.phase == "generate"]
    tr = [(s.start_s, s.end_s) for s in spans if s.phase == "train"]
    return {"engine": union_length(gen), "trainer": union_length(tr), "gpu": union_length(gen + tr)}


def audit_on_policy(spans: list[Span]) -> list[str]:
    """Every way a job's timeline breaks strict on-policy training, as messages (empty: clean).

    A rollout is stale if sampled from a version other than its step's, if its generation began
    before that version was published, or if the trainer consumed it under another version.
    """
    by_job: dict[str, dict[str, dict[int, Span]]] = defaultdict(lambda: defaultdict(dict))
    problems: list[str] = []
    for s in spans:
        if s.phase == "publish":
            by_job[s.job]["publish"][int(s.attrs["version"])] = s
        elif s.phase in ("generate", "train"):
            step = int(s.attrs["step"])
            if step in by_job[s.job][s.phase]:
                problems.append(f"{s.job}: two {s.phase} spans for step {step}")
            by_job[s.job][s.phase][step] = s
    for job, ph in sorted(by_job.items()):
        for step, g in sorted(ph["generate"].items()):
            v = g.attrs.get("adapter_version")
            if v != step:
                problems.append(f"{job}: step {step} sampled from version {v}")
            if step > 0:
                pub = ph["publish"].get(step)
                if pub is None or pub.end_s > g.start_s + 1e-9:
                    problems.append(f"{job}: step {step} sampled before version {step} was published")
            t = ph["train"].get(step)
            if t is not None:
                if t.attrs.get("consumed_version") != step:
                    problems.append(f"{job}: step {step} trained on version {t.attrs.get('consumed_version')}")
                if t.start_s < g.end_s - 1e-9:
                    problems.append(f"{job}: step {step} trained before its rollouts finished")
        for step in ph["train"]:
            if step not in ph["generate"]:
                problems.append(f"{job}: step {step} trained without rollouts")
    return problems


def stale_rollouts(spans: list[Span]) -> int:
    return len(audit_on_policy(spans))


def job_overlaps(spans: list[Span]) -> list[str]:
    """A job's own phases never overlap each other (it is strictly sequential)."""
    out = []
    by_job: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_job[s.job].append(s)
    for job, ss in by_job.items():
        ss.sort(key=lambda s: (s.start_s, s.end_s))
        for a, b in zip(ss, ss[1:]):
            if b.start_s < a.end_s - 1e-9:
                out.append(f"{job}: {a.phase}@{a.start_s:.3f}-{a.end_s:.3f} overlaps {b.phase}@{b.start_s:.3f}")
    return out


def per_job(spans: list[Span]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for s in spans:
        d = out.setdefault(s.job, {"steps": 0, "start_s": None, "finish_s": 0.0, "response_tokens": 0,
                                   "group": s.group, "rewards": []})
        d["finish_s"] = max(d["finish_s"], s.end_s)
        if s.phase == "generate" and (d["start_s"] is None or s.start_s < d["start_s"]):
            d["start_s"] = s.start_s  # its first generation
        if s.phase == "train" and not s.attrs.get("failed"):
            d["steps"] += 1
        if s.phase == "generate":
            d["response_tokens"] += sum(s.attrs.get("response_tokens", []))
            if s.attrs.get("mean_reward") is not None:
                d["rewards"].append(s.attrs["mean_reward"])
    return out


def job_pace(spans: list[Span]) -> dict[str, float]:
    """Each job's steady pace, steps per second: the steps between its first and its last
    generation's start over the time between them (a job with fewer than two generations has none).

    A window of a few steps is also charged for how the jobs start and end: offset stacks, or an
    overlap arm's groups, start one generation apart and end apart, which a long run pays once.
    The pace is what every further step costs; ``summarize`` splits the window into the two.
    """
    starts: dict[str, dict[int, float]] = defaultdict(dict)
    for s in spans:
        if s.phase == "generate":
            step = int(s.attrs.get("step", 0))
            prev = starts[s.job].get(step)
            starts[s.job][step] = s.start_s if prev is None else min(prev, s.start_s)
    out = {}
    for job, by_step in starts.items():
        steps = sorted(by_step)
        if len(steps) >= 2 and by_step[steps[-1]] > by_step[steps[0]]:
            out[job] = (steps[-1] - steps[0]) / (by_step[steps[-1]] - by_step[steps[0]])
    return out


def pace_of(runs: list[list[Span]]) -> dict:
    """The window split into the jobs' steady pace and its ramp (empty when a job had fewer than
    two generations: no pace to measure).

    Each run (one GPU) goes at the sum of its jobs' paces; its ramp is its window less its steps at
    that pace: the start (an offset stack's first generation waits for the other's) and the drain.
    A run of ``n`` steps a job then takes ``ramp + n * jobs / pace`` GPU-seconds
    (``projected_steps_per_gpu_hour``); ``pace_steps_per_gpu_hour`` is its limit, every GPU kept at
    its jobs' pace (a job that ends handing its place to the next, as in a service). On dedicated
    runs (a job a GPU) it is the jobs' harmonic mean, like the window's steps over GPU-seconds.
    """
    jobs, ramp_s, pace_gpu_s = 0, 0.0, 0.0
    for r in runs:
        names = {s.job for s in r}
        rates = job_pace(r)
        if not names or set(rates) != names:
            return {}
        run_pace = sum(rates.values())  # steps a second on this GPU
        jobs += len(names)
        ramp_s += window_s(r) - completed_steps(r) / run_pace
        pace_gpu_s += len(names) / run_pace  # GPU-seconds for one step of each of its jobs
    if not jobs:
        return {}
    return {"pace_steps_per_gpu_hour": jobs / pace_gpu_s * 3600, "ramp_gpu_s": ramp_s, "jobs": jobs}


def runs_by_gpu(spans: list[dict]) -> list[list[Span]]:
    """A recorded run's spans (spans.jsonl rows) as one list a GPU, by each row's ``gpu``."""
    runs: dict[int, list[Span]] = defaultdict(list)
    for d in spans:
        runs[int(d.get("gpu", 0))].append(Span.from_dict(d))
    return [runs[g] for g in sorted(runs)]


def projected_steps_per_gpu_hour(summary: dict, steps_per_job: int) -> float | None:
    """Steps per GPU-hour of the same jobs run for ``steps_per_job`` steps each: the summary's ramp
    (start and drain, paid once) plus every step at the steady pace. None without a pace."""
    pace = summary.get("pace")
    if not pace:
        return None
    if steps_per_job < 1:
        raise ValueError(f"steps_per_job must be at least 1, got {steps_per_job}")
    steps = steps_per_job * pace["jobs"]
    gpu_s = pace["ramp_gpu_s"] + steps / (pace["pace_steps_per_gpu_hour"] / 3600)
    return steps / gpu_s * 3600 if gpu_s > 0 else None


def own_pace_steps_per_gpu_hour(runs: list[list[Span]], steps_per_job: int) -> float | None:
    """Steps per GPU-hour of the same jobs run for ``steps_per_job`` steps each, every job going on
    at its own steady pace (``job_pace``) from where it ended, and each GPU billed until its last job
    ends. ``projected_steps_per_gpu_hour`` pays the start and drain once at the jobs' summed pace;
    where the jobs' paces differ (the continuous policy: jobs of short responses run ahead and end
    first) their ends drift apart with every step, which this counts and that does not. It counts no
    speed-up of the jobs left once others end, so it reads low where that one reads high (simulated
    continuous runs of 20 and 40 steps fell between the two). None where a job has no pace."""
    if steps_per_job < 1:
        raise ValueError(f"steps_per_job must be at least 1, got {steps_per_job}")
    gpu_s, steps = 0.0, 0
    for r in runs:
        rates, jobs = job_pace(r), per_job(r)
        if not jobs or set(rates) != set(jobs):
            return None
        gpu_s += max(d["finish_s"] + (steps_per_job - d["steps"]) / rates[j] for j, d in jobs.items())
        steps += steps_per_job * len(jobs)
    return steps / gpu_s * 3600 if gpu_s > 0 else None


def summarize(runs: list[list[Span]], late_arrivals: bool = False) -> dict:
    """Metrics over one or more runs, each on its own GPU (dedicated: one run per job).
    ``late_arrivals``: some job arrived after the start (``jobs[].arrive_s``), so the jobs were
    never all under way together from the start and the run has no steady pace (``pace`` empty: the
    sum of the jobs' paces would price every job's pace while it ran with fewer beside it)."""
    gpu_s = sum(window_s(r) for r in runs)
    steps = sum(completed_steps(r) for r in runs)
    tokens = sum(sum(s.attrs.get("response_tokens", [])) for r in runs for s in r if s.phase == "generate")
    busy = {"engine": 0.0, "trainer": 0.0, "gpu": 0.0}
    for r in runs:
        for k, v in busy_seconds(r).items():
            busy[k] += v
    jobs: dict[str, dict] = {}
    for r in runs:
        jobs.update(per_job(r))
    return {
        "gpus": len(runs),
        "gpu_seconds": gpu_s,
        "steps": steps,
        "steps_per_gpu_hour": steps / gpu_s * 3600 if gpu_s > 0 else 0.0,
        "rollout_tokens_per_gpu_s": tokens / gpu_s if gpu_s > 0 else 0.0,
        "busy": {k: (v / gpu_s if gpu_s > 0 else 0.0) for k, v in busy.items()},
        "stale_rollouts": sum(stale_rollouts(r) for r in runs),
        # The window split into its steady pace and its ramp (start and drain): see pace_of.
        "pace": {} if late_arrivals else pace_of(runs),
        "per_job": jobs,
    }


def add_arrivals(summary: dict, arrivals: dict[str, float]) -> None:
    """Each named job's ``arrive_s`` and ``wait_s``, from its arrival to its first generation (the
    step boundary at which its group took it in, or a slot freed: arm.max_active), in the
    summary's ``per_job``."""
    for job, t in arrivals.items():
        d = summary["per_job"].get(job)
        if d is None:
            continue
        d["arrive_s"] = t
        if d.get("start_s") is not None:
            d["wait_s"] = d["start_s"] - t


def add_slowdowns(shared: dict, dedicated: dict) -> None:
    """Each job's time from its arrival (``arrive_s``, else the start) to its finish sharing the GPU,
    over its time alone on its own GPU (which it has from its arrival)."""
    for job, d in shared["per_job"].items():
        alone = dedicated["per_job"].get(job, {}).get("finish_s")
        d["slowdown_vs_alone"] = (d["finish_s"] - (d.get("arrive_s") or 0.0)) / alone if alone else None
