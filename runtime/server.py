"""The OpenAI-compatible HTTP API over a continuous-batching Engine: completions (whole or streamed as
server-sent events), the model list, health and Prometheus metrics.

Each prompt of a request is one engine request; the engine's thread hands events to the event loop, which
turns tokens into text, cuts it at stop strings and writes the response. Bad input is answered with 400 and
an OpenAI-style error body before anything is queued; a full queue with 429 and Retry-After.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException

from runtime.artifact import ArtifactError, SessionOptions, read_manifest
from runtime.engine import Engine, Failed, Finished, QueueFull, Token, check_servable
from runtime.generator import GenerationConfig, Generator
from runtime.sampling import SamplingConfig
from runtime.text_stream import TextStream

RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.1
TokenIds = list[Annotated[int, Field(ge=0)]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """OpenAI's completion request; `top_k`, `min_tokens` and `repetition_penalty` are extensions (as vLLM's).
    Fields OpenAI has and this server does not implement are accepted only at their neutral values."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = Field(None, max_length=4)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    best_of: Literal[1] | None = None
    echo: Literal[False] = False
    logprobs: None = None
    presence_penalty: Literal[0] = 0
    frequency_penalty: Literal[0] = 0
    user: str | None = None


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.kind, self.param, self.headers = status, kind, param, headers


