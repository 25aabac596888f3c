"""Time a test moves itself, and waiting on state rather than sleeping: tests that are about deadlines run the same on
an idle machine and on one too loaded to keep any wall-clock bound."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

HANG_S = 60.0  # only a hung test waits this long: nothing a test waits for takes near it


class ManualClock:
    """A monotonic clock that stands still until `advance` moves it (an Engine's `clock`)."""

    def __init__(self) -> None:
        self._now, self._lock = 0.0, threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


def wait_until(holds: Callable[[], bool], what: str, timeout_s: float = HANG_S) -> None:
    """Return once `holds()` is true; fail naming `what` if it is not within `timeout_s` (a hung test's bound)."""
    deadline = time.monotonic() + timeout_s
    while not holds():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.005)
