"""kvg-serve on Ray Serve: the same HTTP API from N replicas, each with its own engine over the artifact, so
more replicas on more nodes is configuration, not code. Requests reach the replicas through a gateway
(runtime/serving/ray_gateway.py), which retries a request a lost replica never began and ends a stream it was sending
with an event that says so.

`kvg-serve DIR --ray --replicas N` (or `--autoscale MIN:MAX`: as many replicas as the load asks, Ray Serve's
autoscaling on requests in flight per replica), or with Ray's own CLI:
`serve run runtime.serving.ray_app:app_builder artifact=DIR replicas=N [autoscale=MIN:MAX max_batch=8 ...]`.

`kvg-serve --ray` drains as kvg-serve alone does (runtime/serving/drain.py): the driver takes SIGTERM and SIGINT, and
tells every replica through a DrainSignal actor; each replica refuses new requests, finishes or cuts what it has
and reports, and then Serve and Ray are shut down. Under `serve run` Ray Serve's own graceful shutdown applies,
given the grace period and the cut's time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import threading
import time
from collections.abc import AsyncIterator

import ray
from ray import serve
from ray.serve import Application
from ray.serve.context import _get_global_client
from starlette.types import Message

from runtime.errors import RequestError
from runtime.serving.answers import ServerState
from runtime.serving.drain import CUT_FLUSH_S, SIGNALS, exit_at_once, stopped_line
from runtime.serving.ray_gateway import Gateway, running_replicas
from runtime.serving.ray_relay import Forwarded, relay
from runtime.serving.ray_scaling import Scaling, scaling
from runtime.serving.server import ServeOptions, open_app

DEPLOYMENT = "kvg-serve"  # the application's name, and its replicas' deployment
GATEWAY = "kvg-gateway"
# app_builder's arguments arrive as text: their types, and those that are the deployment's own
TYPES = {"max_batch": int, "max_queue": int, "timeout_s": float, "threads": int, "max_body_bytes": int,
         "prefill_budget": int, "prefix_cache_mb": int, "shutdown_grace_s": float, "draft_tokens": int,
         "lookup_ngram": int, "lookup_min_ngram": int,
         "speculative_max_rows": int, "replicas": int, "replica_cpus": float}  # fmt: skip
SCALING = ("replicas", "autoscale", "autoscale_config", "replica_cpus")
REPORT_MARGIN_S = 10.0  # beyond the grace period and the cut, for the replicas' reports to come
HEALTH_CHECK_S = 1.0  # how often Serve asks each replica whether it is well: how soon a lost one is counted out
STATUS_ROOM = 16  # requests the gateway takes beyond the replicas' room: /health and /metrics while they are full


@ray.remote(num_cpus=0)
class DrainSignal:
    """The signal a `kvg-serve --ray` driver took, for its replicas to drain by, and how each replica's drain went.
    An async actor: each replica waits in `signalled` until the driver calls `begin`."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.taken = asyncio.Event()
        self.begun: set[str] = set()
        self.ended: dict[str, tuple[int, int]] = {}

    def begin(self, signum: int) -> None:
        self.signum = signum
        self.taken.set()

    async def signalled(self) -> int:
        await self.taken.wait()
        return self.signum

    def began(self, replica: str) -> None:
        self.begun.add(replica)

    def draining(self, running: int) -> bool:
        """Whether the `running` replicas all drain (each refuses new requests)."""
        return self.signum is not None and len(self.begun) >= running

    def end(self, replica: str, drained: int, cut: int) -> None:
        self.ended[replica] = (drained, cut)

    def results(self) -> dict[str, tuple[int, int]]:
        return self.ended


def _drain_when_signalled(drain_signal, state: ServerState, replica: str) -> None:
    """A replica's thread: once the driver has taken a signal, drain as kvg-serve alone does, and report."""
    drain = state.drain
    drain.begin(ray.get(drain_signal.signalled.remote()))
    ray.get(drain_signal.began.remote(replica))
    drain.run(state.engine.close, lambda: ray.get(drain_signal.end.remote(replica, drain.drained, drain.cut)))


class Replica:
    """One engine over the artifact, answering what the gateway forwards. It takes as many requests at once as its
    engine holds rows and queue places, so its own 429 says it is full."""

    def __init__(self, options: ServeOptions, drain_signal=None) -> None:
        self.app = open_app(options)
        self.state: ServerState = self.app.state.kvg
        self.id = serve.get_replica_context().replica_id.unique_id
        if drain_signal is not None:
            threading.Thread(target=_drain_when_signalled, args=(drain_signal, self.state, self.id),
                             name="kvg-drain", daemon=True).start()  # fmt: skip

    async def forward(self, request: Forwarded) -> AsyncIterator[Message]:
        async for message in relay(self.app, request, self.id):
            yield message

    def check_health(self) -> None:
        """Serve replaces a replica whose engine stopped."""
        if not self.state.engine.alive:
            raise RuntimeError("the engine's thread stopped")

    def __del__(self) -> None:
        self.state.engine.close()


