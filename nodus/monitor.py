"""The lifecycle the run's monitors share (``nodus.gpumon``, ``nodus.hostmon``): start-up reads, a
daemon thread sampling every ``interval_s`` until the stop, and one summary kept for every later
stop.

Why: both monitors run inside the real backend's controller over the measured window, and a monitor
must never be what fails a run or leaves a thread behind. Their sampling differs; the rules do not:
any failure becomes a reason in the summary (``why`` without figures, ``stopped_early`` with the
figures so far), the thread is a daemon and the stop waits a bounded time for it, and start and stop
may be called again at no cost. One class keeps those rules in one place.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import TypeVar

M = TypeVar("M", bound="SamplingMonitor")


class SamplingMonitor:
    """Samples in a daemon thread named ``thread_name`` every ``interval_s`` between `start` and
    `stop`. A subclass gives the hooks: `_begin` (start-up reads; it sets ``self._why`` to give up),
    `_sample` (one sample, taken in the thread), `_failure` (why sampling ended, from the exception),
    `_summary` (the figures, built once at the stop), and where it holds something the thread uses,
    `_release` and `_after_join`. `start` and `stop` raise nothing the hooks do not: the thread
    turns a `_sample`'s exception into ``stopped_early``; `_begin` and `_summary` catch their own,
    `_begin` giving up through ``self._why``."""

    thread_name = "nodus-monitor"

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._thread: threading.Thread | None = None
        self._halt = threading.Event()
        self._lock = threading.Lock()  # the subclass's samples, shared with the thread
        self._why: str | None = None  # set: no figures, and why
        self._stopped: str | None = None  # set: sampling ended early, and why
        self._stopped_s: float | None = None  # monotonic s at which the thread's sampling failed
        self._result: dict | None = None

    def start(self: M) -> M:
        """Take the start-up reads and start the thread; on any failure, record why and sample
        nothing. A second start (after a start or a stop) does nothing."""
        if self._thread is not None or self._result is not None:
            return self
        self._why = None
        self._begin()
        if self._why is not None:
            return self
        thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
        try:
            thread.start()
        except RuntimeError as e:  # no thread to be had (the process's limit): no figures, and why
            self._why = f"cannot start the sampling thread ({e})"
            self._release()
            return self
        self._thread = thread
        return self

    def _loop(self) -> None:
        while not self._halt.wait(self.interval_s):
            try:
                self._sample()
            except Exception as e:  # noqa: BLE001 - stop sampling; the samples so far stand
                self._stopped = self._failure(e)
                self._stopped_s = time.monotonic()  # the figures cover the window up to here
                return

    def stop(self) -> dict:
        """Stop sampling and summarise (the same summary, a copy, on every later call): the
        subclass's `_summary`, or without figures ``{"available": False, "why": ...}``. Waits for
        the thread at most ``max(1 s, 5 * interval_s)``: a read that hangs leaves a daemon thread
        behind, not a run that never ends."""
        if self._result is not None:
            return copy.deepcopy(self._result)
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=max(1.0, 5 * self.interval_s))
            self._after_join(self._thread.is_alive())
        if self._thread is None and self._why is None:
            self._why = "never started"
        if self._why is not None:
            self._result = {"available": False, "why": self._why}
        else:
            self._result = self._summary()
        return copy.deepcopy(self._result)

    def _begin(self) -> None:
        """The start-up reads (a first sample among them, so that a read the host does not answer
        fails here rather than in the thread); on a failure, set ``self._why`` and release what was
        taken."""

    def _sample(self) -> None:
        """One sample, kept under ``self._lock``; an exception ends the sampling (`_failure`)."""
        raise NotImplementedError

    def _failure(self, e: Exception) -> str:
        """Why sampling ended, from the exception a sample raised (``stopped_early``)."""
        return f"sampling failed ({type(e).__name__}: {e})"

    def _summary(self) -> dict:
        """The summary with figures (``"available": True``), built once, at the first stop."""
        raise NotImplementedError

    def _after_join(self, alive: bool) -> None:
        """Once the stop has waited for the thread; ``alive``: it outlived the wait (a hung read),
        and keeps what it uses, so nothing is released."""
        if not alive:
            self._release()

    def _release(self) -> None:
        """Free what `_begin` took (a library's handle), once no thread will sample with it."""
