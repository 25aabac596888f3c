"""An export's progress: one line per stage, with its name, its wall time and what it did."""

from __future__ import annotations

import time
from collections.abc import Callable


def stage(log: Callable[[str], None], name: str, work: Callable, describe: Callable[..., str]):
    """Run `work()` and log `describe(result)` under the stage's name and time; returns the result."""
    start = time.perf_counter()
    value = work()
    log(f"{name:<9} {time.perf_counter() - start:6.1f} s  {describe(value)}")
    return value
