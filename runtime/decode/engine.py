"""Continuous batching: one loop serves many requests at once over a static artifact's cache rows.

The engine is a scheduler and a runner (vLLM's schedule, execute, update): each turn of its loop admits the
oldest waiting request once a row is free and its tokens fit, runs one decode step over the running rows and one
prompt chunk, and hands each row's logits to its request's Search. Where the tokens lie is the RowCache's.

A request waits in a bounded queue until a row is free and its tokens fit in the cache, is prefilled into
that row alone (on the shared slot clock, see RowCache), a chunk of at most `prefill_budget` tokens between two
decode steps of the others, from the longest prefix of a recent prompt that it shares (see PrefixCache), and
then joins the decode steps, which run every occupied row at once. A row that finishes, is cancelled or runs
past its deadline is freed before the next step, so nobody waits for the longest request. Each request samples
with its own Sampler, so its tokens are those it gets alone.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from runtime.cache.prefix_cache import Block, PrefixCache
from runtime.cache.row_cache import RowCache
from runtime.decode.logprobs import TokenLogprob, chosen_logprob, prompt_logprobs
from runtime.decode.model import Model
from runtime.decode.prefill import bind_chunk, chunk_size, chunk_spans
from runtime.decode.search import GenerationConfig, Proposer, Search
from runtime.decode.step import DecodeStep
from runtime.errors import ArtifactError, QueueFull, RequestError, ShuttingDown


@dataclass(frozen=True)
class Token:
    token: int
    logprob: TokenLogprob | None = None  # when the request asked for log-probabilities


@dataclass(frozen=True)
class Prompt:
    """Sent before any Token to a request that echoes its prompt: the prompt's tokens with their log-probabilities,
    if it asked for them (else None)."""

    logprobs: list[TokenLogprob] | None


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (a stop token), "length" (max_new_tokens, or the deadline) or "cancelled"
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    message: str


Event = Prompt | Token | Finished | Failed
NO_DRAFTS = np.zeros((1, 0), dtype=np.int64)
SPECULATIVE_MAX_ROWS = None  # each proposer's own `rows` (bench/README.md: speculative decoding)
PREFILL_BUDGET = 64  # prompt tokens prefilled between two decode steps, by default (bench/README.md: serving)
PREFIX_CACHE_MB = 256  # kvg-serve's memory for recent prompts' prefixes, by default


@dataclass(eq=False)
class Request:
    prompt: list[int]
    config: GenerationConfig
    emit: Callable[[Event], None]  # called from the engine's thread: Tokens, then one Finished or Failed
    deadline: float | None  # the engine's clock (time.monotonic()) past which the request ends
    logprobs: int | None = None  # alternatives to report with each token's log-probability; None: no log-probabilities
    echo: bool = False  # send a Prompt event first; max_new_tokens may then be 0
    cancelled: bool = False

    def cancel(self) -> None:
        """Free the request's row (or queue place) before the next step; it emits nothing more."""
        self.cancelled = True


@dataclass(eq=False)
class _Row:
    request: Request
    search: Search  # of this request alone: its tokens are those it gets alone
    pending: list[int] = field(default_factory=list)  # to feed before its next choice: its latest token, and
    # with speculation in a model that shifts tokens, those it kept of a step it did not keep whole (RowCache.keep)

    @property
    def generated(self) -> list[int]:
        return self.search.tokens[0]

    @property
    def feeds_left(self) -> int:
        """Decode steps the row may still take: each feeds its last token and yields the next."""
        return self.request.config.max_new_tokens - len(self.generated)


@dataclass(eq=False)
class _Filling:
    """A request being prefilled, a chunk between two decode steps, into a row of its own."""

    request: Request
    row: int
    spans: list[tuple[int, int]]  # the chunks' [begin, end) in the prompt
    scores: list[TokenLogprob]  # the prompt's log-probabilities so far, where the request echoes them
    resumed: int = 0  # the prompt's tokens a cached prefix supplied, before the first chunk
    done: int = 0  # chunks prefilled


def _feeds(config: GenerationConfig) -> int:
    """Decode steps a request takes: each feeds a token back but the last new one (none when it asks for none)."""
    return max(config.max_new_tokens - 1, 0)


