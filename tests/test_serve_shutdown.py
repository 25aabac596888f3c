"""Restarts that lose nothing: kvg-serve, as a process of its own, drains what it has on SIGTERM and SIGINT (streams
that fit in the grace period arrive whole, new requests get 503, the process exits 0), ends a stream longer than
the grace period with an event that says why, and stops at once on a second signal."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from manual_clock import HANG_S, wait_until
from test_serve import free_socket

from runtime.serving.drain import Drain

REPO = Path(__file__).resolve().parent.parent
# New tokens of streams that fit in the grace period (MEDIUM: long enough to keep a server draining a while), and of
# one that does not
SHORT, MEDIUM, LONG = 120, 360, 800
PROMPT = "def main():"
ROWS = 4
# kvg-serve whose decode steps wait while a file exists, the queue is empty and no prompt is being prefilled: a test
# that makes the file sees its streams admitted (each with its first token or so) and then none ends, however fast
# or loaded the machine, until it removes the file or the server closes its engine
HELD = """import sys, time
from pathlib import Path
from runtime.cli import serve as serve_cli
from runtime.decode.engine import Engine
hold, step = Path(sys.argv[1]), Engine._step
def held(engine):
    while hold.exists() and not engine.waiting and engine.filling is None and not engine._closing:
        time.sleep(0.005)
    step(engine)
Engine._step = held
sys.exit(serve_cli.main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def artifact(exported) -> Path:
    """fox-small with room for a stream of several seconds on one thread."""
    return exported("fox-small", "static", length=1024, max_batch=4)[0].path


@contextmanager
def kvg_serve(artifact: Path, grace: float, *flags: str, session: bool = False, hold: Path | None = None,
              env: dict | None = None, stderr=subprocess.PIPE):  # fmt: skip
    """kvg-serve on a free port with `grace` and `flags` (`session`: in a process group of its own, as a terminal's
    job; `hold`: its decode steps wait while this file exists, see HELD; `env`: variables set for it; `stderr`: where
    its log goes, a pipe by default); yields the process and its URL once healthy, and kills it if the test leaves
    it running."""
    port = free_socket().getsockname()[1]
    # Free now, but until the server binds it another process may take it (another test's kvg-serve, in another
    # worker): a name of its own tells this one's answers apart, so that no signal is sent before it serves (a signal
    # sent to kvg-serve --ray while ray.init runs meets Ray's handler, which exits 15)
    name = f"kvg-test-{uuid.uuid4().hex[:12]}"
    arguments = [str(artifact), "--port", str(port), "--max-batch", str(ROWS), "--threads", "1", "--provider", "cpu",
                 "--shutdown-grace", str(grace), "--model-name", name, *flags]  # fmt: skip
    command = [sys.executable, *(["-c", HELD, str(hold)] if hold else ["-m", "runtime.cli.serve"]), *arguments]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr, text=True,
                               start_new_session=session, env={**os.environ, **(env or {})})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not serves(url, name):
            assert process.poll() is None, process.stderr.read() if process.stderr else "kvg-serve exited"
            assert time.monotonic() < deadline, "kvg-serve did not start"
            time.sleep(0.1)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def serves(url: str, name: str) -> bool:
    """Whether the server at `url` is healthy and serves the model `name`."""
    try:
        if httpx.get(f"{url}/health", timeout=5).status_code != 200:
            return False
        return [model["id"] for model in httpx.get(f"{url}/v1/models", timeout=5).json()["data"]] == [name]
    except httpx.TransportError:
        return False


