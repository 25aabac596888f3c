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
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from runtime.artifact import ArtifactError, SessionOptions, read_manifest
from runtime.engine import PREFILL_BUDGET, Engine, Failed, Finished, Prompt, QueueFull, Token, check_servable
from runtime.generator import GenerationConfig, Generator
from runtime.http_guard import HttpGuard, body_limit, error_body
from runtime.logprobs import MAX_TOP, TokenLogprob
from runtime.sampling import SamplingConfig
from runtime.text_stream import TextStream

RETRY_AFTER_S = 1
LEAST_LOGPROB = -9999.0  # stands for -inf (a token the sampling processors removed), which JSON cannot hold, as in vLLM
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
    max_tokens: int = Field(16, ge=0)  # 0: the prompt alone, with `echo`
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
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP)
    presence_penalty: Literal[0] = 0
    frequency_penalty: Literal[0] = 0
    user: str | None = None


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.kind, self.param, self.headers = status, kind, param, headers


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


@dataclass
class Delta:
    text: str
    scored: list[TokenLogprob]  # log-probabilities of the tokens since the last delta (when the request asked)
    finish_reason: str | None = None


class Choice:
    """One prompt of a request, fed by the engine's thread through the event loop."""

    def __init__(self, index: int, request: CompletionRequest, state: ServerState, arrived: float):
        self.index, self.state, self.arrived = index, state, arrived
        self.logprobs, self.echo = request.logprobs, request.echo
        self.events: asyncio.Queue = asyncio.Queue()
        stop = [request.stop] if isinstance(request.stop, str) else request.stop or ()
        self.text = TextStream(state.tokenizer, stop) if state.tokenizer else None
        self.tokens: list[int] = []
        self.prompt_tokens = 0
        self.prompt_text = ""  # what an echo returns first
        self.offset = 0  # text_offset of the next token reported with log-probabilities
        self.last_token_at: float | None = None
        self.handle = None

    def submit(self, prompt: list[int], prompt_text: str, config: GenerationConfig) -> None:
        loop = asyncio.get_running_loop()
        self.prompt_tokens, self.prompt_text = len(prompt), prompt_text
        self.handle = self.state.engine.submit(
            prompt, config, lambda event: loop.call_soon_threadsafe(self.events.put_nowait, event),
            self.logprobs, self.echo,
        )  # fmt: skip

    async def deltas(self) -> AsyncIterator[Delta]:
        """Deltas of text as tokens arrive, the last with its finish_reason; raises ApiError if the request fails.
        A token's log-probability comes with the delta that first carries text after it (a token may complete
        no character, or its text may be held back while it could begin a stop string)."""
        metrics, scored = self.state.metrics, []
        while True:
            event = await self.events.get()
            now = time.perf_counter()
            if isinstance(event, Prompt):
                yield Delta(self.prompt_text, event.logprobs or [])
            elif isinstance(event, Token):
                self.tokens.append(event.token)
                metrics.generated_tokens.inc()
                if self.last_token_at is None:
                    metrics.time_to_first_token.observe(now - self.arrived)
                else:
                    metrics.time_per_token.observe(now - self.last_token_at)
                self.last_token_at = now
                scored += [event.logprob] if event.logprob else []
                text = self.text.push(event.token) if self.text else ""
                if self.text and self.text.stopped:
                    self.handle.cancel()
                    yield Delta(text, scored, "stop")
                    return
                if text or (scored and not self.text):
                    yield Delta(text, scored)
                    scored = []
            elif isinstance(event, Finished):
                text = self.text.flush() if self.text else ""
                yield Delta(text, scored, "stop" if self.text and self.text.stopped else event.reason)
                return
            elif isinstance(event, Failed):
                raise ApiError(503, event.message, "server_error")

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()

    def logprobs_of(self, scored: list[TokenLogprob]) -> dict | None:
        """OpenAI's legacy `logprobs` object for these tokens, their offsets counted on from the last call's; None
        when the request did not ask for log-probabilities."""
        if self.logprobs is None:
            return None
        ids = sorted({entry.token for entry in scored} | {token for entry in scored for token, _ in entry.top})
        names = dict(zip(ids, _token_texts(self.state.tokenizer, ids), strict=True))
        offsets = []
        for entry in scored:
            offsets.append(self.offset)
            self.offset += len(names[entry.token])
        return {
            "tokens": [names[entry.token] for entry in scored],
            "token_logprobs": [None if entry.logprob is None else _finite(entry.logprob) for entry in scored],
            "top_logprobs": [None if entry.logprob is None else _top(entry, names) for entry in scored],
            "text_offset": offsets,
        }


def _token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's own text (as vLLM's `tokens`); `token_id:N` without a tokenizer (its return_tokens_as_token_ids)."""
    if tokenizer is None:
        return [f"token_id:{token}" for token in ids]
    return tokenizer.decode_batch([[token] for token in ids], skip_special_tokens=False)


def _top(entry: TokenLogprob, names: dict[int, str]) -> dict[str, float]:
    """Token text to log-probability, most likely first; of two tokens with the same text, the likelier one's."""
    top: dict[str, float] = {}
    for token, logprob in entry.top:
        top.setdefault(names[token], _finite(logprob))
    return top


def _finite(logprob: float) -> float:
    return max(logprob, LEAST_LOGPROB)


@dataclass
class ServerState:
    engine: Engine
    model_name: str
    metrics: ServerMetrics = field(default_factory=ServerMetrics)

    @property
    def tokenizer(self):
        return self.engine.generator.tokenizer


def _parse(body: bytes) -> CompletionRequest:
    try:
        return CompletionRequest.model_validate_json(body)
    except ValidationError as error:
        raise RequestValidationError(error.errors()) from None