def error_body(message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


@dataclass
class ServerMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("kvg_requests", "Completion requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("kvg_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("kvg_generated_tokens", "Tokens generated", registry=r)
        self.queue_depth = Gauge("kvg_queue_depth", "Requests waiting for a cache row", registry=r)
        self.batch_occupancy = Gauge("kvg_batch_occupancy", "Fraction of the cache rows in use", registry=r)
        self.time_to_first_token = Histogram(
            "kvg_time_to_first_token_seconds", "From a request's arrival to its first token", registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )  # fmt: skip
        self.time_per_token = Histogram(
            "kvg_time_per_output_token_seconds", "Between consecutive tokens of a request", registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
        )  # fmt: skip


class Choice:
    """One prompt of a request, fed by the engine's thread through the event loop."""

    def __init__(self, index: int, request: CompletionRequest, state: ServerState, arrived: float):
        self.index, self.state, self.arrived = index, state, arrived
        self.events: asyncio.Queue = asyncio.Queue()
        stop = [request.stop] if isinstance(request.stop, str) else request.stop or ()
        self.text = TextStream(state.tokenizer, stop) if state.tokenizer else None
        self.tokens: list[int] = []
        self.prompt_tokens = 0
        self.last_token_at: float | None = None
        self.handle = None

    def submit(self, prompt: list[int], config: GenerationConfig) -> None:
        loop = asyncio.get_running_loop()
        self.prompt_tokens = len(prompt)
        self.handle = self.state.engine.submit(
            prompt, config, lambda event: loop.call_soon_threadsafe(self.events.put_nowait, event)
        )

    async def deltas(self) -> AsyncIterator[tuple[str, str | None]]:
        """(text, None) as tokens arrive, then ("", finish_reason); raises ApiError if the request fails."""
        metrics = self.state.metrics
        while True:
            event = await self.events.get()
            now = time.perf_counter()
            if isinstance(event, Token):
                self.tokens.append(event.token)
                metrics.generated_tokens.inc()
                if self.last_token_at is None:
                    metrics.time_to_first_token.observe(now - self.arrived)
                else:
                    metrics.time_per_token.observe(now - self.last_token_at)
                self.last_token_at = now
                text = self.text.push(event.token) if self.text else ""
                if self.text and self.text.stopped:
                    self.handle.cancel()
                    yield text, "stop"
                    return
                if text:
                    yield text, None
            elif isinstance(event, Finished):
                text = self.text.flush() if self.text else ""
                yield text, "stop" if self.text and self.text.stopped else event.reason
                return
            elif isinstance(event, Failed):
                raise ApiError(503, event.message, "server_error")

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()


@dataclass
class ServerState:
    engine: Engine
    model_name: str
    metrics: ServerMetrics = field(default_factory=ServerMetrics)

    @property
    def tokenizer(self):
        return self.engine.generator.tokenizer


def _prompts(request: CompletionRequest, state: ServerState) -> list[list[int]]:
    prompt = request.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
        texts = [prompt] if isinstance(prompt, str) else prompt
        if state.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        return [state.tokenizer.encode(text, add_special_tokens=False).ids for text in texts]
    if not prompt or isinstance(prompt[0], int):
        return [prompt]
    return prompt


def _config(request: CompletionRequest) -> GenerationConfig:
    sampling = SamplingConfig(
        request.temperature, request.top_k, request.top_p, request.repetition_penalty, request.seed
    )
    if request.min_tokens > request.max_tokens:
        raise ApiError(400, "min_tokens must not exceed max_tokens", param="min_tokens")
    return GenerationConfig(request.max_tokens, request.min_tokens, sampling=sampling)


def create_app(engine: Engine, model_name: str) -> FastAPI:
    state = ServerState(engine, model_name)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        engine.close()

    app = FastAPI(title="kvg-serve", lifespan=lifespan)
    app.state.kvg = state
    metrics = state.metrics
    metrics.queue_depth.set_function(lambda: engine.queue_depth)
    metrics.batch_occupancy.set_function(lambda: engine.busy_rows / engine.cache.rows)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, error: ApiError) -> JSONResponse:
        metrics.requests.labels(outcome=f"http_{error.status}").inc()
        return JSONResponse(error_body(str(error), error.kind, error.param), error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        if first["type"] == "json_invalid":
            param, message = None, f"the body is not valid JSON: {first['msg']}"
        else:
            where = [str(part) for part in first["loc"] if part != "body"]
            param, message = (where or [None])[0], f"{'.'.join(where) or 'body'}: {first['msg']}"
        metrics.requests.labels(outcome="http_400").inc()
        return JSONResponse(error_body(message, "invalid_request_error", param), 400)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(error.detail), "invalid_request_error"), error.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = engine.alive
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, 200 if alive else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "kvg-export"}],
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, http: Request):
        arrived = time.perf_counter()
        if request.model is not None and request.model != model_name:
            raise ApiError(404, f"model {request.model!r} is not served here; GET /v1/models lists {model_name!r}",
                           param="model")  # fmt: skip
        prompts, config = _prompts(request, state), _config(request)
        choices = [Choice(i, request, state, arrived) for i in range(len(prompts))]
        try:
            for prompt in prompts:  # all checked before any is queued: a request with a bad prompt queues nothing
                state.engine.check(prompt, config)
            for choice, prompt in zip(choices, prompts, strict=True):
                choice.submit(prompt, config)
        except QueueFull as full:
            for choice in choices:
                choice.cancel()
            raise ApiError(429, f"the server is busy ({full}); retry after {RETRY_AFTER_S} s", "rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None  # fmt: skip
        except (ArtifactError, ValueError) as bad:
            for choice in choices:
                choice.cancel()
            message = str(bad).replace("max_new_tokens", "max_tokens")  # the runtime's name for the API's field
            raise ApiError(400, message, param="prompt" if isinstance(bad, ArtifactError) else None) from None
        metrics.prompt_tokens.inc(sum(map(len, prompts)))
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}  # fmt: skip
        if request.stream:
            include_usage = request.stream_options is not None and request.stream_options.include_usage
            return EventSourceResponse(_stream(head, choices, include_usage, metrics), ping=15)
        collected = asyncio.ensure_future(asyncio.gather(*(_collect(choice) for choice in choices)))
        gone = asyncio.create_task(_client_gone(http))
        try:
            await asyncio.wait({collected, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            for choice in choices:
                choice.cancel()
        if not collected.done():  # the client left: its rows are freed, and nobody reads an answer
            collected.cancel()
            metrics.requests.labels(outcome="cancelled").inc()
            return Response(status_code=499)
        results = collected.result()
        metrics.requests.labels(outcome="completed").inc()
        return {**head, "choices": results, "usage": _usage(choices)}

    return app


async def _client_gone(http: Request) -> None:
    """Returns once the client of a whole (not streamed) answer has disconnected."""
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


def _usage(choices: list[Choice]) -> dict:
    prompt, completion = sum(c.prompt_tokens for c in choices), sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _choice(index: int, text: str, finish_reason: str | None, tokens: list[int] | None = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if tokens is not None:
        choice["token_ids"] = tokens  # an extension, as vLLM's: the tokens generated
    return choice


async def _collect(choice: Choice) -> dict:
    pieces, finish_reason = [], None
    async for text, reason in choice.deltas():
        pieces.append(text)
        finish_reason = reason
    return _choice(choice.index, "".join(pieces), finish_reason, choice.tokens)


async def _stream(head: dict, choices: list[Choice], include_usage: bool, metrics: ServerMetrics):
    """Server-sent events: a chunk per text delta of any choice, each choice's last chunk with its finish
    reason, optionally the usage, then [DONE]. A client that goes away cancels every choice."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for text, reason in choice.deltas():
                await merged.put(_choice(choice.index, text, reason, choice.tokens if reason else None))
        except ApiError as error:
            await merged.put(error)
        await merged.put(None)

    tasks = [asyncio.create_task(pump(choice)) for choice in choices]
    outcome = "cancelled"
    try:
        for _ in range(len(choices)):
            while (item := await merged.get()) is not None:
                if isinstance(item, ApiError):
                    outcome = "failed"
                    yield {"data": _json(error_body(str(item), item.kind))}
                    continue
                yield {"data": _json({**head, "choices": [item]})}
        if include_usage:
            yield {"data": _json({**head, "choices": [], "usage": _usage(choices)})}
        yield {"data": "[DONE]"}
        outcome = "completed" if outcome != "failed" else outcome
    finally:
        for choice in choices:
            choice.cancel()
        for task in tasks:
            task.cancel()
        metrics.requests.labels(outcome=outcome).inc()


def _json(payload: dict) -> str:
    return json.dumps(payload, separators=(",", ":"))


@dataclass(frozen=True)
class ServeOptions:
    """What `kvg-serve` serves and how: the same for one process and for each Ray replica."""

    artifact: str
    max_batch: int = 8
    max_queue: int = 64
    timeout_s: float = 300.0
    model_name: str | None = None  # the id clients send as `model`; by default the artifact folder's name
    provider: str = "auto"
    threads: int = 0

    @property
    def name(self) -> str:
        return self.model_name or Path(self.artifact).resolve().name

    def check(self) -> None:
        """Refuse what cannot be served before any model is loaded (or any replica started)."""
        if self.timeout_s <= 0 or self.max_queue < 0:
            raise ArtifactError("--timeout must be > 0 and --max-queue >= 0")
        folder = Path(self.artifact)
        check_servable(folder, read_manifest(folder), self.max_batch)


def open_app(options: ServeOptions) -> FastAPI:
    generator = Generator.open(options.artifact, SessionOptions(options.provider, options.threads))
    return create_app(Engine(generator, options.max_batch, options.max_queue, options.timeout_s), options.name)
