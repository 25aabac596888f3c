"""An HTTP request carried over Ray to a replica, and its answer carried back as it comes: the replica runs its ASGI
app on the request and yields the app's messages, which the gateway (runtime/serving/ray_gateway.py) sends on.

Ray Serve's own proxy does the same for an ingress deployment, but when a replica dies mid-answer it just ends the
connection: going through a gateway of our own lets a lost stream end with an event that says so.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Scope

REPLICA_HEADER = b"x-kvg-replica"  # names the replica that answered: which one to look at when one misbehaves


@dataclass(frozen=True)
class Forwarded:
    """What a replica needs of an HTTP request: its ASGI scope's fields that travel, and its whole body."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    client: tuple[str, int] | None
    body: bytes

    @classmethod
    def of(cls, scope: Scope, body: bytes) -> Forwarded:
        client = tuple(scope["client"]) if scope.get("client") else None
        return cls(scope["method"], scope["path"], scope["query_string"], list(scope["headers"]), client, body)

    def scope(self) -> Scope:
        return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": self.method,
                "scheme": "http", "path": self.path, "raw_path": self.path.encode(), "root_path": "",
                "query_string": self.query_string, "headers": self.headers, "client": self.client,
                "server": None}  # fmt: skip


async def relay(app: ASGIApp, request: Forwarded, replica: str) -> AsyncIterator[Message]:
    """On the replica: `app`'s answer to `request`, message by message, its start naming `replica`. Closing the
    iterator early (the client left) tells the app the client disconnected and stops it."""
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    unread = [{"type": "http.request", "body": request.body, "more_body": False}]

    async def receive() -> Message:
        if unread:
            return unread.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, replica.encode())]}
        await messages.put(message)

    async def run() -> None:
        try:
            await app(request.scope(), receive, send)
        finally:
            await messages.put(None)

    answering = asyncio.create_task(run())
    try:
        while (message := await messages.get()) is not None:
            yield message
        await answering  # an error the app raised reaches the gateway
    finally:
        gone.set()
        if not answering.done():
            answering.cancel()
