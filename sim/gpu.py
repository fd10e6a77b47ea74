"""One GPU shared by engine and trainer clients, as processor sharing (SimPy's machine-shop idiom).

Work is measured in seconds "alone, without MPS". Each running client progresses at a rate set by
the sharing mode and the kinds of the other running clients; whenever the set of running clients
changes, every client's remaining work is rescaled to its new rate.
"""

from __future__ import annotations

from itertools import count
from typing import Callable

import simpy

from sim.profile import RATE_MAX, Rates, SharingCost


def pair_rates(sharing: str, cost: SharingCost, engine_batch: int | None = None) -> Rates:
    """The engine-and-trainer pair's co-run rates: by the engine's running batch where the profile
    has them for this mode (linear between measured batches, the end points' beyond), else the
    mode's constants."""
    name = "none_corun" if sharing == "none" else "mps_corun"
    pts = [(b.batch, getattr(b, name)) for b in sorted(cost.corun_by_engine_batch, key=lambda b: b.batch)
           if getattr(b, name) is not None]
    if not pts or engine_batch is None:
        return getattr(cost, name)
    return Rates(**{side: _interp([(b, getattr(r, side)) for b, r in pts], engine_batch)
                    for side in ("engine", "trainer")})


def _interp(pts: list[tuple[int, float]], x: int) -> float:
    """Linear between points (sorted by x), the end points' values beyond them."""
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    i = next(k for k, (b, _) in enumerate(pts) if b >= x)
    (b0, y0), (b1, y1) = pts[i - 1], pts[i]
    return y0 + (x - b0) / (b1 - b0) * (y1 - y0)


def engines_rate(sharing: str, cost: SharingCost, engine_batch: int | None = None) -> float | None:
    """Each engine's rate while engines of several stacks generate at once, nothing else running
    (None: the profile has none for this mode, and the many-clients rule prices them): the fitted
    rate (``sharing.mps_engines``, MPS only), following the two-engine bench's slowdown for the mode
    (``sharing.engines_by_batch``) over engine size where the profile has it (``_benched``; the
    no-MPS alone rate is the unit)."""
    alone = 1.0 if sharing == "none" else cost.mps_alone.engine
    return _benched(cost.mps_engines if sharing == "mps" else None, sharing, alone, cost, engine_batch)


def _benched(fitted: float | None, column: str, alone: float, cost: SharingCost,
             engine_batch: int | None) -> float | None:
    """A stacks rate by engine size: ``fitted`` without the bench's ``column`` (or a running batch);
    with it, ``fitted`` at the fit's engine size (``sharing.stacks_engine_sequences``) times the
    bench's slowdown there over its slowdown at the running batch (the fit gives the level, the bench
    the shape over engine size); without a fitted rate (or its size), the ``alone`` rate over the
    slowdown."""
    pts = [(e.batch, getattr(e, column)) for e in sorted(cost.engines_by_batch, key=lambda e: e.batch)
           if getattr(e, column, None) is not None]
    if not pts or engine_batch is None:
        return fitted
    slow = _interp(pts, engine_batch)
    if fitted is not None and cost.stacks_engine_sequences is not None:
        return min(fitted * _interp(pts, cost.stacks_engine_sequences) / slow, RATE_MAX)
    return min(alone / slow, RATE_MAX)


def stacks_engine_rate(sharing: str, cost: SharingCost, engine_batch: int | None = None) -> float | None:
    """An engine's rate beside the lone trainer of another stack under MPS (None: the pair's engine
    rate prices it): the fitted rate (``sharing.mps_stacks_engine``), following the bench's
    ``mps_beside_trainer`` over engine size where the profile has it (``_benched``)."""
    if sharing != "mps":
        return None
    return _benched(cost.mps_stacks_engine, "mps_beside_trainer", cost.mps_alone.engine, cost, engine_batch)


def stacks_trainer_rate(sharing: str, cost: SharingCost, engine_batch: int | None = None) -> float | None:
    """The lone trainer's rate beside engines of other stacks under MPS (None: the pair's trainer rate
    prices it): the fitted rate (``sharing.mps_stacks_trainer``), following the bench's
    ``mps_trainer_beside`` over the running engine's size where the profile has it. Only a profile
    with the fitted rate: sim.backend keeps it for arm.stacks arms alone."""
    if sharing != "mps" or cost.mps_stacks_trainer is None:
        return None
    return _benched(cost.mps_stacks_trainer, "mps_trainer_beside", cost.mps_alone.trainer, cost, engine_batch)