class Stream(threading.Thread):
    """A streamed greedy completion of `tokens` new tokens, read as it comes: its data events, in order."""

    def __init__(self, url: str, tokens: int):
        super().__init__(daemon=True)
        self.url, self.tokens, self.events, self.failure = url, tokens, [], None
        self.started = threading.Event()
        self.ended_at: float | None = None  # when its last event came
        self.replica: str | None = None  # the Ray replica that answered (its x-kvg-replica header)

    def run(self) -> None:
        body = {"prompt": PROMPT, "max_tokens": self.tokens, "min_tokens": self.tokens, "temperature": 0,
                "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as answer:
                self.replica = answer.headers.get("x-kvg-replica")
                for line in answer.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
                        self.started.set()
        except httpx.HTTPError as error:  # a cut connection
            self.failure = error
        self.ended_at = time.monotonic()
        self.started.set()

    @property
    def tokens_received(self) -> list[int]:
        chunks = [json.loads(event) for event in self.events if event.startswith('{"id"')]
        return next((c["choices"][0]["token_ids"] for c in chunks if "token_ids" in c["choices"][0]), [])

    @property
    def errors(self) -> list[dict]:
        return [json.loads(event)["error"] for event in self.events if event.startswith('{"error"')]


def streamed(url: str, *tokens: int) -> list[Stream]:
    """Streams of these lengths, started together; returned once each has its first event."""
    streams = [Stream(url, count) for count in tokens]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(120) and not stream.failure
    return streams


def admitted(url: str, *tokens: int) -> list[Stream]:
    """Streams of these lengths, started together; returned once the server's metrics show them all in its cache
    rows (on a server whose steps are held, see HELD: none can end before the test lets it)."""
    streams = [Stream(url, count) for count in tokens]
    for stream in streams:
        stream.start()
    occupancy = f"kvg_batch_occupancy {len(tokens) / ROWS}"
    wait_until(lambda: occupancy in httpx.get(f"{url}/metrics", timeout=HANG_S).text, "the streams were not admitted")
    return streams


def ended_after(streams: list[Stream], moment: float) -> int:
    """How many of `streams` ended after `moment`: those in flight then."""
    return sum(stream.ended_at > moment for stream in streams)


def wait_for_draining(url: str, consecutive: int = 1) -> None:
    """Until /health says the server drains, `consecutive` times in a row (each replica behind a proxy)."""
    deadline, seen = time.monotonic() + 30, 0
    while seen < consecutive:
        assert time.monotonic() < deadline, "the server did not start draining"
        seen = seen + 1 if httpx.get(f"{url}/health", timeout=5).json()["status"] == "draining" else 0
        time.sleep(0.02)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_drains_the_streams_in_flight_refuses_new_requests_and_exits_0(artifact, signum, tmp_path):
    grace, hold = 60.0, tmp_path / "hold"
    with kvg_serve(artifact, grace, hold=hold) as (process, url):
        [alone] = streamed(url, SHORT)  # the same request on the server before it is stopped
        alone.join()
        hold.touch()
        streams = admitted(url, SHORT, SHORT, SHORT, MEDIUM)  # all four in flight at the signal
        signalled = time.monotonic()
        process.send_signal(signum)
        wait_for_draining(url)
        hold.unlink()
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=30)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        for stream in streams[:3]:
            stream.join()
        # the short ones in flight at the signal (all), counted while the longest keeps the server up
        drained = f"kvg_shutdown_drained_requests_total {ended_after(streams[:3], signalled)}.0"
        deadline = time.monotonic() + 10
        while drained not in httpx.get(f"{url}/metrics", timeout=30).text:
            assert time.monotonic() < deadline, "the drained requests are not counted"
            time.sleep(0.02)
        streams[3].join()
        assert process.wait(grace + 1 - (time.monotonic() - signalled)) == 0
    for stream in streams:
        assert stream.failure is None and not stream.errors and stream.events[-1] == "[DONE]"
    assert [stream.tokens_received for stream in streams[:3]] == [alone.tokens_received] * 3
    assert streams[3].tokens_received[:SHORT] == alone.tokens_received and len(streams[3].tokens_received) == MEDIUM
    last = process.stderr.read().strip().splitlines()[-1]
    in_flight = ended_after(streams, signalled)
    assert in_flight >= 2 and last.startswith(f"kvg-serve: stopped on {signum.name}: drained {in_flight} requests in ")


