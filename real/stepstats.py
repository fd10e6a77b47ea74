"""How the engine worker spends a generation's time: its engine steps, the time between them and
the garbage collector's pauses.

Why: on session 27's dedicated A/A pair the same job's generations did identical work (the same
sampled tokens, step by step) and still took 0.77-1.67x as long on one run as on the other, with
the GPU never slowed (``nodus.gpumon``) and no contention on the host (``nodus.hostmon``). A
generation is a few hundred engine steps of a few milliseconds each, paced in part by Python. These
figures say whether a slow generation had slower steps throughout (every decode step's host and
GPU work), a few long ones (a pause), more time between steps (the worker's own loop: commands,
adapter loads), or garbage collections.

Per generation (one ``gen`` command's requests, its tag): the engine steps taken while it was open
(a step serves every open generation, so each is counted in each), their summed and longest wall
time, the time between those steps, and the collections this process ran while it was open (count,
seconds, longest). With the engine core in a process of its own (``--engine-core-process``) a step
is the client's wait for it and that process's collections are not seen.
"""

from __future__ import annotations

import gc
import time


class GcPauses:
    """This process's garbage collections, timed through ``gc.callbacks`` once ``install``-ed:
    cumulative count, seconds and the longest one."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.count, self.total_s, self._t = 0, 0.0, None

    def install(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = self.clock()
        elif phase == "stop" and self._t is not None:
            self.count += 1
            self.total_s += self.clock() - self._t
            self._t = None

    def totals(self) -> tuple[int, float]:
        return self.count, self.total_s


class EngineStepStats:
    """Engine steps and collections per open generation (see the module's docstring).

    ``begin(tag, now)`` when a generation is submitted, ``step(start, end)`` around every engine
    step, ``finish(tag)`` when it completes (its figures, a dict). Times are the clock's seconds."""

    def __init__(self, gc_pauses: GcPauses | None = None):
        self.gc = gc_pauses
        self.open: dict[str, dict] = {}
        self._last_end: float | None = None

    def begin(self, tag: str, now: float) -> None:
        if not self.open:
            self._last_end = now  # the engine was idle: the wait before the first step starts here
        self.open[tag] = {"steps": 0, "step_s": 0.0, "step_max_s": 0.0, "between_s": 0.0,
                          "gc0": self.gc.totals() if self.gc else None}

    def step(self, start: float, end: float) -> None:
        between = 0.0 if self._last_end is None else max(0.0, start - self._last_end)
        dt = end - start
        for rec in self.open.values():
            rec["steps"] += 1
            rec["step_s"] += dt
            rec["step_max_s"] = max(rec["step_max_s"], dt)
            rec["between_s"] += between
        self._last_end = end

    def finish(self, tag: str) -> dict | None:
        """The generation's figures (None for a tag never begun); the tag is closed."""
        rec = self.open.pop(tag, None)
        if rec is None:
            return None
        if not self.open:
            self._last_end = None
        gc0 = rec.pop("gc0")
        out = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in rec.items()}
        if gc0 is not None:
            n, s = self.gc.totals()
            out["gc_collections"], out["gc_s"] = n - gc0[0], round(s - gc0[1], 6)
        return out


def summarise_generations(records: list[dict]) -> dict:
    """A run's per-generation engine figures (``EngineStepStats.finish``'s, each with the
    generation's wall ``seconds``) summed: the mean step in milliseconds, the shares of generation
    time in steps, between them and in collections, the longest step, and the per-generation mean
    step's spread (min, median, max ms). Empty records: {"generations": 0}."""
    recs = [r for r in records if r and r.get("steps")]
    if not recs:
        return {"generations": 0}
    import numpy as np

    wall = sum(r["seconds"] for r in recs)
    steps = sum(r["steps"] for r in recs)
    per = np.array([1000 * r["step_s"] / r["steps"] for r in recs])
    out = {"generations": len(recs), "steps": steps,
           "mean_step_ms": round(1000 * sum(r["step_s"] for r in recs) / steps, 4),
           "step_ms_per_generation": {"min": round(float(per.min()), 4), "median": round(float(np.median(per)), 4),
                                      "max": round(float(per.max()), 4)},
           "step_max_ms": round(1000 * max(r["step_max_s"] for r in recs), 3),
           "step_share": round(sum(r["step_s"] for r in recs) / wall, 4) if wall > 0 else None,
           "between_share": round(sum(r["between_s"] for r in recs) / wall, 4) if wall > 0 else None}
    if all("gc_s" in r for r in recs):
        out["gc_collections"] = sum(r["gc_collections"] for r in recs)
        out["gc_s"] = round(sum(r["gc_s"] for r in recs), 6)
        out["gc_share"] = round(out["gc_s"] / wall, 5) if wall > 0 else None
    return out
