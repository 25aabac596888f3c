"""A waiting request's prompt prefilled into a row of the engine's cache, one chunk between two decode steps of the
other rows, from the longest prefix of a recent prompt that it shares (runtime/cache/prefix_cache.py). Where its
slots lie is the RowCache's to decide; which request goes next, the engine's."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.cache.prefix_cache import Block, PrefixCache
from runtime.cache.row_cache import RowCache
from runtime.decode.logprobs import TokenLogprob, prompt_logprobs
from runtime.decode.model import Model
from runtime.decode.prefill import bind_chunk, chunk_size, chunk_spans
from runtime.decode.requests import Request
from runtime.decode.search import GenerationConfig


@dataclass(eq=False)
class PromptFill:
    """A request being prefilled into a row of its own."""

    request: Request
    row: int
    spans: list[tuple[int, int]]  # the chunks' [begin, end) in the prompt
    scores: list[TokenLogprob]  # the prompt's log-probabilities so far, where the request echoes them
    resumed: int = 0  # the prompt's tokens a cached prefix supplied, before the first chunk
    done: int = 0  # chunks prefilled

    @property
    def whole(self) -> bool:
        return self.done == len(self.spans)


class Prefiller:
    def __init__(self, model: Model, cache: RowCache, budget: int, prefixes: PrefixCache | None):
        """`budget`: prompt tokens prefilled between two decode steps; `prefixes`: recent prompts' (None: none)."""
        self.model, self.cache, self.budget, self.prefixes = model, cache, budget, prefixes
        self.binding = model.artifact.session.io_binding()

    def chunk(self, config: GenerationConfig) -> int:
        """Prompt tokens a prefill run takes: the budget between two decode steps, or fewer (see chunk_size)."""
        return chunk_size(self.model.artifact, 1, self.cache.length, min(self.budget, config.prefill_chunk))

    def cached_prefix(self, request: Request) -> list[Block]:
        """The cached blocks a request's prefill may start from: none for a request that scores its prompt (every
        position's logits are needed), and at least its last token is prefilled (for the first new one's logits)."""
        if self.prefixes is None or request.scores_prompt:
            return []
        return self.prefixes.longest(request.prompt, len(request.prompt) - 1)

    def place(self, request: Request, row: int, reserved: int) -> PromptFill | None:
        """Begin prefilling `request` into `row` (what a cached prefix holds put back first), or None while its
        prompt and the running rows, each with `reserved` slots more, do not fit (see RowCache.place)."""
        prompt = request.prompt
        blocks = self.cached_prefix(request)
        resumed = blocks[-1].end if blocks else 0
        spans = [(resumed + b, resumed + e) for b, e in chunk_spans(len(prompt) - resumed, self.chunk(request.config))]
        if not self.cache.place(row, len(prompt), len(spans), reserved):
            return None
        if blocks:
            self.cache.restore(row, blocks)
        return PromptFill(request, row, spans, [TokenLogprob(prompt[0], None)], resumed)

    def feed(self, fill: PromptFill) -> None:
        """Run the fill's next chunk (where the cache places it, see RowCache.prepare_chunk); raises what onnxruntime
        raises."""
        begin, end = fill.spans[fill.done]
        _, slot, mask = self.cache.prepare_chunk(fill.row, (begin, end))
        request = fill.request
        ids = np.array([request.prompt[begin:end]], dtype=np.int64)
        bind_chunk(self.binding, self.model.artifact, ids, mask, slot, self.cache.device, not request.scores_prompt)
        self.cache.bind_row(self.binding, fill.row, fill.done, len(fill.spans), fill.resumed > 0)
        self.model.artifact.session.run_with_iobinding(self.binding)

    def take(self, fill: PromptFill) -> np.ndarray:
        """After `feed`: the chunk's logits `[1, positions, vocab]` (its last position's alone unless scoring), its
        slots kept for later prompts where the chunk is whole, the prompt's scores where they are asked for."""
        request, span = fill.request, fill.spans[fill.done]
        begin, end = span
        if self.prefixes is not None and end - begin == self.chunk(request.config):  # where others resume
            slots, states = self.cache.read_chunk(fill.row, span, fill.done, len(fill.spans))
            self.prefixes.add(request.prompt, Block(end, begin, slots, states))
        logits = self.binding.get_outputs()[0].numpy()
        if request.scores_prompt:
            fill.scores += prompt_logprobs(logits[0], request.prompt, begin, request.config.sampling, request.logprobs)
        fill.done += 1
        return logits
