"""A long stage's progress, as tqdm shows it: a bar on a terminal, counted lines in a log.

A stage that ends within DELAY_S shows nothing, so a small export's output stays its stage lines. One that runs
longer shows how much work it has (once it knows: segments to score, weights to quantize, steps to validate),
how much is done and about how long is left: on a terminal as a tqdm bar on stderr, else as a line through the
stage's `log` then and every LINE_EVERY_S seconds, from a thread of its own, so that a unit of work that takes
minutes still leaves a line a while.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

DELAY_S = 5.0
LINE_EVERY_S = 30.0


class Progress:
    """Used as a context manager around the stage's work; `plan` once the work is known, `advance` as it is done."""

    def __init__(self, log: Callable[[str], None], name: str, delay_s: float = DELAY_S,
                 every_s: float = LINE_EVERY_S, terminal: bool | None = None):  # fmt: skip
        self.log, self.name, self.delay_s, self.every_s = log, name, delay_s, every_s
        self.terminal = sys.stderr.isatty() if terminal is None else terminal
        self.total: int | None = None
        self.unit = ""
        self.work: str | None = None  # what a stage without counted units does, said in its lines
        self.done = 0
        self.started = time.monotonic()
        self._ended = threading.Event()
        self._bar = None
        self._lines = None

    def __enter__(self) -> Progress:
        if self.terminal:
            from tqdm import tqdm

            self._bar = tqdm(desc=self.name, total=self.total, unit=self.unit or "it", delay=self.delay_s,
                             leave=False, file=sys.stderr, dynamic_ncols=True)  # fmt: skip
        else:
            self._lines = threading.Thread(target=self._write_lines, name=f"{self.name} progress", daemon=True)
            self._lines.start()
        return self

    def __exit__(self, *_exception) -> None:
        self._ended.set()
        if self._bar is not None:
            self._bar.close()
        if self._lines is not None:
            self._lines.join()

    def expect(self, work: str) -> None:
        """What the stage does, where its work cannot be counted (one library call): said with its elapsed time."""
        self.work = work
        if self._bar is not None:
            self._bar.set_postfix_str(work)

    def plan(self, more: int, unit: str) -> None:
        """The stage has `more` units of work (segments, weights, steps) besides what it planned before."""
        self.total, self.unit = (self.total or 0) + more, unit
        if self._bar is not None:
            self._bar.total, self._bar.unit = self.total, unit
            self._bar.refresh()

    def advance(self, done: int = 1) -> None:
        self.done += done
        if self._bar is not None:
            self._bar.update(done)

    def line(self) -> str:
        """What the stage has done so far, as a log line: `name ... seconds: what`, besides its stage line."""
        elapsed = time.monotonic() - self.started
        if self.total is None:
            return f"{self.name:<9} ... {elapsed:.0f} s: running" + (f", {self.work}" if self.work else "")
        line = f"{self.name:<9} ... {elapsed:.0f} s: {self.done:,}/{self.total:,} {self.unit}"
        if 0 < self.done < self.total:
            left = elapsed * (self.total - self.done) / self.done
            line += f" ({self.done / self.total:.0%}), about {_duration(left)} left"
        return line

    def _write_lines(self) -> None:
        if self._ended.wait(self.delay_s):
            return
        while True:
            self.log(self.line())
            if self._ended.wait(self.every_s):
                return


def untracked() -> Progress:
    """A Progress nobody shows, for work run outside a stage."""
    return Progress(lambda line: None, "")


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"
