"""How the engine worker spends a generation's time: its engine steps, the time between them and the
garbage collector's pauses.

Why: on session 27's dedicated A/A pair the same job's generations did identical work (the same
sampled tokens, step by step) and still took 0.77-1.67x as long on one run as on the other, with
the GPU never slowed (``nodus.gpumon``) and no contention on the host (``nodus.hostmon``). A
generation is a few hundred engine steps of a few milliseconds each, paced in part by Python. These
figures say whether a slow generation had slower steps throughout (every decode step's host and
GPU work), a few long ones (a pause), more time between steps (the worker's own loop: commands,
adapter loads), or garbage collections.

Per generation (one ``gen`` command's requests, its tag), from the clock read before its requests
are submitted to the end of the step that completes it:

- ``submit_s``: building and adding its requests;
- ``steps``, ``step_s``, ``step_max_s``: the engine steps taken while it was open (vLLM's
  ``LLMEngine.step`` only), summed and the longest; a step serves every open generation, so each
  counts it;
- ``between_s``: the time between those steps (from its submit, or the last step's end where that
  is later), the worker's loop: other commands (publishes), queue reads;
- ``collect_s``: turning finished requests into results after each step (the adapter check, token
  tuples, sampled logprobs);
- ``gc_collections``, ``gc_s``: the collections the worker's process ran from just before its
  submit to its finish (inside the times above, not beside them).

Those parts add up to its time from submit to its last step's end. ``cumulative`` (the worker's
totals when it finished) and ``cumulative_at_begin`` count each engine step once, so a run's
engine-level figures (``summarise_generations``) do not weigh steps by how many generations were
open. With the engine core in a process of its own (``--engine-core-process``) a step is the
client's wait for it, and the collections are the client's, not the core's.
"""

from __future__ import annotations

import gc
import time

TOTALS = ("steps", "step_s", "between_s", "collect_s", "gc_collections", "gc_s")


class GcPauses:
    """This process's garbage collections, timed through ``gc.callbacks`` once ``install``-ed:
    cumulative count and seconds."""

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

    ``mark()`` just before a generation's requests are built (the clock and the collector's totals
    then), ``begin(tag, mark, now)`` once they are added, ``step(start, end, engine_s)`` around every
    engine step (``engine_s``: the engine's own step inside it, the rest being the results'
    collection), ``finish(tag)`` when it completes (its figures, a dict). Times are the clock's
    seconds.

    The worker's totals (``cumulative``) grow only while a generation is open, each step once: a
    busy period runs from the submit of the generation that opened it to the last step's end, its
    ``between_s`` the time not in steps or collection (submits included). Each snapshot carries a
    sequence number (``seq``), which orders snapshots taken at the same step count."""

    def __init__(self, gc_pauses: GcPauses | None = None, clock=time.perf_counter):
        self.gc, self.clock = gc_pauses, clock
        self.open: dict[str, dict] = {}
        self._last_end: float | None = None  # the last step's end in this busy period
        self._opened: float | None = None  # the submit that opened this busy period
        self._gc_mark: tuple[int, float] | None = None  # the collector's totals last added to total
        self.total = dict.fromkeys(TOTALS, 0.0)
        self.total["steps"] = self.total["gc_collections"] = 0
        self._seq = 0

    def mark(self) -> tuple[float, tuple[int, float] | None]:
        return self.clock(), self.gc.totals() if self.gc else None

    def _sync_gc(self) -> None:
        """Add the collections since the last mark to the totals (only while a period is open)."""
        if self.gc and self._gc_mark is not None:
            n, s = self.gc.totals()
            self.total["gc_collections"] += n - self._gc_mark[0]
            self.total["gc_s"] += s - self._gc_mark[1]
            self._gc_mark = (n, s)

    def _snapshot(self) -> dict:
        self._seq += 1
        out = {"seq": self._seq, **{k: v for k, v in self.total.items() if self.gc or not k.startswith("gc")}}
        return _rounded(out)

    def begin(self, tag: str, mark: tuple[float, tuple[int, float] | None], now: float) -> None:
        submitted, gc0 = mark
        if not self.open:  # the engine was idle: a busy period opens at this submit
            # (its snapshot before this submit's collections, which the next sync adds)
            self._last_end, self._opened, self._gc_mark = None, submitted, gc0
        else:
            self._sync_gc()
        at_begin = self._snapshot()
        self.open[tag] = {"since": now, "submit_s": max(0.0, now - submitted), "steps": 0, "step_s": 0.0,
                          "step_max_s": 0.0, "between_s": 0.0, "collect_s": 0.0, "gc0": gc0,
                          "cumulative_at_begin": at_begin}

    def step(self, start: float, end: float, engine_s: float | None = None) -> None:
        if not self.open:
            return
        dt = end - start if engine_s is None else min(max(engine_s, 0.0), end - start)
        collect = (end - start) - dt
        for rec in self.open.values():
            since = rec["since"] if self._last_end is None else max(self._last_end, rec["since"])
            rec["steps"] += 1
            rec["step_s"] += dt
            rec["step_max_s"] = max(rec["step_max_s"], dt)
            rec["between_s"] += max(0.0, start - since)
            rec["collect_s"] += collect
        prev = self._opened if self._last_end is None else self._last_end
        self.total["between_s"] += max(0.0, start - prev)
        self.total["steps"] += 1
        self.total["step_s"] += dt
        self.total["collect_s"] += collect
        self._last_end = end
        self._sync_gc()

    def finish(self, tag: str) -> dict | None:
        """The generation's figures (None for a tag never begun); the tag is closed."""
        rec = self.open.pop(tag, None)
        if rec is None:
            return None
        self._sync_gc()
        rec.pop("since")
        gc0 = rec.pop("gc0")
        begin = rec.pop("cumulative_at_begin")
        out = _rounded(rec)
        if self.gc and gc0 is not None:
            n, s = self.gc.totals()
            out["gc_collections"], out["gc_s"] = n - gc0[0], round(s - gc0[1], 6)
        out["cumulative_at_begin"] = begin
        out["cumulative"] = self._snapshot()
        if not self.open:
            self._gc_mark = None  # idle: collections from now on are no generation's
        return out


