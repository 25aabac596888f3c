"""The OpenAI-compatible HTTP API over a continuous-batching Engine: completions and chat completions (whole
or streamed as server-sent events), the model list, health and Prometheus metrics.

Bad input is answered with 400 and an OpenAI-style error body before anything is queued; a full queue with
429 and Retry-After (runtime/serving/answers.py answers both routes; runtime/serving/chat.py shapes the chat
route's answers).
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from runtime.artifact import SessionOptions, read_manifest
from runtime.decode.engine import PREFILL_BUDGET, PREFIX_CACHE_MB, SPECULATIVE_MAX_ROWS, Engine, check_servable
from runtime.decode.logprobs import MAX_TOP
from runtime.decode.model import Model
from runtime.decode.search import GenerationConfig
from runtime.errors import RequestError
from runtime.serving.answers import (
    ApiError,
    Choice,
    Delta,
    GenerationRequest,
    ServerState,
    answer,
    check_model,
    generation_config,
    parse,
)
from runtime.serving.chat import ChatRequest, ChatShape, chat_config, chat_prompt
from runtime.serving.drain import DEFAULT_GRACE_S, Drain, DrainGuard
from runtime.serving.http_guard import HttpGuard, body_limit, error_body
from runtime.speculative.prompt_lookup import PromptLookup
from runtime.speculative.proposers import check_choice, proposer
from runtime.text.chat_template import ChatTemplate

TokenIds = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(GenerationRequest):
    """OpenAI's completion request."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int = Field(16, ge=0)  # 0: the prompt alone, with `echo`
    best_of: Literal[1] | None = None
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP)


class CompletionShape:
    """A completion's choices: its `text`, the same whole and in chunks, log-probabilities in the legacy format."""

    id_prefix, object, chunk_object, prompt_param = "cmpl-", "text_completion", "text_completion", "prompt"

    def opening(self, _choice: Choice) -> None:
        return None

    def whole(self, choice: Choice, delta: Delta, tokens: list[int] | None) -> dict:
        answer = {"index": choice.index, "text": delta.text, "logprobs": choice.logprobs_of(delta.scored),
                  "finish_reason": delta.finish_reason}  # fmt: skip
        if tokens is not None:
            answer["token_ids"] = tokens  # an extension, as vLLM's: the tokens generated
        return answer

    chunk = whole


def _prompts(request: CompletionRequest, state: ServerState) -> tuple[list[list[int]], list[str]]:
    """Each prompt's token ids, and its text where an echo returns it ("" otherwise)."""
    prompt, tokenizer = request.prompt, state.tokenizer
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
        texts = [prompt] if isinstance(prompt, str) else prompt
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        return tokenizer.encode_batch(texts), texts
    ids = [prompt] if not prompt or isinstance(prompt[0], int) else prompt
    if not request.echo or tokenizer is None:
        return ids, [""] * len(ids)
    return ids, [tokenizer.decode(prompt, skip_special_tokens=False) for prompt in ids]


def _config(request: CompletionRequest) -> GenerationConfig:
    config = generation_config(request, request.max_tokens)
    if request.max_tokens == 0 and not request.echo:
        raise ApiError(400, "max_tokens 0 returns nothing without echo: ask for tokens, or echo", param="max_tokens")
    return config


COMPLETION, CHAT = CompletionShape(), ChatShape()


def create_app(
    engine: Engine, model_name: str, api_key: str | None = None, max_body_bytes: int | None = None,
    drain: Drain | None = None,
) -> FastAPI:  # fmt: skip
    """`api_key`: what the /v1 routes require as a bearer token (None: nothing); `max_body_bytes`: the cap on
    a request's body (None: `body_limit` of the artifact's max_cache_len and the engine's rows); `drain`: the
    shutdown that a signal starts (runtime/serving/drain.py)."""
    tokenizer = engine.model.tokenizer
    template = ChatTemplate.load(engine.model.artifact.folder, tokenizer) if tokenizer else None
    state = ServerState(engine, model_name, template, drain or Drain())

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        engine.close()

    app = FastAPI(title="kvg-serve", lifespan=lifespan)
    app.state.kvg = state
    limit = body_limit(engine.cache.length, engine.cache.rows) if max_body_bytes is None else max_body_bytes
    _guard(app, state, api_key, limit)
    _measure(state)
    _answer_errors(app, state)
    _add_status_routes(app, state)
    _add_generation_routes(app, state)
    return app


def _guard(app: FastAPI, state: ServerState, api_key: str | None, max_body_bytes: int) -> None:
    """The middleware that refuses a request before any route reads it: a draining server, a missing or wrong key,
    a body over the cap."""
    refused = state.metrics.requests.labels  # a refusal before the body is read counts as any request's error does
    app.add_middleware(HttpGuard, api_key=api_key, max_body_bytes=max_body_bytes,
                       refused=lambda status: refused(outcome=f"http_{status}").inc())  # fmt: skip
    app.add_middleware(DrainGuard, drain=state.drain)  # the outermost: a draining server refuses before all else


