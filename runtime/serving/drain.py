"""A restart that loses nothing: on SIGTERM or SIGINT the server stops admitting (a generating request gets 503 with
Retry-After, /health says draining, so a load balancer sends no more), lets what it has finish for up to a grace
period, ends what is left with a final event that says why (the engine fails it: an error event, then `[DONE]`),
and only then lets uvicorn stop. A second signal exits at once.

uvicorn's own handler would stop at the first signal (and sse-starlette would end every stream with it), then
raise the signal again once stopped; DrainingServer takes the signals instead.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.serving.http_guard import error_body

DEFAULT_GRACE_S = 20.0  # Ray Serve's default; Kubernetes sends SIGKILL 30 s after SIGTERM by default
CUT_FLUSH_S = 5.0  # after the deadline, for the cut requests' final events to reach their clients
RETRY_AFTER_S = 1
FORCED_EXIT = 1  # the status of a server stopped at once by a second signal
SIGNALS = (signal.SIGTERM, signal.SIGINT)
GENERATING = ("/v1/completions", "/v1/chat/completions")


@dataclass
class Drain:
    """What a server has in flight, and its shutdown once a signal comes: `begin` stops admitting (it takes no lock,
    so a signal handler may call it), and `run` (in a thread of its own) waits for what is in flight, calls `cut`
    with a message if requests are left at the deadline, then `stop`."""

    grace_s: float = DEFAULT_GRACE_S
    active: int = 0  # generating requests whose answers are not sent whole yet
    draining: bool = False
    signal_name: str | None = None
    started_at: float | None = None
    drained: int = 0  # requests that finished within the grace period
    cut: int = 0  # requests still running at its end
    unsent: int = 0  # cut requests whose last event had not gone out `flush_s` after the cut
    flush_s: float = CUT_FLUSH_S
    on_drained: Callable[[], None] = lambda: None  # the metrics' counters
    on_cut: Callable[[int], None] = lambda count: None

    def __post_init__(self) -> None:
        self._changed = threading.Condition()

    def admitted(self) -> None:
        with self._changed:
            self.active += 1

    def finished(self) -> None:
        with self._changed:
            self.active -= 1
            if self.draining and not self.cut:
                self.drained += 1
                self.on_drained()
            self._changed.notify_all()

    def begin(self, signum: int) -> None:
        self.draining, self.signal_name, self.started_at = True, signal.Signals(signum).name, time.monotonic()

    def run(self, cut: Callable[[str], None], stop: Callable[[], None]) -> None:
        """Wait for what is in flight for up to the grace period, end the rest, then stop."""
        with self._changed:
            idle = self._changed.wait_for(lambda: self.active == 0, self.grace_s)
            if not idle:
                self.cut = self.active
                self.on_cut(self.cut)
        if not idle:
            cut(f"the server shut down ({self.signal_name}): this request did not finish within its {self.grace_s:g} s "
                "grace period; retry it")  # fmt: skip
            with self._changed:  # their last events on their way; a client that reads no more is closed on exit
                if not self._changed.wait_for(lambda: self.active == 0, self.flush_s):
                    self.unsent = self.active
        stop()

    def summary(self) -> str:
        """One line on how the server stopped."""
        if not self.draining:
            return "stopped"
        took = time.monotonic() - self.started_at
        return stopped_line(self.signal_name, took, self.drained, self.cut, self.grace_s, self.unsent, self.flush_s)


def stopped_line(
    signal_name: str, took_s: float, drained: int, cut: int, grace_s: float, unsent: int = 0,
    flush_s: float = CUT_FLUSH_S,
) -> str:  # fmt: skip
    """`unsent`: cut requests whose last event had not gone out `flush_s` after the cut."""
    ended = f", cut {requests(cut)} at the {grace_s:g} s grace deadline" if cut else ""
    late = f"; last event not sent to {requests(unsent)} within {flush_s:g} s" if unsent else ""
    return f"stopped on {signal_name}: drained {requests(drained)} in {took_s:.1f} s{ended}{late}"


def requests(count: int) -> str:
    return f"{count} request{'' if count == 1 else 's'}"


def exit_at_once(signum: int, cut_off: str) -> None:
    """A second signal: no waiting and no clean-up (an engine step may be running); `cut_off`: what it leaves."""
    print(f"kvg-serve: a second signal ({signal.Signals(signum).name}): exiting at once, {cut_off} cut off",
          file=sys.stderr, flush=True)  # fmt: skip
    os._exit(FORCED_EXIT)


class DrainGuard:
    """ASGI middleware: counts generating requests in flight until their answers are sent whole (a stream's last
    event included), and refuses new ones with 503 while the server drains."""

    def __init__(self, app: ASGIApp, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] != "http" or path not in GENERATING:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            refusal = JSONResponse(
                error_body("the server is shutting down; retry on another or after it restarts", "server_error"),
                503, headers={"Retry-After": str(RETRY_AFTER_S)},
            )  # fmt: skip
            await refusal(scope, receive, send)
            return
        self.drain.admitted()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.finished()


class DrainingServer(uvicorn.Server):
    """uvicorn, stopped by its Drain: the first SIGTERM or SIGINT drains, a second stops at once."""

    def __init__(self, config: uvicorn.Config, drain: Drain, cut: Callable[[str], None]):
        super().__init__(config)
        self.drain, self.cut = drain, cut

    def handle_exit(self, sig: int, frame) -> None:
        if self.drain.draining:
            exit_at_once(sig, requests(self.drain.active))
        if not self.started:  # nothing is in flight yet
            self.should_exit = True
            return
        self.drain.begin(sig)  # at once: a request arriving before the drain's thread runs is refused too
        threading.Thread(target=self.drain.run, args=(self.cut, self._stop), name="kvg-drain", daemon=True).start()

    def _stop(self) -> None:
        self.should_exit = True