def _rounded(d: dict) -> dict:
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in d.items()}


def summarise_generations(records: list[dict]) -> dict:
    """A run's generations (``EngineStepStats.finish``'s figures, each with its wall ``seconds`` and
    ``stack``): per generation, the mean step's spread in ms (min, median, max) and the longest
    step; per engine (each step counted once: the worker's totals, which grow only in busy periods,
    from the first generation's begin to the last one's finish, summed over stacks), the steps, the
    mean step in ms, and the shares of its busy time in steps, between steps (submits included),
    collecting results and in garbage collection (inside the others; idle gaps between busy periods
    are in none of them). Records without steps are left out; none: {"generations": 0}."""
    recs = [r for r in records if r and r.get("steps")]
    if not recs:
        return {"generations": 0}
    import numpy as np

    per = np.array([1000 * r["step_s"] / r["steps"] for r in recs])
    out = {"generations": len(recs),
           "step_ms_per_generation": {"min": round(float(per.min()), 4), "median": round(float(np.median(per)), 4),
                                      "max": round(float(per.max()), 4)},
           "step_max_ms": round(1000 * max(r["step_max_s"] for r in recs), 3)}
    if not all("cumulative" in r and "cumulative_at_begin" in r for r in recs):
        return out
    span = dict.fromkeys(TOTALS, 0.0)
    for stack in {r.get("stack", 0) for r in recs}:
        mine = [r for r in recs if r.get("stack", 0) == stack]
        first = min((r["cumulative_at_begin"] for r in mine), key=lambda c: (c.get("seq", 0), c["steps"]))
        last = max((r["cumulative"] for r in mine), key=lambda c: (c.get("seq", 0), c["steps"]))
        for k in TOTALS:
            if k in last and k in first:
                span[k] += last[k] - first[k]
    busy = span["step_s"] + span["between_s"] + span["collect_s"]
    steps = int(span["steps"])
    out.update({"steps": steps, "mean_step_ms": round(1000 * span["step_s"] / steps, 4) if steps else None,
                "step_share": round(span["step_s"] / busy, 4) if busy > 0 else None,
                "between_share": round(span["between_s"] / busy, 4) if busy > 0 else None,
                "collect_share": round(span["collect_s"] / busy, 4) if busy > 0 else None})
    if all("gc_s" in r["cumulative"] for r in recs):
        out["gc_collections"] = int(span["gc_collections"])
        out["gc_s"] = round(span["gc_s"], 6)
        out["gc_share"] = round(span["gc_s"] / busy, 5) if busy > 0 else None
    return out
