"""What every HTTP request passes before the API reads it, as vLLM's server has it: an API key on the `/v1`
routes (`/health` and `/metrics` stay open to probes and scrapers) and a cap on the body's size, counted as
the bytes arrive, so an oversized body is refused without being parsed or held beyond the cap.

Pure ASGI rather than Starlette's BaseHTTPMiddleware, which would buffer the body it is meant to refuse.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

BODY_BASE_BYTES = 1 << 20  # a request's other fields, with room to spare
BODY_BYTES_PER_TOKEN = 64  # a token id in JSON takes at most 8 bytes; text a few a token, 6 a \u escape


def error_body(message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def body_limit(max_cache_len: int, max_batch: int) -> int:
    """The default cap: a request of `max_batch` prompts, each as long as the cache, fits in it."""
    return BODY_BASE_BYTES + BODY_BYTES_PER_TOKEN * max_cache_len * max_batch


class HttpGuard:
    """Answers 401 to a `/v1` request without the key and 413 to a body over `max_body_bytes`, and tells `refused`
    the status (for the server's metrics); the app then gets the body, read in full, as one message."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, max_body_bytes: int, refused: Callable[[int], None] = lambda _: None
    ):
        self.app, self.max_body_bytes, self.refused = app, max_body_bytes, refused
        self.key = None if api_key is None else api_key.encode()
        self.too_large = f"the request body is over this server's limit of {max_body_bytes} bytes (--max-body-bytes)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        path = scope["path"].removeprefix(scope.get("root_path", ""))  # as Starlette routes it
        if (refusal := self._refusal(path, headers.get(b"authorization"))) is not None:
            await self._refuse(scope, receive, send, 401, refusal, {"WWW-Authenticate": "Bearer"})
            return
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._refuse(scope, receive, send, 413, self.too_large)
            return
        body, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # nobody is left to answer
            body.append(message.get("body", b""))
            size += len(body[-1])
            if size > self.max_body_bytes:  # the rest is not read: the server discards it
                await self._refuse(scope, receive, send, 413, self.too_large)
                return
            if not message.get("more_body", False):
                break
        read: list[Message] = [{"type": "http.request", "body": b"".join(body), "more_body": False}]

        async def replay() -> Message:
            return read.pop() if read else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, status: int, message: str,
                      headers: dict | None = None) -> None:  # fmt: skip
        self.refused(status)
        await JSONResponse(error_body(message, "invalid_request_error"), status, headers=headers)(scope, receive, send)

    def _refusal(self, path: str, authorization: bytes | None) -> str | None:
        """Why the request may not pass, or None: with a key, a /v1 route needs it (compared in constant time)."""
        if self.key is None or not (path == "/v1" or path.startswith("/v1/")):
            return None
        if authorization is None:
            return "this server needs an API key: send the header `Authorization: Bearer <key>`"
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return None
        return "the API key is not this server's"
