"""The HTTP front of kvg-serve on Ray: every request goes through it to a replica (runtime/serving/ray_relay.py),
so that losing a replica costs clients as little as it can.

- A request whose replica is lost before it sent anything (queued there, or prefilling) is sent to another replica.
- A stream whose replica is lost mid-answer ends as the server's other failures end a stream: an error event that
  says so, then `[DONE]`; the client keeps the text it got.
- `/health` answers here: how many replicas are running, and whether they drain.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle
from starlette.responses import JSONResponse
from starlette.types import Message, Receive, Scope, Send

from runtime.artifact import read_manifest
from runtime.serving.http_guard import HttpGuard, body_limit, error_body
from runtime.serving.ray_relay import REPLICA_HEADER, Forwarded
from runtime.serving.server import ServeOptions

ATTEMPTS = 3  # replicas a request that has sent nothing yet is tried on
RETRY_AFTER_S = 1
logger = logging.getLogger("ray.serve")


class Gateway:
    """The deployment Ray Serve's proxies send every request to; `replicas`: the handle of the engines' `deployment`;
    `drain_signal`: the DrainSignal they drain by (None: nothing drains them but Ray Serve)."""

    def __init__(self, replicas: DeploymentHandle, options: ServeOptions, deployment: str, drain_signal=None) -> None:
        limit = options.max_body_bytes
        if limit is None:
            limit = body_limit(read_manifest(Path(options.artifact))["cache"]["max_cache_len"], options.max_batch)
        app_name = serve.get_replica_context().app_name
        relay = Relay(replicas.options(stream=True), app_name, deployment, drain_signal)
        self.asgi = HttpGuard(relay, options.api_key, limit)  # what a replica would refuse, refused before it travels

    def __serve_build_asgi_app__(self):
        return self.asgi


class Relay:
    """ASGI: `/health` answered here, every other request forwarded to a replica."""

    def __init__(self, replicas: DeploymentHandle, app_name: str, deployment: str, drain_signal) -> None:
        self.replicas, self.app_name, self.deployment, self.drain_signal = replicas, app_name, deployment, drain_signal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["path"] == "/health":
            await self.health(scope, receive, send)
        else:
            await self.forward(Forwarded.of(scope, (await receive())["body"]), send)

    async def health(self, scope: Scope, receive: Receive, send: Send) -> None:
        """200 with the replicas running; 503 while they drain (a load balancer sends no more) or when none runs."""
        running = await asyncio.to_thread(running_replicas, self.app_name, self.deployment)
        if self.drain_signal is not None and await self.drain_signal.draining.remote(running):
            status = "draining"
        else:
            status = "ok" if running else "no replica running"
        answer = JSONResponse({"status": status, "replicas": running}, 200 if status == "ok" else 503)
        await answer(scope, receive, send)

    async def forward(self, request: Forwarded, send: Send) -> None:
        """Send `request` to a replica and its answer on; another replica if one is lost before the answer began."""
        for attempt in range(1, ATTEMPTS + 1):
            answer, start, began = self.replicas.forward.remote(request), None, False
            try:
                async for message in answer:
                    if message["type"] == "http.response.start":  # held until its body: until then a retry is clean
                        start = message
                        continue
                    if not began:
                        await send(start)
                        began = True
                    await send(message)
                return
            except RayActorError as lost:
                replica = _header(start, REPLICA_HEADER) or "unknown"
                if not began and attempt < ATTEMPTS:
                    logger.warning(f"kvg-serve: replica {replica} was lost before it answered; trying another")
                    continue
                logger.warning(f"kvg-serve: replica {replica} was lost mid-answer: {type(lost).__name__}")
                await _end(send, start if began else None, replica)
                return
            finally:
                answer.cancel()  # a no-op once it ended; stops the replica's work if the client left


async def _end(send: Send, start: Message | None, replica: str) -> None:
    """A lost replica's answer ended for its client: a stream by an error event then `[DONE]`, as the server ends a
    stream it fails; nothing sent yet (no replica was left to try) by 503."""
    if start is None:
        message = f"no replica could answer: {ATTEMPTS} were lost before they did; retry after {RETRY_AFTER_S} s"
        refusal = JSONResponse(error_body(message, "server_error"), 503, headers={"Retry-After": str(RETRY_AFTER_S)})
        await refusal({"type": "http"}, _never, send)
        return
    if not (_header(start, b"content-type") or "").startswith("text/event-stream"):
        return  # an answer that is not a stream is sent in one piece: nothing of it can be lost midway
    error = error_body(f"replica {replica} was lost mid-answer (its process ended): what came before this event is "
                       "all it sent; retry the request", "server_error")  # fmt: skip
    events = f"data: {json.dumps(error, separators=(',', ':'))}\r\n\r\ndata: [DONE]\r\n\r\n"
    await send({"type": "http.response.body", "body": events.encode(), "more_body": False})


def running_replicas(app_name: str, deployment: str) -> int:
    """The replicas of `deployment` that Ray Serve's controller sees running (a lost one is counted out at its
    next health check)."""
    return serve.status().applications[app_name].deployments[deployment].replica_states.get("RUNNING", 0)


def _header(start: Message | None, name: bytes) -> str | None:
    if start is None:
        return None
    return next((value.decode() for key, value in start["headers"] if key.lower() == name), None)


async def _never() -> Message:
    raise RuntimeError("the request's body was read before it was forwarded")


async def _lifespan(receive: Receive, send: Send) -> None:
    """Nothing to start or stop: the replicas own the engines."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})
