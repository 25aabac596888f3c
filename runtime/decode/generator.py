"""The decode loop (gpt-fast's `generate`): prefill, then one token per step for every row, with the cache kept on
the device.

Prompts of different lengths are left-padded into one batch; a row that meets a stop token stops
growing (it is fed padding, masked out, from then on). Tokens are streamed as they are chosen.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.artifact import SessionOptions
from runtime.cache.device_cache import DeviceCache
from runtime.cache.pruning import AS_EXPORTED, Tolerance
from runtime.decode.beam_search import Beams
from runtime.decode.model import Model
from runtime.decode.prefill import SessionClock, left_padded, prefill
from runtime.decode.search import GenerationConfig, Search
from runtime.decode.step import DecodeStep, fitted
from runtime.text.text_stream import TextStream

IDLE_CACHES = 4  # caches kept for later calls once the calls that used them have ended, most recent first


@dataclass
class TokenEvent:
    row: int
    token: int
    text: str  # the text this token completes ("" without a tokenizer, or mid-character)


@dataclass
class GenerationResult:
    tokens: list[list[int]]
    text: list[str] | None
    finish_reasons: list[str]  # "stop" or "length"
    time_to_first_token_s: float
    decode_tokens_per_s: float
    steps: int
    onnxruntime_s: float  # time inside session runs; the rest of the wall time is the loop's own
    decode_onnxruntime_s: float  # the part of onnxruntime_s spent in decode steps (after the first token)
    wall_s: float
    pruned_positions: list[list[int]]  # per layer and kv head, the oldest positions pruning dropped by the end
    drafts_proposed: int = 0  # with speculation: the drafts verified (per row: rows verify as many at once)
    drafts_accepted: int = 0  # and those chosen
    step_logits: list[np.ndarray] = field(default_factory=list, repr=False)  # when asked: [batch, vocab] per step


class Generator:
    """Generation over one Model; device buffers are kept between calls while the batch size allows.

    Calls may overlap (threads sharing one Generator, or streams read in turns): each call holds a cache of
    its own for as long as it runs, taken from those earlier calls left or newly allocated (or the one the caller
    gives), and onnxruntime runs one session for several callers at once. A call never shares its buffers with
    another.
    """

    def __init__(self, model: Model):
        self.model = model
        self._idle: list[DeviceCache] = []  # caches no call holds, the most recently freed last
        self._idle_lock = threading.Lock()

    @classmethod
    def open(
        cls, folder: str | Path, options: SessionOptions | None = None, log_pruning_tolerance: Tolerance = AS_EXPORTED
    ) -> Generator:  # fmt: skip
        return cls(Model.open(folder, options, log_pruning_tolerance))

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        config: GenerationConfig = GenerationConfig(),
        on_token: Callable[[TokenEvent], None] | None = None,
        keep_logits: bool = False,
        cache: DeviceCache | None = None,
    ) -> GenerationResult:
        """`cache`: the one to decode into (as transformers' generate takes `past_key_values`); by default one this
        Generator keeps."""
        steps = self._run(self.model.encode(prompts), config, keep_logits, on_token is not None, cache)
        while True:
            try:
                event = next(steps)
            except StopIteration as done:
                return done.value
            if on_token is not None:
                on_token(event)

    def stream(
        self, prompts, config: GenerationConfig = GenerationConfig(), cache: DeviceCache | None = None
    ) -> Iterator[TokenEvent]:  # fmt: skip
        """Yield each token as it is chosen; the generator's return value is the GenerationResult."""
        return self._run(self.model.encode(prompts), config, False, True, cache)

    @contextmanager
    def _held_cache(self, batch: int, given: DeviceCache | None) -> Iterator[DeviceCache]:
        """A cache for `batch` rows that no other call holds while the block runs: the one `given`, an idle one, or a
        new one, each reset; kept for later calls afterwards unless given."""
        cache = given
        if cache is None:
            with self._idle_lock:
                cache = next((c for c in reversed(self._idle) if c.batch == batch), None)
                if cache is not None:
                    self._idle.remove(cache)
        if cache is None:
            cache = DeviceCache(self.model.artifact, batch)
        else:
            cache.reset()
        try:
            yield cache
        finally:
            if given is None:
                with self._idle_lock:
                    self._idle = [*self._idle, cache][-IDLE_CACHES:]

    def _run(
        self, prompts: list[list[int]], config: GenerationConfig, keep_logits: bool, text_events: bool,
        given: DeviceCache | None,
    ):  # fmt: skip
        """The token events of one call, then its GenerationResult; the call holds its cache until it ends (or
        its stream is closed or dropped)."""
        self.model.check_request(prompts, config)
        if config.beams is not None:
            with self._held_cache(len(prompts) * config.beams.num_beams, given) as cache:
                return self._beam_search(prompts, config, cache)
        with self._held_cache(len(prompts) * config.num_return_sequences, given) as cache:
            return (yield from self._decode(prompts, config, keep_logits, text_events, cache))

    def _decode(
        self, prompts: list[list[int]], config: GenerationConfig, keep_logits: bool, text_events: bool,
        cache: DeviceCache,
    ):  # fmt: skip
        """gpt-fast's decode_n_tokens: prefill; choose and emit a token a row from each position of the latest run
        while the drafts fed before it were chosen; feed the last chosen with the next drafts (gpt-fast's
        `decode_one_token`, a DecodeStep: with none)."""
        model, artifact = self.model, self.model.artifact
        start = time.perf_counter()
        run = SessionClock(artifact.session)
        prompts, ids, logits = self._prefill(prompts, config, cache, run, config.num_return_sequences)
        prefill_s, first_token_s, step_logits = run.seconds, None, []
        search = Search(config, prompts, model.eos, model.pad, model.grammar(config.constraint))
        texts = [TextStream(model.tokenizer) for _ in prompts] if text_events and model.tokenizer else None
        decode_step = DecodeStep(artifact, cache, run)
        fed, lead, outputs = ids[:, -1:], 0, logits[:, None]  # the latest run's tokens (`lead` of them fed again)
        while True:  # and its logits at each position after those
            drafts = fed[:, lead + 1 : lead + outputs.shape[1]]
            for index in range(outputs.shape[1]):
                if keep_logits:
                    step_logits.append(outputs[:, index].copy())
                chosen = search.choose(outputs[:, index], index)
                first_token_s = time.perf_counter() - start if first_token_s is None else first_token_s
                for row, token, last in search.record(chosen):
                    yield TokenEvent(row, token, texts[row].push(token, last) if texts else "")
                    if last:
                        cache.end_row(row, index)
                if not search.accepts(chosen, drafts, index):
                    break
            lead = cache.keep(index + 1)  # where the model shifts tokens, the next run feeds those kept again
            if search.done:
                break
            drafts, latest = search.drafts(), chosen[:, None]  # one step: the tokens fed again, the latest, its drafts
            fed = np.concatenate([fed[:, :lead], latest, drafts], axis=1) if lead or drafts.size else latest
            outputs = decode_step(fitted(cache, fed))[:, lead:]
        return self._result(search, cache, run, time.perf_counter() - start, first_token_s, prefill_s, step_logits)

    def _beam_search(self, prompts: list[list[int]], config: GenerationConfig, cache: DeviceCache) -> GenerationResult:
        """Beam search (runtime/decode/beam_search.py): each prompt prefilled once and forked into its beams' rows,
        which are copied over one another as beams take each other's places; returns the best answers, no events."""
        start, run = time.perf_counter(), SessionClock(self.model.artifact.session)
        _, _, logits = self._prefill(prompts, config, cache, run, config.beams.num_beams)
        eos = frozenset(self.model.eos) | frozenset(config.stop_tokens)
        beams = Beams(config.beams, len(prompts), eos, config.max_new_tokens, config.min_new_tokens)
        step, first_token_s, prefill_s = DecodeStep(self.model.artifact, cache, run), None, run.seconds
        while True:
            rows, tokens = beams.step(logits)
            first_token_s = time.perf_counter() - start if first_token_s is None else first_token_s
            if beams.over:
                break
            if not np.array_equal(rows, np.arange(len(rows))):
                cache.take_rows(cache, rows)
            logits = step(fitted(cache, tokens[:, None]))[:, 0]
        beams.answer(config.num_return_sequences)
        return self._result(beams, cache, run, time.perf_counter() - start, first_token_s, prefill_s, [])

    def _prefill(
        self, prompts: list[list[int]], config: GenerationConfig, cache: DeviceCache, run: SessionClock, answers: int
    ) -> tuple[list[list[int]], np.ndarray, np.ndarray]:  # fmt: skip
        """Feed the prompts into `cache`, each once: with several answers (or beams) a prompt, into a cache of a row a
        prompt, then forked into the rows of its answers. Returns each row's prompt, its ids `[rows, width]`
        (left-padded) and its last logits `[rows, vocab]`."""
        model = self.model
        ids, mask = left_padded(prompts, model.pad, config.max_new_tokens)
        width = ids.shape[1]
        with nullcontext(cache) if answers == 1 else self._held_cache(len(prompts), None) as prompted:
            prompted.start(model.thresholds(width + config.max_new_tokens - 1), mask, width)
            logits = prefill(model.artifact, prompted, ids, config.prefill_chunk, run)
            if answers == 1:
                return prompts, ids, logits
            rows = np.repeat(np.arange(len(prompts)), answers)
            cache.take_rows(prompted, rows)
        return [prompts[row] for row in rows], ids[rows], logits[rows]

    def _result(
        self, search: Search | Beams, cache: DeviceCache, run: SessionClock, wall: float, first_token_s: float,
        prefill_s: float, step_logits: list[np.ndarray],
    ) -> GenerationResult:  # fmt: skip
        """`search`: what chose the tokens, its answers in `tokens` and why each ended in `reasons`."""
        decode_tokens = sum(max(len(tokens) - 1, 0) for tokens in search.tokens)
        decode_s = wall - first_token_s
        tokenizer = self.model.tokenizer
        return GenerationResult(
            tokens=search.tokens,
            text=[tokenizer.decode(tokens) for tokens in search.tokens] if tokenizer else None,
            finish_reasons=search.reasons,
            time_to_first_token_s=first_token_s,
            decode_tokens_per_s=decode_tokens / decode_s if decode_s > 0 else float("inf"),
            steps=search.steps,
            onnxruntime_s=run.seconds,
            decode_onnxruntime_s=run.seconds - prefill_s,
            wall_s=wall,
            pruned_positions=cache.dropped.tolist(),
            drafts_proposed=search.proposed,
            drafts_accepted=search.accepted,
            step_logits=step_logits,
        )

    def teacher_forced_logits(self, ids: np.ndarray, prefill_chunk: int = GenerationConfig.prefill_chunk) -> np.ndarray:
        """Every position's logits `[batch, seq, vocab]` (float32) for rows of `seq` token ids `[batch, seq]`,
        fed from an empty cache in the chunks a prompt is prefilled in: what scoring a text needs."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        batch, width = ids.shape
        self.model.check_request(ids.tolist(), GenerationConfig(max_new_tokens=1, prefill_chunk=prefill_chunk))
        with self._held_cache(batch, None) as cache:
            cache.start(self.model.thresholds(width), np.ones((batch, width), dtype=np.int64), width)
            run = SessionClock(self.model.artifact.session)
            return prefill(self.model.artifact, cache, ids, prefill_chunk, run, every_position=True)
