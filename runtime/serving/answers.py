"""How the HTTP API answers a generating request, whichever route took it (completions or chat).

Each prompt of a request is a Choice, one engine request; the engine's thread turns its tokens into text, cuts it
at stop strings and names the tokens of log-probability entries (`Choice.decode`) before it hands each event to the
event loop, which never detokenizes, so that no client waits on another's text. Every prompt is checked before any
is queued; the choices are then collected into one answer or streamed as server-sent events, in the route's `Shape`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from runtime.decode.engine import Engine
from runtime.decode.logprobs import TokenLogprob
from runtime.decode.requests import Event, Failed, Finished, Prompt, Token
from runtime.decode.sampling import SamplingConfig
from runtime.decode.search import GenerationConfig
from runtime.errors import QueueFull, RequestError, ShuttingDown
from runtime.serving.drain import Drain
from runtime.serving.http_guard import error_body
from runtime.structured.constraints import Constraint
from runtime.text.chat_template import ChatTemplate
from runtime.text.text_stream import TextStream

RETRY_AFTER_S = 1
LEAST_LOGPROB = -9999.0  # stands for -inf (a token the sampling processors removed), which JSON cannot hold, as in vLLM
DISCONNECT_POLL_S = 0.1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`; the schema is enforced whether `strict` is set or not."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(max_length=64)
    description: str | None = None
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> Constraint | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return Constraint.json_object()
        if self.json_schema is None:
            raise ApiError(400, "response_format of type json_schema needs its json_schema", param="response_format")
        return Constraint.json_schema(self.json_schema.json_schema)


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of a JSON schema, a regular expression, a list of choices or a grammar
    (Lark or GBNF)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_schema: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    def constraints(self) -> dict[str, Constraint]:
        """Each one given, by its parameter's name."""
        given = {"json": (self.json_schema, Constraint.json_schema), "regex": (self.regex, Constraint.regex),
                 "choice": (self.choice, Constraint.choice), "grammar": (self.grammar, Constraint.grammar)}  # fmt: skip
        named = {
            f"structured_outputs.{name}": build(value) for name, (value, build) in given.items() if value is not None
        }
        if self.json_object:
            named["structured_outputs.json_object"] = Constraint.json_object()
        return named


class GenerationRequest(BaseModel):
    """The fields every generating route takes: OpenAI's, and as vLLM's extensions `top_k`, `min_tokens`,
    `repetition_penalty` and `structured_outputs`. Fields OpenAI has and this server does not implement are accepted
    only at their neutral values."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
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
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) to a bias in [-100, 100]
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    def token_biases(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` keyed by token id; the ids and biases are checked against the vocabulary with the request."""
        try:
            return tuple((int(token), bias) for token, bias in (self.logit_bias or {}).items())
        except ValueError:
            raise ApiError(400, "logit_bias maps token ids (as strings, e.g. \"50256\") to biases in [-100, 100]",
                           param="logit_bias") from None  # fmt: skip

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else self.stop or []

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def constraint(self) -> Constraint | None:
        """What the answer must be, from `response_format` or `structured_outputs` (one at most)."""
        named = {} if self.structured_outputs is None else self.structured_outputs.constraints()
        if self.response_format is not None and (constraint := self.response_format.constraint()) is not None:
            named = {"response_format": constraint, **named}
        if len(named) > 1:
            raise ApiError(400, f"one constraint a request: {', '.join(named)} were all given", param=list(named)[1])
        if named and self.stops:
            raise ApiError(400, "stop cannot be combined with a structured output: the constraint decides where "
                           "the text ends", param="stop")  # fmt: skip
        return next(iter(named.values()), None)


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
        self.prefix_hit_rate = Gauge(
            "kvg_prefix_cache_hit_rate",
            "Share of the prompt tokens looked up that the prefix cache supplied",
            registry=r,
        )
        self.prefix_bytes = Gauge("kvg_prefix_cache_bytes", "Memory the prefix cache holds", registry=r)
        self.drafts_proposed = Gauge(
            "kvg_speculative_drafts_proposed", "Drafts verified by the requests that ended (speculative decoding)",
            registry=r,
        )  # fmt: skip
        self.drafts_accepted = Gauge(
            "kvg_speculative_drafts_accepted", "Of those, the drafts chosen (speculative decoding)", registry=r
        )
        self.draft_acceptance = Gauge(
            "kvg_speculative_acceptance_rate", "Drafts accepted per draft proposed, by the requests that ended",
            registry=r,
        )  # fmt: skip
        self.drained = Counter(
            "kvg_shutdown_drained_requests", "Requests in flight at a shutdown signal that finished in its grace",
            registry=r,
        )  # fmt: skip
        self.cut = Counter(
            "kvg_shutdown_cut_requests", "Requests ended at a shutdown's grace deadline, with an event that says so",
            registry=r,
        )  # fmt: skip
        self.time_to_first_token = Histogram(
            "kvg_time_to_first_token_seconds", "From a request's arrival to its first token", registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )  # fmt: skip
        self.time_per_token = Histogram(
            "kvg_time_per_output_token_seconds", "Between consecutive tokens of a request", registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
        )  # fmt: skip


