"""The decode loop: prefill, then one token per step for every row, with the cache kept on the device.

Prompts of different lengths are left-padded into one batch; a row that meets a stop token stops
growing (it is fed padding, masked out, from then on). Tokens are streamed as they are chosen.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from runtime.artifact import Artifact, ArtifactError, SessionOptions
from runtime.constraints import Constraint, ConstraintError, Grammar, Grammars
from runtime.contract import held_in_place
from runtime.decode_step import DecodeStep
from runtime.device_cache import DeviceCache, runs_keep_head_windows
from runtime.prefill import bind_chunk
from runtime.pruning import AS_EXPORTED, Pruning, Tolerance
from runtime.search import GenerationConfig, Search
from runtime.text_stream import TextStream
from runtime.tokenizer import TextTokenizer

# A gqa dynamic artifact's key, value and gate buffers first hold the prompt and up to this many new tokens, and
# double when a generation goes further: a long max_new_tokens allocates only what is generated.
RESERVED_NEW_TOKENS = 256
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
    """Generation over one artifact; device buffers are kept between calls while the batch size allows.

    Calls may overlap (threads sharing one Generator, or streams read in turns): each call holds a cache of
    its own for as long as it runs, taken from those earlier calls left or newly allocated, and onnxruntime
    runs one session for several callers at once. A call never shares its buffers with another.
    """

    def __init__(
        self, artifact: Artifact, tokenizer: TextTokenizer | None = None, log_pruning_tolerance: Tolerance = AS_EXPORTED
    ):  # fmt: skip
        """`log_pruning_tolerance`: forget-gate pruning as the artifact was exported with ("artifact"), at another
        tolerance, or none (None); see runtime/pruning.py."""
        self.artifact, self.tokenizer = artifact, tokenizer
        try:
            self.pruning = Pruning.of(artifact.manifest, log_pruning_tolerance)
        except ValueError as error:
            raise ArtifactError(str(error)) from None
        if self.pruning is not None and not held_in_place(artifact.static, artifact.attention):
            raise ArtifactError(
                "forget-gate pruning needs a static cache or gqa attention; this dynamic artifact copies its cache "
                "each step: run it with log_pruning_tolerance None, or re-export it with --cache static"
            )
        tokens = artifact.manifest["special_tokens"]
        self.eos = tuple(tokens["eos"] or ())
        self.pad = tokens["pad"] if tokens["pad"] is not None else (self.eos[0] if self.eos else 0)
        self._grammars: Grammars | None = None  # structured outputs, set up by the first request that has one
        self.cache: DeviceCache | None = None  # the cache the latest call took
        self._idle: list[DeviceCache] = []  # caches no call holds, the most recently freed last
        self._idle_lock = threading.Lock()

    @classmethod
    def open(
        cls, folder: str | Path, options: SessionOptions | None = None, log_pruning_tolerance: Tolerance = AS_EXPORTED
    ) -> Generator:  # fmt: skip
        artifact = Artifact.open(folder, options or SessionOptions())
        return cls(artifact, TextTokenizer.open(artifact.folder, artifact.manifest), log_pruning_tolerance)

    def encode(self, prompts: str | list[str] | list[list[int]]) -> list[list[int]]:
        """Token ids as given, or a text's as the artifact's tokenizer makes them (escaped, with its BOS first where
        the manifest's `text` says so)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts and all(isinstance(p, str) for p in prompts):
            if self.tokenizer is None:
                raise ArtifactError("this artifact has no tokenizer; pass token ids instead of text")
            return self.tokenizer.encode_batch(prompts)
        return [list(map(int, p)) for p in prompts]

    def check_request(self, prompts: list[list[int]], config: GenerationConfig) -> None:
        """Refuse what cannot run, before any work, naming the limit and the fix."""
        limits = self.artifact.manifest["cache"]
        vocab = self.artifact.vocab_size
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ArtifactError("empty prompt: give at least one token per row")
        if len(prompts) > limits["max_batch"]:
            raise ArtifactError(
                f"batch {len(prompts)} exceeds this artifact's max batch {limits['max_batch']}; "
                "re-export with a larger --max-batch"
            )
        bad = sorted({t for p in prompts for t in p if not 0 <= t < vocab})
        if bad:
            raise ArtifactError(f"token ids {bad[:8]} are outside the vocabulary [0, {vocab})")
        if config.max_new_tokens < 1 or not 0 <= config.min_new_tokens <= config.max_new_tokens:
            raise ArtifactError("need max_new_tokens >= 1 and 0 <= min_new_tokens <= max_new_tokens")
        needed = max(map(len, prompts)) + config.max_new_tokens - 1  # the last new token is never fed back
        pruned = self.pruning is not None  # slots bound the kept positions then, not all of them
        if limits["max_cache_len"] is not None and needed > limits["max_cache_len"] and not pruned:
            raise ArtifactError(
                f"prompt ({max(map(len, prompts))} tokens) plus max_new_tokens ({config.max_new_tokens}) needs "
                f"{needed} cache positions, over this artifact's max_cache_len {limits['max_cache_len']}; "
                "shorten them or re-export with a larger --max-cache-len"
            )
        config.sampling.validate()
        if config.speculative is not None:
            config.speculative.check(self, prompts, config)
            self.check_runs_of_tokens(len(prompts))
        if config.constraint is not None:
            self.grammar(config.constraint)
            if config.min_new_tokens:
                raise ConstraintError(
                    "min_new_tokens cannot be combined with a constraint: the constraint decides where the text ends"
                )

    def grammar(self, constraint: Constraint | None) -> Grammar | None:
        """The constraint compiled for this artifact's tokenizer (once; ConstraintError where it cannot be)."""
        if constraint is None:
            return None
        if self._grammars is None:
            if self.tokenizer is None:
                raise ConstraintError("structured outputs need the artifact's tokenizer; this artifact has none")
            self._grammars = Grammars(self.tokenizer, self.artifact.vocab_size, self.eos)
        return self._grammars.compile(constraint)

    def check_runs_of_tokens(self, rows: int) -> None:
        """Refuse speculative decoding where this artifact cannot run a token and its drafts in one run for `rows`."""
        if rows > 1 and self.artifact.attention == "gqa":
            raise ArtifactError(
                "speculative decoding runs a token and its drafts in one run, which GroupQueryAttention takes for "
                "one row only: send the prompts one by one, or use an artifact exported with another --attention"
            )
        if self.pruning is not None and not runs_keep_head_windows(self.artifact.manifest):
            raise ArtifactError(
                "speculative decoding runs a token and its drafts in one run, which this artifact, exported "
                "before a chunk could keep each head's own window, cannot do once pruning has staggered them: "
                "re-export it, or turn pruning off (log_pruning_tolerance None)"
            )

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        config: GenerationConfig = GenerationConfig(),
        on_token: Callable[[TokenEvent], None] | None = None,
        keep_logits: bool = False,
    ) -> GenerationResult:
        steps = self._run(self.encode(prompts), config, keep_logits, text_events=on_token is not None)
        while True:
            try:
                event = next(steps)
            except StopIteration as done:
                return done.value
            if on_token is not None:
                on_token(event)

    def stream(self, prompts, config: GenerationConfig = GenerationConfig()) -> Iterator[TokenEvent]:
        """Yield each token as it is chosen; the generator's return value is the GenerationResult."""
        return self._run(self.encode(prompts), config, keep_logits=False, text_events=True)

    @contextmanager
    def _held_cache(self, batch: int) -> Iterator[DeviceCache]:
        """A cache for `batch` rows that no other call holds while the block runs (an idle one reset, else a new
        one), kept for later calls afterwards."""
        with self._idle_lock:
            cache = next((c for c in reversed(self._idle) if c.batch == batch), None)
            if cache is not None:
                self._idle.remove(cache)
        if cache is None:
            cache = DeviceCache(self.artifact, batch)
        else:
            cache.reset()
        self.cache = cache
        try:
            yield cache
        finally:
            with self._idle_lock:
                self._idle = [*self._idle, cache][-IDLE_CACHES:]

    def _run(self, prompts: list[list[int]], config: GenerationConfig, keep_logits: bool, text_events: bool):
        """The token events of one call, then its GenerationResult; the call holds its cache until it ends (or
        its stream is closed or dropped)."""
        self.check_request(prompts, config)
        with self._held_cache(len(prompts)) as cache:
            return (yield from self._decode(prompts, config, keep_logits, text_events, cache))

    def _decode(
        self, prompts: list[list[int]], config: GenerationConfig, keep_logits: bool, text_events: bool,
        cache: DeviceCache,
    ):  # fmt: skip
        """gpt-fast's decode_n_tokens: prefill; choose and emit a token a row from each position of the latest run while
        the drafts fed before it were chosen; feed the last chosen with the next drafts (`decode_one_token`: none)."""
        start = time.perf_counter()
        ids, mask = left_padded(prompts, self.pad, config.max_new_tokens)
        self.begin(cache, ids.shape[1], config.max_new_tokens)
        run = SessionClock(self.artifact.session)
        logits = self.prefill(self.artifact.session.io_binding(), cache, ids, mask, config.prefill_chunk, run)
        prefill_s, first_token_s, step_logits = run.seconds, None, []
        search = Search(config, prompts, self.eos, self.pad, self.grammar(config.constraint))
        texts = [TextStream(self.tokenizer) for _ in prompts] if text_events and self.tokenizer else None
        decode_one_token = DecodeStep(self.artifact, cache, run)
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
            outputs = decode_one_token(fed)[:, lead:]
        return self._result(search, cache, run, time.perf_counter() - start, first_token_s, prefill_s, step_logits)

    def _result(
        self, search: Search, cache: DeviceCache, run: SessionClock, wall: float, first_token_s: float,
        prefill_s: float, step_logits: list[np.ndarray],
    ) -> GenerationResult:  # fmt: skip
        decode_tokens = sum(max(len(tokens) - 1, 0) for tokens in search.tokens)
        decode_s = wall - first_token_s
        return GenerationResult(
            tokens=search.tokens,
            text=[self.tokenizer.decode(tokens) for tokens in search.tokens] if self.tokenizer else None,
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

    def begin(self, cache: DeviceCache, width: int, new_tokens: int) -> None:
        """Start a request of prompts `width` long and up to `new_tokens` more on `cache`, pruning it if this
        generator prunes (else its buffers hold the prompt and RESERVED_NEW_TOKENS more from the start)."""
        positions = width + new_tokens - 1  # the last new token is never fed back
        thresholds = None if self.pruning is None else self.pruning.thresholds(positions)
        cache.start(thresholds, width + min(new_tokens - 1, RESERVED_NEW_TOKENS))

    def teacher_forced_logits(self, ids: np.ndarray, prefill_chunk: int = GenerationConfig.prefill_chunk) -> np.ndarray:
        """Every position's logits `[batch, seq, vocab]` (float32) for rows of `seq` token ids `[batch, seq]`,
        fed from an empty cache in the chunks a prompt is prefilled in: what scoring a text needs."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        batch, width = ids.shape
        self.check_request(ids.tolist(), GenerationConfig(max_new_tokens=1, prefill_chunk=prefill_chunk))
        with self._held_cache(batch) as cache:
            self.begin(cache, width, 1)
            binding = self.artifact.session.io_binding()
            mask = np.ones((batch, width), dtype=np.int64)
            run = SessionClock(self.artifact.session)
            return self.prefill(binding, cache, ids, mask, prefill_chunk, run, every_position=True)

    def prefill(
        self, binding: ort.IOBinding, cache: DeviceCache, ids: np.ndarray, mask: np.ndarray, prefill_chunk: int,
        run: Callable[[ort.IOBinding], None], every_position: bool = False,
    ) -> np.ndarray:  # fmt: skip
        """Feed the prompts `ids` `[batch, width]` (`mask` covers at least `width`) in chunks of at most
        `prefill_chunk` tokens, or row by row (see `DeviceCache.prefill_chunks`), so that a run's attention terms
        and logits never grow with the prompt; returns the logits of every position `[batch, width, vocab]`, or of
        the last `[batch, vocab]`. Decode runs may follow (`DeviceCache.decode_after`)."""
        batch, width = ids.shape
        step, by_row = cache.prefill_chunks(width, prefill_chunk)
        rows = [slice(row, row + 1) for row in range(batch)] if by_row else [slice(0, batch)]
        logits = []
        for part in rows:
            pieces, begin, index = [], 0, 0
            while begin < width:
                row_chunk = (part.start, index, -(-width // step)) if by_row else None
                out, begin = self._feed(
                    binding, cache, ids[part], mask[part], begin, step, run, row_chunk, not every_position
                )
                if every_position or begin == width:
                    pieces.append(out.numpy())
                index += 1
            logits.append(np.concatenate(pieces, axis=1) if every_position else pieces[-1][:, -1])
        cache.decode_after(mask, width)
        return np.concatenate(logits, axis=0)

    def _feed(
        self, binding: ort.IOBinding, cache: DeviceCache, ids: np.ndarray, mask: np.ndarray, filled: int, most: int,
        run: Callable[[ort.IOBinding], None], row_chunk: tuple[int, int, int] | None = None, last_only: bool = False,
    ) -> tuple[ort.OrtValue, int]:  # fmt: skip
        """Feed up to `most` of the prompt `ids` `[batch, width]` after its first `filled` positions, as many as
        the cache has room for (`mask` covers at least `width`); returns the logits `[batch, new, vocab]` where
        onnxruntime left them (`[batch, 1, vocab]` with `last_only` on a graph that can spare the others) and the
        positions filled then. `row_chunk` (row, chunk, chunks): the chunk is that row's alone (see
        `DeviceCache.bind_row`), and nothing is pruned."""
        new = min(most, ids.shape[1] - filled)
        new, slot, window = cache.prepare_chunk(mask, filled, new, slice(None) if row_chunk is None else None)
        logits = self._run_chunk(binding, cache, ids[:, filled : filled + new], slot, window, run, last_only, row_chunk)
        return logits, filled + new

    def _run_chunk(
        self, binding: ort.IOBinding, cache: DeviceCache, ids: np.ndarray, slot: int, window: np.ndarray,
        run: Callable[[ort.IOBinding], None], last_only: bool = False, row_chunk: tuple[int, int, int] | None = None,
    ) -> ort.OrtValue:  # fmt: skip
        """Run `ids` `[batch, new]` from `slot`, attending `window`, on the whole cache or (`row_chunk`) one row's part
        of it; its logits where onnxruntime left them."""
        bind_chunk(binding, self.artifact, ids, window, slot, cache.device, last_only)
        if row_chunk is None:
            cache.bind(binding)
        else:
            cache.bind_row(binding, *row_chunk)
        run(binding)
        outputs = binding.get_outputs()
        if row_chunk is None:
            cache.advance(outputs)
        return outputs[0]


class SessionClock:
    """Runs a session on a binding and adds up the seconds spent inside it."""

    def __init__(self, session: ort.InferenceSession):
        self.session, self.seconds = session, 0.0

    def __call__(self, binding: ort.IOBinding) -> None:
        began = time.perf_counter()
        self.session.run_with_iobinding(binding)
        self.seconds += time.perf_counter() - began


def left_padded(prompts: list[list[int]], pad: int, new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompts left-padded into ids `[batch, width]`, and their mask over the prompt and `new_tokens` more
    positions: every new position is attended until its row stops (the caller then masks the rest of it)."""
    width = max(map(len, prompts))
    ids = np.full((len(prompts), width), pad, dtype=np.int64)
    mask = np.ones((len(prompts), width + new_tokens), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, : width - len(prompt)] = prompt, 0
    return ids, mask
