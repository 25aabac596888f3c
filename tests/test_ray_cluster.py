"""kvg-serve --ray on a Ray cluster of two nodes, each started as `ray start` starts one (a head and a worker, each
with its own CPU): replicas on both nodes stream to many clients; a replica lost mid-stream costs only the streams it
was sending, each ended with an error event, while the requests it had not begun are answered by another replica and
Ray starts a replacement; --autoscale grows the replicas under load and shrinks them when idle, within its bounds."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest
import ray
from manual_clock import HANG_S, wait_until
from ray import serve
from test_serve import free_socket
from test_serve_shutdown import REPO, Stream, kvg_serve

from runtime.serving.ray_app import DEPLOYMENT

ROWS = 3  # each replica's --max-batch: 8 streams on two replicas leave 2 waiting for a row
STREAMS, TOKENS = 8, 400
START_S = 300.0  # a hang guard for what loads a model on a busy machine: a cluster, a replica, a server
NO_TOKEN = {"RAY_AUTH_MODE": "disabled"}
REPLICA_PREFIX = f"SERVE_REPLICA::{DEPLOYMENT}#{DEPLOYMENT}#"  # Ray Serve's name for a replica actor, then its id
# Minutes of two Ray nodes: `make test-cluster` runs them (after `make test` in CI), so `make test` stays in budget
pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster():
    """A head and a worker node of one CPU each, by `ray start --block` (stopped with SIGTERM, which stops what each
    started); yields the head's address, this process connected to it. Every process the nodes started must be
    gone once they stop."""
    temp = Path(tempfile.mkdtemp(prefix="kvg-ray-"))  # short: Ray's socket paths must fit in 107 bytes
    port = free_socket().getsockname()[1]
    address = f"127.0.0.1:{port}"
    # The nodes run this checkout; they stop at once on SIGTERM; and they take clients without a token, as this
    # process connects, whether or not a local cluster left one in ~/.ray/auth_token (which `ray start` would use)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", **NO_TOKEN}  # fmt: skip
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--num-cpus", "1",
               "--object-store-memory", str(100 << 20), "--disable-usage-stats"]  # fmt: skip
    nodes = []

    def start(name: str, *flags: str) -> None:
        """A node, returned once `ray start` says it runs (the GCS may listen before it takes clients)."""
        log = temp / f"{name}.log"
        with log.open("w") as out:
            nodes.append(subprocess.Popen([*command, *flags], env=env, stdout=out, stderr=subprocess.STDOUT))
        wait_until(lambda: "Ray runtime started" in log.read_text() or nodes[-1].poll() is not None,
                   f"the {name} node did not start", START_S)  # fmt: skip
        assert nodes[-1].poll() is None, log.read_text()[-2000:]

    try:
        start("head", "--head", "--port", str(port), "--temp-dir", str(temp), "--include-dashboard", "false")
        ray.init(address=address, namespace="kvg-test", log_to_driver=False)
        start("worker", "--address", address)
        wait_until(lambda: sum(node["Alive"] for node in ray.nodes()) == 2, "the worker node did not join", START_S)
        yield address
    finally:
        ray.shutdown()
        alive = [psutil.Process(node.pid) for node in nodes if node.poll() is None]
        started = [child for node in alive for child in node.children(recursive=True)]
        for node in reversed(nodes):
            node.terminate()
            node.wait(HANG_S)
        _, left = psutil.wait_procs(started, timeout=HANG_S)
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"left running after the nodes stopped: {left}"


@contextmanager
def ray_serve(artifact: Path, address: str, log: Path, *flags: str):
    """`kvg-serve --ray` on the cluster at `address` (its log in `log`, which Ray's forwarded lines would overfill a
    pipe with); stopped at the end by SIGTERM, as an operator stops it, which must exit 0."""
    with log.open("w") as stderr, kvg_serve(artifact, 0.0, "--ray", *flags, env={"RAY_ADDRESS": address, **NO_TOKEN},
                                            stderr=stderr) as (process, url):  # fmt: skip
        yield url
        process.send_signal(signal.SIGTERM)
        assert process.wait(START_S) == 0, log.read_text()[-2000:]
    serve.shutdown()  # the driver leaves Ray Serve running on the cluster, its proxy on this server's port


def replicas_running(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=HANG_S).json()["replicas"]


def replica_actors() -> dict:
    """Each running replica's Ray actor, by the replica's id (as x-kvg-replica names it)."""
    named = ray.util.list_named_actors(all_namespaces=True)
    return {actor["name"].removeprefix(REPLICA_PREFIX): ray.get_actor(actor["name"], namespace=actor["namespace"])
            for actor in named if actor["name"].startswith(REPLICA_PREFIX)}  # fmt: skip


def replica_processes() -> dict[str, tuple[int, str]]:
    """Each running replica's process id and node id, by the replica's id."""
    where = {replica: actor.__ray_call__.remote(lambda _: (os.getpid(), ray.get_runtime_context().get_node_id()))
             for replica, actor in replica_actors().items()}  # fmt: skip
    return {replica: tuple(ray.get(found, timeout=HANG_S)) for replica, found in where.items()}


def requests_held(actors: dict) -> dict[str, int]:
    """The requests each replica holds (running or waiting for a row), as Ray Serve counts them for its routing."""
    return {
        replica: ray.get(actor.get_num_ongoing_requests.remote(), timeout=HANG_S) for replica, actor in actors.items()
    }


@pytest.fixture(scope="class")
def served(cluster, exported, tmp_path_factory):
    """kvg-serve for TestTwoReplicasOnTwoNodes: two replicas of one CPU on nodes of one CPU each, so one on each
    node; yields its URL and the tokens a stream gets alone."""
    address = cluster
    artifact = exported("fox-small", "static", length=1024, max_batch=4)[0].path
    log = tmp_path_factory.mktemp("kvg-serve") / "stderr.log"
    flags = ["--replicas", "2", "--replica-cpus", "1", "--max-batch", str(ROWS)]
    with ray_serve(artifact, address, log, *flags) as url:
        alone = Stream(url, TOKENS)
        alone.start()
        alone.join(START_S)
        assert not alone.errors and len(alone.tokens_received) == TOKENS
        yield url, alone.tokens_received


class TestTwoReplicasOnTwoNodes:
    """One server for the class, stopped before the autoscaling test needs the nodes' CPUs."""

    def test_replicas_on_both_nodes_stream_to_many_clients_what_each_gets_alone(self, served):
        url, expected = served
        streams = [Stream(url, TOKENS) for _ in range(STREAMS)]
        for stream in streams:
            stream.start()
        for stream in streams:
            stream.join(START_S)
        assert all(not stream.errors and stream.tokens_received == expected for stream in streams)
        where = replica_processes()
        assert {stream.replica for stream in streams} <= where.keys()  # Serve's routing may favour the nearer one
        assert {node for _, node in where.values()} == {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "replicas": 2}

    def test_a_replica_lost_mid_stream_ends_only_its_streams_with_an_error_event_and_is_replaced(self, served):
        """Its streams end with an error event then [DONE]; those it had not begun (waiting for a row) and the other
        replica's arrive whole; /health counts it out, a new request is answered at once by a live replica, and the
        replacement Ray starts answers too."""
        url, expected = served
        before, actors = replica_processes(), replica_actors()
        streams = [Stream(url, TOKENS) for _ in range(STREAMS)]
        for stream in streams:
            stream.start()

        def all_held_and_begun() -> bool:
            """Every stream is held by a replica, and each replica streams to as many as its rows take (a stream
            names its replica once it began); Serve's routing decides how many each holds."""
            held = requests_held(actors)
            began = [stream.replica for stream in streams if stream.started.is_set()]
            return sum(held.values()) == STREAMS and all(began.count(r) == min(n, ROWS) for r, n in held.items())

        wait_until(all_held_and_begun, "the streams were not all held, each replica's rows busy", START_S)
        waiting = {replica: held - ROWS for replica, held in requests_held(actors).items()}
        victim = max(waiting, key=waiting.get)  # one that holds a request it has not begun: more streams than rows
        assert waiting[victim] >= 1
        os.kill(before[victim][0], signal.SIGKILL)
        killed = time.monotonic()
        with ThreadPoolExecutor(1) as pool:  # a new request at once, answered while /health is watched
            asked = pool.submit(httpx.post, f"{url}/v1/completions", json={"prompt": "def main():", "max_tokens": 4},
                                timeout=START_S)  # fmt: skip
            wait_until(lambda: replicas_running(url) == 1, "/health did not count the lost replica out", START_S)
            counted_out = time.monotonic()
            fresh = asked.result()
        for stream in streams:
            stream.join(START_S)
        assert not any(stream.is_alive() for stream in streams)
        lost = [stream for stream in streams if stream.errors]
        assert lost == [stream for stream in streams if stream.replica == victim] and len(lost) == ROWS
        for stream in lost:
            [error] = stream.errors
            assert "lost mid-answer" in error["message"] and error["type"] == "server_error"
            assert stream.failure is None and stream.events[-1] == "[DONE]" and len(stream.events) > 2
            assert stream.ended_at > killed
        # the rest arrive whole: the other replica's, and the victim's waiting ones, retried on another
        assert all(stream.tokens_received == expected for stream in streams if stream not in lost)
        assert fresh.status_code == 200 and fresh.headers["x-kvg-replica"] != victim
        wait_until(lambda: replicas_running(url) == 2, "no replacement started", START_S)
        replacement = set(replica_processes()) - set(before)
        assert len(replacement) == 1 and victim not in replica_processes()

        def answered_by_replacement() -> bool:
            answer = httpx.post(f"{url}/v1/completions", json={"prompt": "def main():", "max_tokens": 4}, timeout=60)
            return answer.status_code == 200 and answer.headers["x-kvg-replica"] in replacement

        wait_until(answered_by_replacement, "the replacement answered nothing", START_S)
        since = {"its streams' error events": max(stream.ended_at for stream in lost) - killed,
                 "/health counting it out": counted_out - killed,
                 "its replacement answering": time.monotonic() - killed}  # fmt: skip
        print("seconds from the kill to", {what: round(seconds, 2) for what, seconds in since.items()})


