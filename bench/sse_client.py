"""The serving benchmarks' streaming client: HTTP/1.1 over asyncio's streams, one keep-alive connection per
client, an answer's server-sent events read as they come.

On these 2 cores the load generator shares the CPU with the server it measures. httpx (h11 parsing each chunk in
Python, then its line iterator) took about 0.5 ms of CPU for each streamed token, as much as 8% of a one-row
decode step taken from the server's onnxruntime threads; this client reads the same events for a fraction of it
(bench/README.md, serving).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HttpError(Exception):
    """The server answered with a status other than 200."""


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str):
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, url: str) -> Connection:
        """A connection to the server at `url` (http://host:port, any path ignored)."""
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80, limit=1 << 20)
        return cls(reader, writer, parts.netloc)

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *_exc) -> None:
        await self.close()

    async def post(self, path: str, body: dict) -> dict:
        """POST `body` as JSON and return the JSON answer; a status other than 200 raises HttpError."""
        headers = await self._send(path, body)
        return json.loads(await self._whole(headers))

    async def events(self, path: str, body: dict) -> AsyncIterator[dict | str]:
        """POST `body` as JSON and yield each server-sent event's data as it arrives: a JSON object parsed, or the
        text as it is (the closing `[DONE]`). The answer is read to its end, so the connection serves the next
        request; a status other than 200 raises HttpError."""
        await self._send(path, body)
        pending = b""
        async for chunk in self._chunks():
            *events, pending = (pending + chunk).replace(b"\r\n", b"\n").split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        data = line[6:].decode()
                        yield json.loads(data) if data.startswith("{") else data

    async def _send(self, path: str, body: dict) -> dict[str, str]:
        """Send the request; returns the answer's headers once its status is 200."""
        payload = json.dumps(body).encode()
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        status, headers = await self._head()
        if status != 200:
            raise HttpError(f"{status}: {(await self._whole(headers)).decode(errors='replace')}")
        return headers

    async def _head(self) -> tuple[int, dict[str, str]]:
        status = int((await self.reader.readline()).split(b" ", 2)[1])
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    async def _chunks(self) -> AsyncIterator[bytes]:
        """The body of a chunked answer, chunk by chunk."""
        while size := int((await self.reader.readline()).split(b";")[0], 16):
            yield await self.reader.readexactly(size)
            await self.reader.readexactly(2)
        await self.reader.readexactly(2)  # the empty trailer's line

    async def _whole(self, headers: dict[str, str]) -> bytes:
        if headers.get("transfer-encoding") == "chunked":
            return b"".join([chunk async for chunk in self._chunks()])
        return await self.reader.readexactly(int(headers.get("content-length", 0)))
