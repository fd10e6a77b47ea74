"""Accounting: pure functions from phase spans to the metrics a planner compares.

Every occupied GPU is charged from its run's start through the end of the window, the drain
included: a GPU that waits for the slowest job is still booked.
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
        d = out.setdefault(s.job, {"steps": 0, "finish_s": 0.0, "response_tokens": 0, "group": s.group,
                                   "rewards": []})
        d["finish_s"] = max(d["finish_s"], s.end_s)
        if s.phase == "train" and not s.attrs.get("failed"):
            d["steps"] += 1
        if s.phase == "generate":
            d["response_tokens"] += sum(s.attrs.get("response_tokens", []))
            if s.attrs.get("mean_reward") is not None:
                d["rewards"].append(s.attrs["mean_reward"])
    return out


def summarize(runs: list[list[Span]]) -> dict:
    """Metrics over one or more runs, each on its own GPU (dedicated: one run per job)."""
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
        "per_job": jobs,
    }


def add_slowdowns(shared: dict, dedicated: dict) -> None:
    """Each job's finish time sharing the GPU over its finish time alone on its own GPU."""
    for job, d in shared["per_job"].items():
        alone = dedicated["per_job"].get(job, {}).get("finish_s")
        d["slowdown_vs_alone"] = d["finish_s"] / alone if alone else None
