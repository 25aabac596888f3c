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

from runtime.cache.prefix_cache import PrefixCache
from runtime.cache.row_cache import RowCache
from runtime.decode.logprobs import chosen_logprob
from runtime.decode.model import Model
from runtime.decode.prompt_fill import Prefiller, PromptFill
from runtime.decode.requests import Event, Failed, Finished, Prompt, Request, Token
from runtime.decode.search import GenerationConfig, Proposer, Search
from runtime.decode.step import DecodeStep
from runtime.errors import ArtifactError, QueueFull, RequestError, ShuttingDown

NO_DRAFTS = np.zeros((1, 0), dtype=np.int64)
SPECULATIVE_MAX_ROWS = None  # each proposer's own `max_rows` (bench/README.md: speculative decoding)
PREFILL_BUDGET = 64  # prompt tokens prefilled between two decode steps, by default (bench/README.md: serving)
PREFIX_CACHE_MB = 256  # kvg-serve's memory for recent prompts' prefixes, by default


@dataclass(eq=False)
class _Running:
    """A request decoding in a row of its own."""

    request: Request
    search: Search  # of this request alone: its tokens are those it gets alone
    pending: list[int] = field(default_factory=list)  # to feed before its next choice: its latest token, and
    # with speculation in a model that shifts tokens, those it kept of a step it did not keep whole (RowCache.keep)

    @property
    def generated(self) -> list[int]:
        return self.search.tokens[0]

    @property
    def steps_left(self) -> int:
        """Decode steps the row may still take: each feeds its last token and yields the next."""
        return self.request.config.max_new_tokens - len(self.generated)

    def drafts(self, room: int) -> list[int]:
        """Up to `room` drafts for the row to verify (none while a prompt is prefilled: see `Engine._step`)."""
        speculating = self.request.config.speculative is not None and room > 0
        return self.search.drafts(room)[0].tolist() if speculating else []


def speculation_limit(running: list[tuple[int, _Running]], most: int | None) -> float:
    """The most rows running for a step to verify drafts: `most` (the engine's speculative_max_rows), else the least
    `max_rows` of the running requests' proposers."""
    if most is not None:
        return most
    proposers = (row.request.config.speculative for _, row in running)
    return min((proposer.max_rows for proposer in proposers if proposer is not None), default=math.inf)


def _steps(config: GenerationConfig) -> int:
    """Decode steps a request takes: each feeds a token back but the last new one (none when it asks for none)."""
    return max(config.max_new_tokens - 1, 0)