def check_servable(folder: Path, manifest: dict, max_batch: int) -> None:
    """Refuse an artifact the engine cannot batch, naming the fix."""
    if manifest["cache"]["kind"] != "static":
        raise ArtifactError(
            f"{folder} has a dynamic cache; continuous batching needs a static one: re-export with --cache static"
        )
    limit = manifest["cache"]["max_batch"]
    if not 1 <= max_batch <= limit:
        raise RequestError(
            f"--max-batch {max_batch} is outside [1, {limit}], the batch this artifact was exported for; "
            "re-export with a larger --max-batch"
        )


class Engine:
    """Owns the cache rows and the loop; `submit` may be called from any thread."""

    def __init__(
        self, model: Model, max_batch: int, max_queue: int = 64, timeout_s: float | None = None,
        prefill_budget: int = PREFILL_BUDGET, prefix_cache_bytes: int = 0, speculative: Proposer | None = None,
        speculative_max_rows: int | None = SPECULATIVE_MAX_ROWS, clock: Callable[[], float] = time.monotonic,
    ):  # fmt: skip
        """`prefill_budget`: prompt tokens prefilled between two decode steps (a waiting request's prompt is
        prefilled in chunks of at most that many, so the running rows wait at most one chunk a step);
        `prefix_cache_bytes`: the memory recent prompts' prefixes may keep (0: none; runtime/cache/prefix_cache.py);
        `speculative`: how a request that names none guesses the tokens a step verifies (None: it does not);
        `speculative_max_rows`: the most rows running for a step to verify drafts (vLLM's
        speculative_disable_by_batch_size; None: the running requests' proposers' own `rows`, any number for
        prompt lookup and one for a draft model, which guesses a run a row): a batch reads the weights once for
        every row already, so where a model's step is the weights' reading, a wide step's extra tokens can cost
        more than they save once a few rows run. `clock`: the seconds that requests' deadlines are read on (a test
        gives its own)."""
        check_servable(model.artifact.folder, model.artifact.manifest, max_batch)
        if prefill_budget < 1:
            raise RequestError(f"the prefill budget must be at least 1 token a step, got {prefill_budget}")
        self.model, self.max_queue, self.timeout_s = model, max_queue, timeout_s
        self.speculative, self.speculative_max_rows = speculative, speculative_max_rows
        self.prefill_budget, self.clock = prefill_budget, clock
        self.filling: _Filling | None = None
        self.prefixes = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self._prefill_binding = model.artifact.session.io_binding()
        self.cache = RowCache(model.artifact, max_batch)
        self.rows: list[_Row | None] = [None] * max_batch
        self.decode_one_token = DecodeStep(model.artifact, self.cache, model.artifact.session.run_with_iobinding)
        self.drafts_proposed = self.drafts_accepted = 0  # by the requests that ended, for /metrics
        self.waiting: deque[Request] = deque()
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="kvg-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def busy_rows(self) -> int:
        """Rows decoding or being prefilled."""
        return sum(row is not None for row in self.rows) + (self.filling is not None)

    def check(self, prompt: list[int], config: GenerationConfig) -> None:
        """Raise what `submit` would refuse the request for (RequestError), queueing nothing. A
        max_new_tokens of 0 prefills the prompt alone, to score it (see Request.echo)."""
        config = self._speculating(config)
        if config.max_new_tokens == 0 and config.min_new_tokens:
            raise RequestError("min_new_tokens must be 0 when max_new_tokens is 0")
        self.model.check_request([prompt], replace(config, max_new_tokens=max(config.max_new_tokens, 1)))
        if config.speculative is not None:
            self.model.check_runs_of_tokens(self.cache.rows)
        needed = len(prompt) + self._reserved(_feeds(config))
        if self.model.pruning is not None and needed > self.cache.length:  # else check_request saw to it
            raise RequestError(
                f"prompt ({len(prompt)} tokens) and the next {needed - len(prompt)} new ones need {needed} cache "
                f"slots before pruning can free any, over this artifact's max_cache_len {self.cache.length}; "
                "shorten it or re-export with a larger --max-cache-len",
                "prompt",
            )

    def _speculating(self, config: GenerationConfig) -> GenerationConfig:
        """The request as the engine runs it: with the engine's speculation unless it names its own."""
        if self.speculative is None or config.speculative is not None:
            return config
        return replace(config, speculative=self.speculative)

    def _reserved(self, feeds: int) -> int:
        """The slots a row's `feeds` decode steps are sure to need: all of them, or with pruning the next one's
        (at the end of the cache each row drops what it can; one that still needs more then fails, naming its
        head: see `_make_room`)."""
        return feeds if self.model.pruning is None else min(feeds, 1)

    def submit(
        self, prompt: list[int], config: GenerationConfig, emit: Callable[[Event], None],
        logprobs: int | None = None, echo: bool = False,
    ) -> Request:  # fmt: skip
        """Queue a request; refuses at once what cannot run (RequestError), a full queue (QueueFull) and any request
        once the engine closes (ShuttingDown)."""
        self.check(prompt, config)
        config = self._speculating(config)
        deadline = None if self.timeout_s is None else self.clock() + self.timeout_s
        request = Request(list(prompt), config, emit, deadline, logprobs, echo)
        with self._wake:
            if self._closing:
                raise ShuttingDown("the engine is shutting down")
            if len(self.waiting) + self.busy_rows >= self.cache.rows + self.max_queue:
                raise QueueFull(f"all {self.cache.rows} rows are busy and {len(self.waiting)} requests wait")
            self.waiting.append(request)
            self._wake.notify()
        return request

    def close(self, message: str = "the server is shutting down") -> None:
        """Stop the loop; requests still queued or running get a Failed event with `message`."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join()
        filling = [self.filling.request] if self.filling is not None else []
        left = [*self.waiting, *filling, *(row.request for row in self.rows if row is not None)]
        self.waiting.clear()
        self.filling, self.rows = None, [None] * len(self.rows)
        for request in left:
            self._send(request, Failed(message))

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closing and not self.waiting and not self.busy_rows:
                    self._wake.wait()
                if self._closing:
                    return
            try:
                self._admit()
                if self._decoding:
                    self._step()
                if self.filling is not None:
                    self._fill()
            except Exception as error:  # a fault of the engine's own: the running requests fail, the loop goes on
                if self.filling is not None:
                    filling, self.filling = self.filling, None
                    self._send(filling.request, Failed(f"internal error: {error!r}"))
                self._fail_running(f"internal error: {error!r}")

    def _fail_running(self, message: str) -> None:
        for index, row in enumerate(self.rows):
            if row is not None:
                self._free(index)
                self._send(row.request, Failed(message))

    def _free(self, index: int) -> None:
        self.rows[index] = None
        self.cache.leave(index)

    @staticmethod
    def _send(request: Request, event: Event) -> bool:
        """Deliver an event; a consumer that raises fails its own request only."""
        try:
            request.emit(event)
            return True
        except Exception:  # the consumer is gone or broken: its request ends, the others go on
            request.cancel()
            return False

    def _next_waiting(self) -> Request | None:
        """The oldest queued request still wanted, dropping those cancelled or past their deadline."""
        with self._wake:
            while self.waiting:
                request = self.waiting[0]
                if request.cancelled:
                    self.waiting.popleft()
                elif request.deadline is not None and self.clock() > request.deadline:
                    self.waiting.popleft()
                    self._send(request, Failed("the request timed out waiting for a free row"))
                else:
                    return request
        return None

    def _admit(self) -> None:
        """Start prefilling the oldest waiting request into a free row once it fits; one prefill at a time."""
        row = next((i for i, other in enumerate(self.rows) if other is None and i != self._filling_row), None)
        if self.filling is not None or row is None or (request := self._next_waiting()) is None:
            return
        prompt = request.prompt
        blocks = self._cached_prefix(request)
        resumed = blocks[-1].end if blocks else 0
        spans = [(resumed + b, resumed + e) for b, e in chunk_spans(len(prompt) - resumed, self._chunk(request.config))]
        running = [other.feeds_left for other in self.rows if other is not None]
        reserved = max(self._reserved(feeds) for feeds in [*running, _feeds(request.config)])
        if not self.cache.place(row, len(prompt), len(spans), reserved):
            return  # it fits once running rows end: it stays first in the queue
        with self._wake:
            self.waiting.popleft()
        self.filling = _Filling(request, row, spans, [TokenLogprob(prompt[0], None)], resumed)
        if blocks:
            self.cache.restore(row, blocks)

    def _cached_prefix(self, request: Request) -> list[Block]:
        """The cached blocks a request's prefill may start from: none for a request that scores its prompt (every
        position's logits are needed), and at least its last token is prefilled (for the first new one's logits)."""
        if self.prefixes is None or (request.echo and request.logprobs is not None):
            return []
        return self.prefixes.longest(request.prompt, len(request.prompt) - 1)

    def _chunk(self, config: GenerationConfig) -> int:
        """Prompt tokens a prefill run takes: the budget between two decode steps, or fewer (see chunk_size)."""
        return chunk_size(self.model.artifact, 1, self.cache.length, min(self.prefill_budget, config.prefill_chunk))

    @property
    def _filling_row(self) -> int | None:
        return None if self.filling is None else self.filling.row

    def _fill(self) -> None:
        """Prefill the next chunk of the request being prefilled (where the cache placed it, see RowCache.place and
        prepare_chunk); after its last, the request joins decoding."""
        filling, session = self.filling, self.model.artifact.session
        request, binding = filling.request, self._prefill_binding
        config, prompt = request.config, request.prompt
        if request.cancelled:
            self.filling = None
            return
        span = start, end = filling.spans[filling.done]
        slot, mask = self.cache.prepare_chunk(filling.row, span)
        scoring = request.echo and request.logprobs is not None  # every position's logits, to score the prompt
        ids = np.array([prompt[start:end]], dtype=np.int64)
        try:
            bind_chunk(binding, self.model.artifact, ids, mask, slot, self.cache.device, not scoring)
            self.cache.bind_row(binding, filling.row, filling.done, len(filling.spans), filling.resumed > 0)
            session.run_with_iobinding(binding)
        except Exception as error:  # onnxruntime refused this request: it fails, the engine goes on
            self.filling = None
            self._send(request, Failed(f"prefill failed: {error}"))
            return
        if self.prefixes is not None and end - start == self._chunk(config):  # a whole chunk: where others resume
            slots, states = self.cache.read_chunk(filling.row, span, filling.done, len(filling.spans))
            self.prefixes.add(prompt, Block(end, start, slots, states))
        if scoring:
            chunk = binding.get_outputs()[0].numpy()[0]
            filling.scores += prompt_logprobs(chunk, prompt, start, config.sampling, request.logprobs)
        filling.done += 1
        if filling.done == len(filling.spans):
            self.filling = None
            if request.echo:
                self._send(request, Prompt(filling.scores if scoring else None))
            if config.max_new_tokens > 0:
                self._join(filling, binding.get_outputs()[0].numpy()[:, -1])
            else:
                self._send(request, Finished("length", len(prompt), 0))

    def _join(self, filling: _Filling, logits: np.ndarray) -> None:
        """A prefilled request's row, decoding from its first token on (chosen from the prompt's last `logits`)."""
        request, model = filling.request, self.model
        config, prompt = request.config, request.prompt
        thresholds = model.thresholds(len(prompt) + config.max_new_tokens - 1)
        search = Search(config, [prompt], model.eos, model.pad, model.grammar(config.constraint))
        self.rows[filling.row] = _Row(request, search)
        self.cache.join(filling.row, thresholds)
        self._choose(filling.row, logits)

    @property
    def _decoding(self) -> bool:
        return any(row is not None for row in self.rows)

    def _step(self) -> None:
        """One decode step over rows [0, last occupied]: each running row feeds its pending tokens and, speculating,
        its drafts (while no prompt is being prefilled, as its placement counts on a slot a step, and no more than
        `speculative_max_rows` run); free rows among them (and a row being prefilled) are fed padding and ignored."""
        self._drop_cancelled()
        running = [(index, row) for index, row in enumerate(self.rows) if row is not None]
        speculating = self.filling is None and len(running) <= self._speculation_limit(running)
        widest = max((len(row.pending) + row.search.budget for _, row in running), default=1)
        for index, error in self.cache.before_step(widest if speculating else 1):  # a row the cache has no room for
            request = self.rows[index].request
            self._free(index)
            self._send(request, Failed(str(error)))
            running = [(other, row) for other, row in running if other != index]
        if not running:
            return
        room = self.cache.room if speculating else 1
        fed = {index: (row.pending + self._drafts(row, room - len(row.pending)))[:room]
               for index, row in running}  # fmt: skip
        width, count = max(map(len, fed.values())), max(fed) + 1
        ids = np.full((count, width), self.model.pad, dtype=np.int64)
        for index, tokens in fed.items():
            ids[index, : len(tokens)] = tokens
        try:
            logits = self.decode_one_token(ids)
        except Exception as error:  # nothing of this step is usable: its requests fail, later ones go on
            self._fail_running(f"decode step failed: {error}")
            return
        for index, tokens in fed.items():
            self._take(index, logits[index], tokens, width)
        if width > 1:
            self.cache.trim()

    def _speculation_limit(self, running: list[tuple[int, _Row]]) -> float:
        """The most rows running for a step to verify drafts: speculative_max_rows, else the least `rows` of the
        running requests' proposers."""
        if self.speculative_max_rows is not None:
            return self.speculative_max_rows
        proposers = (row.request.config.speculative for _, row in running)
        return min((proposer.rows for proposer in proposers if proposer is not None), default=math.inf)

    @staticmethod
    def _drafts(row: _Row, room: int) -> list[int]:
        """Up to `room` drafts for the row to verify (none while a prompt is prefilled: see `_step`)."""
        return row.search.drafts(room)[0].tolist() if row.request.config.speculative is not None and room > 0 else []

    def _take(self, index: int, logits: np.ndarray, fed: list[int], width: int) -> None:
        """A running row's tokens from a step that fed it `fed` (its pending tokens, then drafts) with its logits at
        each `[width, vocab]`: chosen from its last pending token's on while the draft before was chosen."""
        row = self.rows[index]
        pending = len(row.pending)
        if pending > width:  # no room for all it must feed again: the rest goes first next step
            row.pending = row.pending[width:]
            return
        drafts = np.array([fed[pending:]], dtype=np.int64) if len(fed) > pending else NO_DRAFTS
        for position in range(drafts.shape[1] + 1):
            chosen = self._choose(index, logits[pending - 1 + position][None], position)
            if chosen is None:
                return
            if not row.search.accepts(chosen, drafts, position):
                break
        again = self.cache.keep(pending + position, index)
        if again:  # else `_choose` left the latest token alone pending
            row.pending = [*fed[:again], *row.pending]

    def _drop_cancelled(self) -> None:
        for index, row in enumerate(self.rows):
            if row is not None and row.request.cancelled:
                self._free(index)

    def _choose(self, index: int, logits: np.ndarray, position: int = 0) -> np.ndarray | None:
        """The row's next token from its logits `[1, vocab]` (at `position` of a step's drafts), sent; None when the
        row is done (and freed) or cancelled."""
        row = self.rows[index]
        request, config = row.request, row.request.config
        if request.cancelled:
            self._free(index)
            return None
        search = row.search
        try:
            banned = search.banned
            chosen = search.choose(logits, position)
            token = int(chosen[0])
            scored = None
            if request.logprobs is not None:
                scored = chosen_logprob(logits, token, config.sampling, request.logprobs, search.context, banned)
        except Exception as error:  # a fault in one request's sampling fails that request only
            self._free(index)
            self._send(request, Failed(f"sampling failed: {error}"))
            return None
        search.record(chosen)
        if not self._send(request, Token(token, scored)):
            self._free(index)
            return None
        if not search.done and request.deadline is not None and self.clock() > request.deadline:
            search.end(0, "length")
        if search.done:
            self._free(index)
            self.drafts_proposed += search.proposed
            self.drafts_accepted += search.accepted
            self._send(request, Finished(search.reasons[0], len(request.prompt), len(row.generated)))
            return None
        row.pending = [token]
        return chosen