@dataclass
class ServerState:
    engine: Engine
    model_name: str
    chat_template: ChatTemplate | None = None  # None: the artifact has none, and the chat route refuses
    drain: Drain = field(default_factory=Drain)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)

    @property
    def tokenizer(self):
        return self.engine.model.tokenizer


@dataclass(frozen=True)
class Decoded:
    """An engine event with the text it makes final (a Prompt's: the prompt's, when echoed), decoded in the engine's
    thread; `stopped`: that text met a stop string, and nothing follows it."""

    event: Event
    text: str = ""
    stopped: bool = False


@dataclass
class Delta:
    text: str
    scored: list[TokenLogprob]  # log-probabilities of the tokens since the last delta (when the request asked)
    finish_reason: str | None = None


class Choice:
    """One prompt of a request, fed by the engine's thread through the event loop. `logprobs`: how many likeliest
    alternatives each token's log-probability comes with (None: no log-probabilities)."""

    def __init__(self, index: int, state: ServerState, arrived: float, stop: list[str], logprobs: int | None,
                 echo: bool):  # fmt: skip
        self.index, self.state, self.arrived = index, state, arrived
        self.logprobs, self.echo = logprobs, echo
        self.events: asyncio.Queue = asyncio.Queue()
        self.text = TextStream(state.tokenizer, stop) if state.tokenizer else None  # pushed in the engine's thread
        self.token_texts: dict[int, str] = {}  # of every token a log-probability entry names, filled in that thread
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
            prompt, config, lambda event: loop.call_soon_threadsafe(self.events.put_nowait, self.decode(event)),
            self.logprobs, self.echo,
        )  # fmt: skip

    def decode(self, event: Event) -> Decoded:
        """In the engine's thread: the text the event makes final, and the texts of the tokens its log-probability
        entries name."""
        text = ""
        if isinstance(event, Prompt):
            text = self.prompt_text
            self._name(event.logprobs or [])
        elif isinstance(event, Token):
            text = self.text.push(event.token) if self.text else ""
            self._name([event.logprob] if event.logprob else [])
        elif isinstance(event, Finished):
            text = self.text.flush() if self.text else ""
        return Decoded(event, text, bool(self.text and self.text.stopped))

    def _name(self, scored: list[TokenLogprob]) -> None:
        named = {entry.token for entry in scored} | {token for entry in scored for token, _ in entry.top}
        ids = sorted(named - self.token_texts.keys())
        self.token_texts.update(zip(ids, _token_texts(self.state.tokenizer, ids), strict=True))

    async def deltas(self) -> AsyncIterator[Delta]:
        """Deltas of text as tokens arrive, the last with its finish_reason; raises ApiError if the request fails.
        Tokens that arrived together (a step that accepted drafts, or steps the event loop fell behind) make one
        delta, as vLLM sends what each step made: a chunk costs the loop and the client more than a token costs
        the engine. Where log-probabilities are asked for, every token has a delta of its own, as in vLLM (its text
        may come in a later one: a token may complete no character, or be held back while it could begin a stop
        string)."""
        metrics, scored, text = self.state.metrics, [], ""
        while True:
            decoded = await self.events.get()
            event, now = decoded.event, time.perf_counter()
            if isinstance(event, Prompt):
                yield Delta(decoded.text, event.logprobs or [])
            elif isinstance(event, Token):
                self.tokens.append(event.token)
                metrics.generated_tokens.inc()
                if self.last_token_at is None:
                    metrics.time_to_first_token.observe(now - self.arrived)
                else:
                    metrics.time_per_token.observe(now - self.last_token_at)
                self.last_token_at = now
                scored += [event.logprob] if event.logprob else []
                text += decoded.text
                if decoded.stopped:
                    self.handle.cancel()
                    yield Delta(text, scored, "stop")
                    return
                if scored or (text and self.events.empty()):
                    yield Delta(text, scored)
                    scored, text = [], ""
            elif isinstance(event, Finished):
                yield Delta(text + decoded.text, scored, "stop" if decoded.stopped else event.reason)
                return
            elif isinstance(event, Failed):
                if text:
                    yield Delta(text, scored)
                raise ApiError(503, event.message, "server_error")

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()

    def logprobs_of(self, scored: list[TokenLogprob]) -> dict | None:
        """OpenAI's legacy `logprobs` object for these tokens, their offsets counted on from the last call's; None
        when the request did not ask for log-probabilities."""
        if self.logprobs is None:
            return None
        names = self.token_texts
        offsets = []
        for entry in scored:
            offsets.append(self.offset)
            self.offset += len(names[entry.token])
        return {
            "tokens": [names[entry.token] for entry in scored],
            "token_logprobs": [None if entry.logprob is None else finite(entry.logprob) for entry in scored],
            "top_logprobs": [None if entry.logprob is None else _top(entry, names) for entry in scored],
            "text_offset": offsets,
        }