def application(
    options: ServeOptions, scale: Scaling, replica_cpus: float = 1.0, drain_signal=None
) -> Application:  # fmt: skip
    """The gateway in front of the replicas; each replica opens the artifact itself (the engine is built on it).
    `drain_signal`: the DrainSignal the replicas drain by (None: Ray Serve's own graceful shutdown alone)."""
    room = options.max_batch + options.max_queue
    replicas = serve.deployment(
        Replica, name=DEPLOYMENT, ray_actor_options={"num_cpus": replica_cpus}, max_ongoing_requests=room,
        health_check_period_s=HEALTH_CHECK_S, graceful_shutdown_timeout_s=options.shutdown_grace_s + CUT_FLUSH_S,
        graceful_shutdown_wait_loop_s=0.1, **scale.options(),
    )  # fmt: skip
    gateway = serve.deployment(
        serve.ingress()(Gateway), name=GATEWAY, num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=room * scale.most + STATUS_ROOM,
        graceful_shutdown_timeout_s=options.shutdown_grace_s + CUT_FLUSH_S, graceful_shutdown_wait_loop_s=0.1,
    )  # fmt: skip
    return gateway.bind(replicas.bind(options, drain_signal), options, DEPLOYMENT, drain_signal)


def app_builder(args: dict[str, str]) -> Application:
    """The application `serve run runtime.serving.ray_app:app_builder artifact=DIR replicas=N` deploys."""
    known = {field.name for field in dataclasses.fields(ServeOptions)} | set(SCALING)
    if unknown := sorted(set(args) - known):
        raise RequestError(f"unknown arguments {unknown}; known: {sorted(known)}")
    values = {key: TYPES.get(key, str)(value) for key, value in args.items()}
    replicas, autoscale, tuning = (values.pop(key, None) for key in ("replicas", "autoscale", "autoscale_config"))
    replica_cpus = values.pop("replica_cpus", 1.0)
    options = ServeOptions(**values)
    options.check()
    return application(options, scaling(replicas, autoscale, tuning, options.max_batch), replica_cpus)


def serve_forever(options: ServeOptions, scale: Scaling, replica_cpus: float, host: str, port: int) -> str:
    """Serve until SIGTERM or SIGINT, drain every replica, shut Serve and Ray down; returns the line saying how.
    A local cluster's processes start with SIGINT ignored, so that a Ctrl-C (sent to the terminal's whole process
    group) stops the driver alone, which drains the replicas and then shuts the cluster down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the processes a local cluster starts
    ray.init()  # the cluster RAY_ADDRESS names, else a local one
    taken: list[int] = []
    signalled = threading.Event()

    def on_signal(signum: int, _frame) -> None:
        if taken:
            exit_at_once(signum, "the replicas' requests")
        taken.append(signum)
        signalled.set()

    for signum in SIGNALS:
        signal.signal(signum, on_signal)
    drain_signal = DrainSignal.remote()
    serve.start(http_options={"host": host, "port": port})
    proxy = _get_global_client().http_config  # Ray Serve keeps the proxy it has, whatever the new options say
    if (proxy.host, proxy.port) != (host, port):
        ray.shutdown()
        raise RequestError(f"Ray Serve already runs on this cluster with its HTTP proxy on {proxy.host}:{proxy.port} "
                           f"(one a cluster): serve there with --host {proxy.host} --port {proxy.port}, or stop it "
                           "first with `serve shutdown`")  # fmt: skip
    serve.run(application(options, scale, replica_cpus, drain_signal), name=DEPLOYMENT, route_prefix="/")
    while not signalled.wait(0.1):  # a timed wait, so that the signal's handler runs at once
        pass
    began = time.monotonic()
    ray.get(drain_signal.begin.remote(taken[0]))
    deadline = began + options.shutdown_grace_s + CUT_FLUSH_S + REPORT_MARGIN_S
    replicas = running_replicas(DEPLOYMENT, DEPLOYMENT)
    while len(ended := ray.get(drain_signal.results.remote())) < replicas and time.monotonic() < deadline:
        time.sleep(0.1)
        replicas = running_replicas(DEPLOYMENT, DEPLOYMENT)  # one lost or scaled down meanwhile reports nothing
    took = time.monotonic() - began
    serve.delete(DEPLOYMENT)  # its replicas are idle now; a cluster of RAY_ADDRESS keeps Serve for other apps
    ray.shutdown()
    drained, cut = (sum(counts) for counts in zip(*ended.values(), strict=True)) if ended else (0, 0)
    line = stopped_line(signal.Signals(taken[0]).name, took, drained, cut, options.shutdown_grace_s)
    return f"{line}, on {len(ended)} of {max(replicas, len(ended))} replicas"