def _prompts(request: CompletionRequest, state: ServerState) -> tuple[list[list[int]], list[str]]:
    """Each prompt's token ids, and its text where an echo returns it ("" otherwise)."""
    prompt, tokenizer = request.prompt, state.tokenizer
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
        texts = [prompt] if isinstance(prompt, str) else prompt
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        return [tokenizer.encode(text, add_special_tokens=False).ids for text in texts], texts
    ids = [prompt] if not prompt or isinstance(prompt[0], int) else prompt
    if not request.echo or tokenizer is None:
        return ids, [""] * len(ids)
    return ids, tokenizer.decode_batch(ids, skip_special_tokens=False)


def _config(request: CompletionRequest) -> GenerationConfig:
    sampling = SamplingConfig(
        request.temperature, request.top_k, request.top_p, request.repetition_penalty, request.seed
    )
    if request.min_tokens > request.max_tokens:
        raise ApiError(400, "min_tokens must not exceed max_tokens", param="min_tokens")
    if request.max_tokens == 0 and not request.echo:
        raise ApiError(400, "max_tokens 0 returns nothing without echo: ask for tokens, or echo", param="max_tokens")
    return GenerationConfig(request.max_tokens, request.min_tokens, sampling=sampling)


def create_app(
    engine: Engine, model_name: str, api_key: str | None = None, max_body_bytes: int | None = None
) -> FastAPI:
    """`api_key`: what the /v1 routes require as a bearer token (None: nothing); `max_body_bytes`: the cap on
    a request's body (None: `body_limit` of the artifact's max_cache_len and the engine's rows)."""
    state = ServerState(engine, model_name)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        engine.close()

    app = FastAPI(title="kvg-serve", lifespan=lifespan)
    app.state.kvg = state
    limit = body_limit(engine.cache.length, engine.cache.rows) if max_body_bytes is None else max_body_bytes
    app.add_middleware(HttpGuard, api_key=api_key, max_body_bytes=limit)
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
    async def completions(http: Request):
        arrived = time.perf_counter()
        # Parsing and tokenizing take a thread of their own, so that a large body never stalls the event loop
        request = await run_in_threadpool(_parse, await http.body())
        if request.model is not None and request.model != model_name:
            raise ApiError(404, f"model {request.model!r} is not served here; GET /v1/models lists {model_name!r}",
                           param="model")  # fmt: skip
        config = _config(request)
        prompts, texts = await run_in_threadpool(_prompts, request, state)
        choices = [Choice(i, request, state, arrived) for i in range(len(prompts))]
        try:
            for prompt in prompts:  # all checked before any is queued: a request with a bad prompt queues nothing
                state.engine.check(prompt, config)
            for choice, prompt, text in zip(choices, prompts, texts, strict=True):
                choice.submit(prompt, text, config)
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
        body = await run_in_threadpool(_json, {**head, "choices": results, "usage": _usage(choices)})
        return Response(body, media_type="application/json")

    return app


async def _client_gone(http: Request) -> None:
    """Returns once the client of a whole (not streamed) answer has disconnected."""
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


def _usage(choices: list[Choice]) -> dict:
    prompt, completion = sum(c.prompt_tokens for c in choices), sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _choice(choice: Choice, delta: Delta, tokens: list[int] | None = None) -> dict:
    answer = {"index": choice.index, "text": delta.text, "logprobs": choice.logprobs_of(delta.scored),
              "finish_reason": delta.finish_reason}  # fmt: skip
    if tokens is not None:
        answer["token_ids"] = tokens  # an extension, as vLLM's: the tokens generated
    return answer


async def _collect(choice: Choice) -> dict:
    pieces, scored, finish_reason = [], [], None
    async for delta in choice.deltas():
        pieces.append(delta.text)
        scored += delta.scored
        finish_reason = delta.finish_reason
    return _choice(choice, Delta("".join(pieces), scored, finish_reason), choice.tokens)


async def _stream(head: dict, choices: list[Choice], include_usage: bool, metrics: ServerMetrics):
    """Server-sent events: a chunk per text delta of any choice, each choice's last chunk with its finish
    reason, optionally the usage, then [DONE]. A client that goes away cancels every choice."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for delta in choice.deltas():
                await merged.put(_choice(choice, delta, choice.tokens if delta.finish_reason else None))
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
    api_key: str | None = field(default=None, repr=False)  # None: the /v1 routes are open; kept out of logs
    max_body_bytes: int | None = None  # None: http_guard.body_limit(max_cache_len, max_batch)
    prefill_budget: int = PREFILL_BUDGET  # prompt tokens prefilled between two decode steps

    @property
    def name(self) -> str:
        return self.model_name or Path(self.artifact).resolve().name

    def check(self) -> None:
        """Refuse what cannot be served before any model is loaded (or any replica started)."""
        if self.timeout_s <= 0 or self.max_queue < 0:
            raise ArtifactError("--timeout must be > 0 and --max-queue >= 0")
        if self.api_key == "" or (self.max_body_bytes is not None and self.max_body_bytes < 1):
            raise ArtifactError("--api-key must not be empty and --max-body-bytes must be >= 1")
        if self.prefill_budget < 1:
            raise ArtifactError("--prefill-budget must be >= 1 (prompt tokens prefilled between two decode steps)")
        folder = Path(self.artifact)
        check_servable(folder, read_manifest(folder), self.max_batch)


def open_app(options: ServeOptions) -> FastAPI:
    generator = Generator.open(options.artifact, SessionOptions(options.provider, options.threads))
    engine = Engine(generator, options.max_batch, options.max_queue, options.timeout_s, options.prefill_budget)
    return create_app(engine, options.name, options.api_key, options.max_body_bytes)
