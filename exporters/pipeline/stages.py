"""An export's progress: one line per stage, with its name, its wall time and what it did, and while a long stage
runs, how far it has come (exporters/progress.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from exporters.progress import Progress

Result = TypeVar("Result")


def stage(
    log: Callable[[str], None], name: str, work: Callable[[Progress], Result], describe: Callable[[Result], str],
    expected: str | None = None,
) -> Result:  # fmt: skip
    """Run `work(progress)` (which plans and advances `progress` where its work can be counted; `expected` says what
    it does where it cannot) and log `describe(result)` under the stage's name and time; returns the result."""
    start = time.perf_counter()
    with Progress(log, name) as progress:
        if expected is not None:
            progress.expect(expected)
        value = work(progress)
    log(f"{name:<9} {time.perf_counter() - start:6.1f} s  {describe(value)}")
    return value