def test_a_stream_longer_than_the_grace_period_ends_with_an_event_that_says_why(artifact, tmp_path):
    grace, hold = 1.0, tmp_path / "hold"
    hold.touch()  # its steps wait until the cut closes the engine: longer than the grace period on any machine
    with kvg_serve(artifact, grace, hold=hold) as (process, url):
        [stream] = admitted(url, LONG)
        process.send_signal(signal.SIGTERM)
        stream.join()
        assert process.wait(30) == 0  # how soon is the summary's to say: a stop on the flush's timeout names it
    assert stream.failure is None  # the answer ended as HTTP answers do, not with a cut connection
    assert stream.events[-1] == "[DONE]" and stream.tokens_received == []  # the finished chunk carries them: none came
    [error] = stream.errors
    assert "grace period" in error["message"] and error["type"] == "server_error"
    last = process.stderr.read().strip().splitlines()[-1]
    assert last.startswith("kvg-serve: stopped on SIGTERM: drained 0 requests in ")
    assert last.endswith(", cut 1 request at the 1 s grace deadline")


def test_a_second_signal_stops_the_server_at_once(artifact, tmp_path):
    hold = tmp_path / "hold"
    hold.touch()  # its steps wait: it is still running at the second signal on any machine
    with kvg_serve(artifact, 60.0, hold=hold) as (process, url):
        [stream] = admitted(url, LONG)
        process.send_signal(signal.SIGTERM)
        wait_for_draining(url)
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 1
        stream.join()
    assert "[DONE]" not in stream.events  # it was cut off, as asked
    last = process.stderr.read().strip().splitlines()[-1]
    assert last == "kvg-serve: a second signal (SIGINT): exiting at once, 1 request cut off"


def test_the_drain_counts_what_finishes_in_the_grace_period_and_cuts_the_rest():
    """The Drain alone: two requests in flight, one finishes in time, the other is cut at the deadline."""
    cut, stopped, counted = threading.Event(), threading.Event(), {"drained": 0, "cut": 0}
    messages = []
    drain = Drain(grace_s=0.2, on_drained=lambda: counted.update(drained=counted["drained"] + 1),
                  on_cut=lambda count: counted.update(cut=count), flush_s=HANG_S)  # fmt: skip
    drain.admitted()
    drain.admitted()
    drain.begin(signal.SIGTERM)
    drain.finished()  # the first, within the grace period: before its wait begins, however late its thread starts
    running = threading.Thread(target=drain.run, args=(lambda m: (messages.append(m), cut.set()), stopped.set))
    running.start()
    assert cut.wait(HANG_S) and not stopped.is_set()  # past the deadline the rest is cut; its last event is awaited
    drain.finished()
    running.join(HANG_S)
    assert stopped.is_set() and (drain.drained, drain.cut, counted) == (1, 1, {"drained": 1, "cut": 1})
    assert "0.2 s grace period" in messages[0] and "cut 1 request at the 0.2 s grace deadline" in drain.summary()


def test_the_summary_names_cut_requests_whose_last_event_did_not_go_out():
    """The Drain alone: a cut request whose client never takes its last event holds the stop for `flush_s`, no
    longer, and the summary says so; without it, a stop on the flush's timeout would read as a clean cut."""
    stopped = threading.Event()
    drain = Drain(grace_s=0.05, flush_s=0.05)
    drain.admitted()
    drain.begin(signal.SIGTERM)
    drain.run(lambda message: None, stopped.set)
    assert stopped.is_set() and (drain.cut, drain.unsent) == (1, 1)
    assert drain.summary().endswith("cut 1 request at the 0.05 s grace deadline; last event not sent to 1 request "
                                    "within 0.05 s")  # fmt: skip