def sharing_rates(kinds: list[str], sharing: str, cost: SharingCost, engine_batch: int | None = None) -> list[float]:
    """Progress rate of each running client ('engine' or 'trainer').

    Alone: full speed without MPS, the MPS share's speed with it. Co-running: the measured pair's
    rates (by the running engine batch where the profile has them); for more than two clients the
    pair's combined rate is split in proportion to the pair's per-kind rates (an assumption the
    profile names), except the engines of several stacks under MPS where the profile fitted their
    rate (``sharing.mps_engines``): each engine goes at it, past two engines too. Where the profile
    fitted a lone trainer's rate beside engines of several stacks (``sharing.mps_stacks_trainer``,
    kept by ``sim.backend`` for arm.stacks arms only), that trainer goes at it, and the engines
    beside it at theirs where fitted or benched too (``stacks_engine_rate``, in the pair's engine
    rate's place). Where it fitted the trainers of several stacks training at once (``sharing.mps_trainers``,
    also kept for arm.stacks arms only), each trainer goes at that, slowed beside an engine as one is.
    """
    if not kinds:
        return []
    if len(kinds) == 1:
        return [1.0 if sharing == "none" else getattr(cost.mps_alone, kinds[0])]
    pair: Rates = pair_rates(sharing, cost, engine_batch)
    stacks_trainer = (stacks_trainer_rate(sharing, cost, engine_batch) if kinds.count("trainer") == 1
                      and "engine" in kinds else None)
    beside_lone = stacks_engine_rate(sharing, cost, engine_batch) if stacks_trainer is not None else None
    if beside_lone is not None:
        # Engines beside a lone trainer of stacks at their own rate (fitted, or following the bench over
        # engine size), in the pair's place.
        pair = Rates(engine=beside_lone, trainer=pair.trainer)
    if len(kinds) == 2 and set(kinds) == {"engine", "trainer"}:
        rates = [getattr(pair, k) for k in kinds]
    else:
        combined = pair.engine + pair.trainer
        weights = [getattr(pair, k) for k in kinds]
        total = sum(weights)
        rates = [combined * w / total for w in weights]
        # Engines of several stacks at once: each at the fitted two-engine rate, past two engines
        # too, slowed beside a trainer as one engine is (pair over alone). Past two it is an
        # assumption: on the H200 three stacks of 8 jobs (session 37) came out 6-8% low this way, as
        # the same hour's two-stack runs did (9%); the rule before it, two engines' combined rate
        # split over all of them, priced them 19-21% low. Trainers of several stacks at once, the
        # same way: each at the fitted two-trainer rate, slowed beside an engine as one trainer is
        # (an assumption).
        two_engines = engines_rate(sharing, cost, engine_batch)
        for kind, other, fitted in (("engine", "trainer", two_engines), ("trainer", "engine", cost.mps_trainers)):
            if kinds.count(kind) >= 2 and fitted is not None and (sharing == "mps" or kind == "engine"):
                alone = 1.0 if sharing == "none" else getattr(cost.mps_alone, kind)
                each = fitted * (getattr(pair, kind) / alone if other in kinds else 1.0)
                rates = [each if k == kind else r for k, r in zip(kinds, rates)]
    # Several stacks: the one trainer beside engines at its own fitted rate (a backend of one
    # stack has none: sim.backend drops it).
    if stacks_trainer is not None:
        rates = [stacks_trainer if k == "trainer" else r for k, r in zip(kinds, rates)]
    return rates


class SharedGPU:
    def __init__(self, env: simpy.Environment, sharing: str, cost: SharingCost):
        self.env = env
        self.sharing = sharing
        self.cost = cost
        self._active: dict[int, str] = {}
        self._batch: dict[int, int] = {}  # engine clients' running decode batch, where given
        self._rates: dict[int, float] = {}
        self._changed = env.event()
        self._ids = count()

    def _update(self) -> None:
        ids = list(self._active)
        batches = [b for i, b in self._batch.items() if i in self._active]
        engine_batch = max(batches) if batches else None
        self._rates = dict(zip(ids, sharing_rates([self._active[i] for i in ids], self.sharing, self.cost,
                                                  engine_batch)))
        old, self._changed = self._changed, self.env.event()
        old.succeed()

    def work(self, kind: str, work_s: float, interrupt: simpy.Event | None = None, batch: int | None = None):
        """Process generator: run `work_s` of work; returns the work done, which is less than
        asked only if `interrupt` fired first. `batch`: an engine's running decode batch (the
        co-run rates may depend on it)."""
        if work_s <= 0:
            return 0.0
        me = next(self._ids)
        self._active[me] = kind
        if batch is not None:
            self._batch[me] = batch
        self._update()
        try:
            remaining = yield from self._progress(work_s, lambda: self._rates[me], interrupt)
        finally:
            del self._active[me]
            self._batch.pop(me, None)
            self._update()
        return work_s - remaining

    def _progress(self, work_s: float, rate: Callable[[], float], interrupt: simpy.Event | None = None):
        """Process generator: progress through `work_s` at `rate()`, re-read whenever the set of
        running clients changes (the remaining work rescaled to the new rate); returns the work left,
        0 unless `interrupt` fired first."""
        remaining = work_s
        while True:
            r, t0, changed = rate(), self.env.now, self._changed
            finish = self.env.timeout(remaining / r)
            waits = [finish, changed] if interrupt is None else [finish, changed, interrupt]
            yield self.env.any_of(waits)
            # A Timeout counts as triggered from birth: `processed` tells that it fired.
            if finish.processed:
                return 0.0
            remaining = max(remaining - (self.env.now - t0) * r, 0.0)
            if remaining <= 1e-12 * work_s:
                return 0.0
            if interrupt is not None and interrupt.triggered:
                return remaining

    def trainer_running(self) -> bool:
        """Whether a train step is in flight on this GPU (any stack's trainer)."""
        return "trainer" in self._active.values()

    def host_work(self, work_s: float, trainer_slowdown: float = 1.0):
        """Process generator: `work_s` seconds of host-side work that takes no share of the GPU
        (a publish) but progresses `trainer_slowdown` times slower while a train step runs on this
        GPU; when a train starts or ends meanwhile, its remaining work is rescaled, so only the part
        that overlaps trainer work is slowed. A generation beside it does not slow it: on the H200
        the publishes beside another group's generation kept their alone time (~0.04 s/adapter)."""
        if trainer_slowdown == 1.0 or work_s <= 0:
            yield self.env.timeout(work_s)  # as before the factor existed: the same events
            return
        yield from self._progress(work_s, lambda: 1.0 / trainer_slowdown if self.trainer_running() else 1.0)