def _measure(state: ServerState) -> None:
    """The drain's counts, and the gauges that read the engine when Prometheus scrapes them (never stale)."""
    engine, metrics = state.engine, state.metrics
    state.drain.on_drained, state.drain.on_cut = metrics.drained.inc, metrics.cut.inc
    metrics.queue_depth.set_function(lambda: engine.queue_depth)
    metrics.batch_occupancy.set_function(lambda: engine.busy_rows / engine.cache.rows)
    if engine.prefixes is not None:
        metrics.prefix_hit_rate.set_function(lambda: engine.prefixes.hit_rate)
        metrics.prefix_bytes.set_function(lambda: engine.prefixes.held_bytes)
    if engine.speculative is not None:
        metrics.drafts_proposed.set_function(lambda: engine.drafts_proposed)
        metrics.drafts_accepted.set_function(lambda: engine.drafts_accepted)
        metrics.draft_acceptance.set_function(lambda: engine.drafts_accepted / max(engine.drafts_proposed, 1))


def _answer_errors(app: FastAPI, state: ServerState) -> None:
    """Every error answered with an OpenAI-style body, as clients of OpenAI's API parse it; a refused request (an
    ApiError or a body that does not validate) counted by its status."""
    metrics = state.metrics

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


def _add_status_routes(app: FastAPI, state: ServerState) -> None:
    """The routes that report on the server rather than generate: its health, the model it serves, its metrics."""
    engine, model_name, metrics = state.engine, state.model_name, state.metrics

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.drain.draining:  # a load balancer sends no more
            return JSONResponse({"status": "draining"}, 503)
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


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    """The completion and chat completion routes. Parsing and tokenizing take a thread of their own, so that a
    large body never stalls the event loop; runtime/serving/answers.py answers both."""
    engine, model_name = state.engine, state.model_name

    @app.post("/v1/completions")
    async def completions(http: Request) -> Response:
        arrived = time.perf_counter()
        request = await run_in_threadpool(parse, CompletionRequest, await http.body())
        check_model(request, model_name)
        config = _config(request)
        prompts, texts = await run_in_threadpool(_prompts, request, state)
        return await answer(http, state, request, COMPLETION, arrived, prompts, texts, config, request.logprobs,
                            request.echo)  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request) -> Response:
        arrived = time.perf_counter()
        request = await run_in_threadpool(parse, ChatRequest, await http.body())
        check_model(request, model_name)
        alternatives = request.alternatives()
        prompt = await run_in_threadpool(chat_prompt, request, state)
        config = chat_config(request, prompt, engine.cache.length, state.chat_template.stop_tokens)
        return await answer(http, state, request, CHAT, arrived, [prompt], [""], config, alternatives)


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
    prefix_cache_mb: int = PREFIX_CACHE_MB  # memory for recent prompts' prefixes (0: no prefix cache)
    shutdown_grace_s: float = DEFAULT_GRACE_S  # how long a signal's drain lets requests in flight finish
    speculative: str | None = None  # "ngram" or a draft artifact's folder: every request speculates (None: none)
    draft_tokens: int | None = None  # the most drafts a step verifies (None: the proposer's default)
    lookup_ngram: int = PromptLookup.ngram
    lookup_min_ngram: int = PromptLookup.min_ngram
    speculative_max_rows: int | None = SPECULATIVE_MAX_ROWS  # the most rows running for a step to verify drafts

    @property
    def name(self) -> str:
        return self.model_name or Path(self.artifact).resolve().name

    def check(self) -> None:
        """Refuse what cannot be served before any model is loaded (or any replica started)."""
        if self.timeout_s <= 0 or self.max_queue < 0:
            raise RequestError("--timeout must be > 0 and --max-queue >= 0")
        if self.api_key == "" or (self.max_body_bytes is not None and self.max_body_bytes < 1):
            raise RequestError("--api-key must not be empty and --max-body-bytes must be >= 1")
        if self.prefill_budget < 1 or self.prefix_cache_mb < 0:
            raise RequestError("--prefill-budget must be >= 1 and --prefix-cache-mb >= 0")
        if self.shutdown_grace_s < 0:
            raise RequestError("--shutdown-grace must be >= 0 seconds")
        if self.speculative is not None:
            check_choice(self.speculative)
        if self.speculative_max_rows is not None and self.speculative_max_rows < 0:
            raise RequestError("--speculative-max-rows must be >= 0")
        folder = Path(self.artifact)
        check_servable(folder, read_manifest(folder), self.max_batch)


def open_app(options: ServeOptions) -> FastAPI:
    sessions = SessionOptions(options.provider, options.threads)
    model = Model.open(options.artifact, sessions)
    ngrams = options.lookup_ngram, options.lookup_min_ngram
    speculative = proposer(options.speculative, options.draft_tokens, ngrams, sessions)
    engine = Engine(model, options.max_batch, options.max_queue, options.timeout_s, options.prefill_budget,
                    options.prefix_cache_mb << 20, speculative, options.speculative_max_rows)  # fmt: skip
    return create_app(engine, options.name, options.api_key, options.max_body_bytes, Drain(options.shutdown_grace_s))
