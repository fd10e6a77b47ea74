"""One GPU shared by engine and trainer clients, as processor sharing (SimPy's machine-shop idiom).

Work is measured in seconds "alone, without MPS". Each running client progresses at a rate set by
the sharing mode and the kinds of the other running clients; whenever the set of running clients
changes, every client's remaining work is rescaled to its new rate.
"""

from __future__ import annotations

from itertools import count

import simpy

from sim.profile import Rates, SharingCost


def sharing_rates(kinds: list[str], sharing: str, cost: SharingCost) -> list[float]:
    """Progress rate of each running client ('engine' or 'trainer').

    Alone: full speed without MPS, the MPS share's speed with it. Co-running: the measured pair's
    rates; for more than two clients the pair's combined rate is split in proportion to the pair's
    per-kind rates (an assumption the profile names).
    """
    if not kinds:
        return []
    if len(kinds) == 1:
        return [1.0 if sharing == "none" else getattr(cost.mps_alone, kinds[0])]
    pair: Rates = cost.none_corun if sharing == "none" else cost.mps_corun
    if len(kinds) == 2 and set(kinds) == {"engine", "trainer"}:
        return [getattr(pair, k) for k in kinds]
    combined = pair.engine + pair.trainer
    weights = [getattr(pair, k) for k in kinds]
    total = sum(weights)
    return [combined * w / total for w in weights]


class SharedGPU:
    def __init__(self, env: simpy.Environment, sharing: str, cost: SharingCost):
        self.env = env
        self.sharing = sharing
        self.cost = cost
        self._active: dict[int, str] = {}
        self._rates: dict[int, float] = {}
        self._changed = env.event()
        self._ids = count()

    def _update(self) -> None:
        ids = list(self._active)
        self._rates = dict(zip(ids, sharing_rates([self._active[i] for i in ids], self.sharing, self.cost)))
        old, self._changed = self._changed, self.env.event()
        old.succeed()

    def work(self, kind: str, work_s: float, interrupt: simpy.Event | None = None):
        """Process generator: run `work_s` of work; returns the work done, which is less than
        asked only if `interrupt` fired first."""
        if work_s <= 0:
            return 0.0
        me = next(self._ids)
        self._active[me] = kind
        self._update()
        remaining = work_s
        try:
            while True:
                rate, t0, changed = self._rates[me], self.env.now, self._changed
                finish = self.env.timeout(remaining / rate)
                waits = [finish, changed] if interrupt is None else [finish, changed, interrupt]
                yield self.env.any_of(waits)
                # A Timeout counts as triggered from birth: `processed` tells that it fired.
                if finish.processed:
                    remaining = 0.0
                    break
                remaining = max(remaining - (self.env.now - t0) * rate, 0.0)
                if remaining <= 1e-12 * work_s:
                    remaining = 0.0
                    break
                if interrupt is not None and interrupt.triggered:
                    break
        finally:
            del self._active[me]
            self._update()
        return work_s - remaining