def _token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's own text (as vLLM's `tokens`); `token_id:N` without a tokenizer (its return_tokens_as_token_ids)."""
    if tokenizer is None:
        return [f"token_id:{token}" for token in ids]
    return tokenizer.token_texts(ids)


def _top(entry: TokenLogprob, names: dict[int, str]) -> dict[str, float]:
    """Token text to log-probability, most likely first; of two tokens with the same text, the likelier one's."""
    top: dict[str, float] = {}
    for token, logprob in entry.top:
        top.setdefault(names[token], finite(logprob))
    return top


def finite(logprob: float) -> float:
    return max(logprob, LEAST_LOGPROB)


Parsed = TypeVar("Parsed", bound=GenerationRequest)


def parse(kind: type[Parsed], body: bytes) -> Parsed:
    try:
        return kind.model_validate_json(body)
    except ValidationError as error:
        raise RequestValidationError(error.errors()) from None


def check_model(request: GenerationRequest, model_name: str) -> None:
    if request.model is not None and request.model != model_name:
        raise ApiError(404, f"model {request.model!r} is not served here; GET /v1/models lists {model_name!r}",
                       param="model")  # fmt: skip


def generation_config(request: GenerationRequest, max_tokens: int) -> GenerationConfig:
    if request.min_tokens > max_tokens:
        raise ApiError(400, "min_tokens must not exceed max_tokens", param="min_tokens")
    sampling = SamplingConfig(
        request.temperature, request.top_k, request.top_p, request.repetition_penalty, request.seed,
        request.presence_penalty, request.frequency_penalty, request.token_biases(),
    )  # fmt: skip
    return GenerationConfig(max_tokens, request.min_tokens, sampling=sampling, constraint=request.constraint())


class Shape(Protocol):
    """How a route writes its answer: the id's prefix, the objects' names, and a choice as part of a whole
    answer or of a stream's chunk (`tokens`: the generated ids, with the whole answer and a stream's last chunk)."""

    id_prefix: str
    object: str
    chunk_object: str
    prompt_param: str  # the field a prompt the engine refuses is reported under

    def opening(self, choice: Choice) -> dict | None:
        """A streamed choice's chunk before its first delta, if the shape has one."""

    def whole(self, choice: Choice, delta: Delta, tokens: list[int]) -> dict: ...

    def chunk(self, choice: Choice, delta: Delta, tokens: list[int] | None) -> dict: ...