def test_autoscaling_grows_to_its_most_under_load_and_back_to_its_fewest_when_idle(cluster, exported, tmp_path):
    """--autoscale 1:3 with 16 clients (4 a replica's rows: Serve asks for 4 replicas and gets 3), then none: the
    replicas running, as /health counts them, go from 1 to 3 and back to 1, never past either bound."""
    address = cluster
    artifact = exported("fox-small", "static", length=1024, max_batch=4)[0].path
    quick = {"upscale_delay_s": 1, "downscale_delay_s": 3, "look_back_period_s": 2, "metrics_interval_s": 0.5}
    flags = ["--autoscale", "1:3", "--autoscale-config", json.dumps(quick), "--replica-cpus", "0.5", "--max-batch", "4"]
    with ray_serve(artifact, address, tmp_path / "stderr.log", *flags) as url:
        timeline, loaded, stop = [], threading.Event(), threading.Event()
        began = time.monotonic()

        def watch() -> None:
            while not stop.is_set():
                timeline.append((round(time.monotonic() - began, 1), replicas_running(url)))
                time.sleep(0.2)

        def client(answers: list[int]) -> None:
            while not loaded.is_set():
                body = {"prompt": "def main():", "max_tokens": 64, "min_tokens": 64, "temperature": 0}
                answers.append(httpx.post(f"{url}/v1/completions", json=body, timeout=START_S).status_code)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        answers: list[int] = []
        clients = [threading.Thread(target=client, args=(answers,), daemon=True) for _ in range(16)]
        for thread in clients:
            thread.start()
        wait_until(lambda: timeline and timeline[-1][1] == 3, "the replicas did not grow to 3", START_S)
        loaded.set()
        for thread in clients:
            thread.join(START_S)
        wait_until(lambda: timeline[-1][1] == 1, "the replicas did not shrink to 1", START_S)
        stop.set()
        watcher.join(HANG_S)
    counts = [count for _, count in timeline]
    print("replicas running, by seconds since the server answered:", timeline)
    assert min(counts) == 1 and max(counts) == 3 and counts[0] == 1 and counts[-1] == 1, timeline
    assert answers and set(answers) == {200}