def _one_sequence(config: GenerationConfig) -> GenerationConfig:
    """`config`, which must ask for one sequence chosen token by token: the engine's rows hold one answer each."""
    if config.num_return_sequences != 1 or config.beams is not None:
        raise RequestError("the engine answers a request with one sequence, chosen token by token: submit one "
                           "request an answer, or search with beams in the Generator")  # fmt: skip
    return config


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
        `speculative`: how a request that names none drafts the tokens a step verifies (None: it does not);
        `speculative_max_rows`: the most rows running for a step to verify drafts (vLLM's
        speculative_disable_by_batch_size; None: the running requests' proposers' own `max_rows`, any number for
        prompt lookup and one for a draft model, which drafts a run a row): a batch reads the weights once for
        every row already, so where a model's step is the weights' reading, a wide step's extra tokens can cost
        more than they save once a few rows run. `clock`: the seconds that requests' deadlines are read on (a test
        gives its own)."""
        check_servable(model.artifact.folder, model.artifact.manifest, max_batch)
        if prefill_budget < 1:
            raise RequestError(f"the prefill budget must be at least 1 token a step, got {prefill_budget}")
        self.model, self.max_queue, self.timeout_s = model, max_queue, timeout_s
        self.speculative, self.speculative_max_rows = speculative, speculative_max_rows
        self.clock = clock
        self.filling: PromptFill | None = None
        self.prefixes = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.cache = RowCache(model.artifact, max_batch)
        self.prefiller = Prefiller(model, self.cache, prefill_budget, self.prefixes)
        self.running: list[_Running | None] = [None] * max_batch  # each row's decoding request (None: free)
        self.decode_step = DecodeStep(model.artifact, self.cache, model.artifact.session.run_with_iobinding)
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
        return sum(row is not None for row in self.running) + (self.filling is not None)

    def check(self, prompt: list[int], config: GenerationConfig) -> None:
        """Raise what `submit` would refuse the request for (RequestError), queueing nothing. A
        max_new_tokens of 0 prefills the prompt alone, to score it (see Request.echo)."""
        config = _one_sequence(self._speculating(config))
        if config.max_new_tokens == 0 and config.min_new_tokens:
            raise RequestError("min_new_tokens must be 0 when max_new_tokens is 0")
        self.model.check_request([prompt], replace(config, max_new_tokens=max(config.max_new_tokens, 1)))
        if config.speculative is not None:
            self.model.check_runs_of_tokens(self.cache.rows)
        needed = len(prompt) + self._reserved(_steps(config))
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

    def _reserved(self, steps: int) -> int:
        """The slots a row's `steps` decode steps are sure to need: all of them, or with pruning the next one's
        (at the end of the cache each row drops what it can; one that still needs more then fails, naming its
        head: see `_make_room`)."""
        return steps if self.model.pruning is None else min(steps, 1)

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
        left = [*self.waiting, *filling, *(row.request for row in self.running if row is not None)]
        self.waiting.clear()
        self.filling, self.running = None, [None] * len(self.running)
        for request in left:
            request.send(Failed(message))

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
                    filling.request.send(Failed(f"internal error: {error!r}"))
                self._fail_running(f"internal error: {error!r}")

    def _fail_running(self, message: str) -> None:
        for index, row in enumerate(self.running):
            if row is not None:
                self._free(index)
                row.request.send(Failed(message))

    def _free(self, index: int) -> None:
        self.running[index] = None
        self.cache.end_row(index)

    def _next_waiting(self) -> Request | None:
        """The oldest queued request still wanted, dropping those cancelled or past their deadline."""
        with self._wake:
            while self.waiting:
                request = self.waiting[0]
                if request.cancelled:
                    self.waiting.popleft()
                elif request.deadline is not None and self.clock() > request.deadline:
                    self.waiting.popleft()
                    request.send(Failed("the request timed out waiting for a free row"))
                else:
                    return request
        return None

    def _admit(self) -> None:
        """Start prefilling the oldest waiting request into a free row once it fits; one prefill at a time."""
        row = next((i for i, other in enumerate(self.running) if other is None and i != self._filling_row), None)
        if self.filling is not None or row is None or (request := self._next_waiting()) is None:
            return
        left = [other.steps_left for other in self.running if other is not None]
        reserved = max(self._reserved(steps) for steps in [*left, _steps(request.config)])
        self.filling = self.prefiller.place(request, row, reserved)
        if self.filling is not None:  # else it fits once running rows end: it stays first in the queue
            with self._wake:
                self.waiting.popleft()

    @property
    def _filling_row(self) -> int | None:
        return None if self.filling is None else self.filling.row

    def _fill(self) -> None:
        """Prefill the next chunk of the request being prefilled; after its last, the request joins decoding."""
        fill = self.filling
        request = fill.request
        if request.cancelled:
            self.filling = None
            return
        try:
            self.prefiller.feed(fill)
        except Exception as error:  # onnxruntime refused this request: it fails, the engine goes on
            self.filling = None
            request.send(Failed(f"prefill failed: {error}"))
            return
        logits = self.prefiller.take(fill)
        if not fill.whole:
            return
        self.filling = None
        if request.echo:
            request.send(Prompt(fill.scores if request.scores_prompt else None))
        if request.config.max_new_tokens > 0:
            self._join(fill, logits[:, -1])
        else:
            request.send(Finished("length", len(request.prompt), 0))

    def _join(self, filling: PromptFill, logits: np.ndarray) -> None:
        """A prefilled request's row, decoding from its first token on (chosen from the prompt's last `logits`)."""
        request, model = filling.request, self.model
        config, prompt = request.config, request.prompt
        thresholds = model.thresholds(len(prompt) + config.max_new_tokens - 1)
        search = Search(config, [prompt], model.eos, model.pad, model.grammar(config.constraint))
        self.running[filling.row] = _Running(request, search)
        self.cache.join(filling.row, thresholds)
        self._choose(filling.row, logits)

    @property
    def _decoding(self) -> bool:
        return any(row is not None for row in self.running)

    def _step(self) -> None:
        """One decode step over rows [0, last occupied]: each running row feeds its pending tokens and, speculating,
        its drafts (while no prompt is being prefilled, as its placement counts on a slot a step, and no more than
        `speculative_max_rows` run); free rows among them (and a row being prefilled) are fed padding and ignored."""
        self._drop_cancelled()
        running = [(index, row) for index, row in enumerate(self.running) if row is not None]
        speculating = self.filling is None and len(running) <= speculation_limit(running, self.speculative_max_rows)
        widest = max((len(row.pending) + row.search.budget for _, row in running), default=1)
        for index, error in self.cache.make_room(widest if speculating else 1):  # a row the cache has no room for
            request = self.running[index].request
            self._free(index)
            request.send(Failed(str(error)))
            running = [(other, row) for other, row in running if other != index]
        if not running:
            return
        room = self.cache.room if speculating else 1
        fed = {index: (row.pending + row.drafts(room - len(row.pending)))[:room]
               for index, row in running}  # fmt: skip
        width, count = max(map(len, fed.values())), max(fed) + 1
        ids = np.full((count, width), self.model.pad, dtype=np.int64)
        for index, tokens in fed.items():
            ids[index, : len(tokens)] = tokens
        try:
            logits = self.decode_step(ids)
        except Exception as error:  # nothing of this step is usable: its requests fail, later ones go on
            self._fail_running(f"decode step failed: {error}")
            return
        for index, tokens in fed.items():
            self._take(index, logits[index], tokens, width)
        if width > 1:
            self.cache.trim()

    def _take(self, index: int, logits: np.ndarray, fed: list[int], width: int) -> None:
        """A running row's tokens from a step that fed it `fed` (its pending tokens, then drafts) with its logits at
        each `[width, vocab]`: chosen from its last pending token's on while the draft before was chosen."""
        row = self.running[index]
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
        for index, row in enumerate(self.running):
            if row is not None and row.request.cancelled:
                self._free(index)

    def _choose(self, index: int, logits: np.ndarray, position: int = 0) -> np.ndarray | None:
        """The row's next token from its logits `[1, vocab]` (at `position` of a step's drafts), sent; None when the
        row is done (and freed) or cancelled."""
        row = self.running[index]
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
                scored = chosen_logprob(logits, token, config.sampling, request.logprobs, search.context, banned,
                                        search.generated)  # fmt: skip
        except Exception as error:  # a fault in one request's sampling fails that request only
            self._free(index)
            request.send(Failed(f"sampling failed: {error}"))
            return None
        search.record(chosen)
        if not request.send(Token(token, scored)):
            self._free(index)
            return None
        if not search.done and request.deadline is not None and self.clock() > request.deadline:
            search.end(0, "length")
        if search.done:
            self._free(index)
            self.drafts_proposed += search.proposed
            self.drafts_accepted += search.accepted
            request.send(Finished(search.reasons[0], len(request.prompt), len(row.generated)))
            return None
        row.pending = [token]
        return chosen