async def answer(
    http: Request, state: ServerState, request: GenerationRequest, shape: Shape, arrived: float,
    prompts: list[list[int]], texts: list[str], config: GenerationConfig, logprobs: int | None, echo: bool = False,
) -> Response:  # fmt: skip
    """Queue every prompt (`texts`: what an echo returns first) and answer, whole or streamed."""
    choices = [Choice(i, state, arrived, request.stops, logprobs, echo) for i in range(len(prompts))]
    _submit(state.engine, choices, prompts, texts, config, shape.prompt_param)
    metrics = state.metrics
    metrics.prompt_tokens.inc(sum(map(len, prompts)))
    head = {"id": f"{shape.id_prefix}{uuid.uuid4().hex}", "object": shape.object, "created": int(time.time()),
            "model": state.model_name}  # fmt: skip
    if request.stream:
        head["object"] = shape.chunk_object
        return EventSourceResponse(_stream(head, choices, shape, request.include_usage, metrics), ping=15)
    collected = asyncio.ensure_future(asyncio.gather(*(_collect(choice, shape) for choice in choices)))
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


def _submit(
    engine: Engine, choices: list[Choice], prompts: list[list[int]], texts: list[str], config: GenerationConfig,
    prompt_param: str,
) -> None:  # fmt: skip
    """All prompts checked before any is queued: a request with a bad prompt queues nothing."""
    try:
        for prompt in prompts:
            engine.check(prompt, config)
        for choice, prompt, text in zip(choices, prompts, texts, strict=True):
            choice.submit(prompt, text, config)
    except (RequestError, QueueFull, ShuttingDown) as refused:
        for choice in choices:
            choice.cancel()
        raise refusal(refused, prompt_param) from None


def refusal(error: RequestError | QueueFull | ShuttingDown, prompt_param: str) -> ApiError:
    """The answer to a request the engine refused: the request's fault (400, naming the field, the prompt under the
    route's own name), a busy server (429, to be retried) or one that is closing (503)."""
    if isinstance(error, QueueFull):
        return ApiError(429, f"the server is busy ({error}); retry after {RETRY_AFTER_S} s", "rate_limit_error",
                        headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
    if isinstance(error, ShuttingDown):
        return ApiError(503, str(error), "server_error")
    message = str(error).replace("max_new_tokens", "max_tokens")  # the runtime's name for the API's field
    return ApiError(400, message, param=prompt_param if error.param == "prompt" else error.param)


async def _client_gone(http: Request) -> None:
    """Returns once the client of a whole (not streamed) answer has disconnected."""
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


def _usage(choices: list[Choice]) -> dict:
    prompt, completion = sum(c.prompt_tokens for c in choices), sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _collect(choice: Choice, shape: Shape) -> dict:
    pieces, scored, finish_reason = [], [], None
    async for delta in choice.deltas():
        pieces.append(delta.text)
        scored += delta.scored
        finish_reason = delta.finish_reason
    return shape.whole(choice, Delta("".join(pieces), scored, finish_reason), choice.tokens)


async def _stream(head: dict, choices: list[Choice], shape: Shape, include_usage: bool, metrics: ServerMetrics):
    """Server-sent events: each choice's opening chunk if the shape has one, a chunk per text delta of any
    choice, each choice's last chunk with its finish reason, optionally the usage, then [DONE]. A client that
    goes away cancels every choice."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for delta in choice.deltas():
                await merged.put(shape.chunk(choice, delta, choice.tokens if delta.finish_reason else None))
        except ApiError as error:
            await merged.put(error)
        except Exception as error:  # a fault in shaping a chunk: the stream says so and ends, rather than hang
            await merged.put(ApiError(500, f"internal error: {error!r}", "server_error"))
        await merged.put(None)

    tasks = [asyncio.create_task(pump(choice)) for choice in choices]
    outcome = "cancelled"
    try:
        for choice in choices:
            if (opening := shape.opening(choice)) is not None:
                yield {"data": _json({**head, "choices": [opening]})}
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
