"""A draft model: a smaller artifact with the target's tokenizer drafts the tokens that come next, one run each, and
the target verifies them all in one run (see `Generator._decode`, `Engine._step`).

The draft keeps a cache of its own, which holds the text the target has chosen. Each round feeds it the tokens
chosen since the last (the accepted drafts and the token after them) in one run, remembers the cache there
(`DeviceCache.hold`), drafts a token a run, and goes back (`DeviceCache.rewind`): the keys, values and gates of
its drafts are dropped, and FoX-Pro's shift states are those after the last chosen token again. transformers'
`assistant_model` is this; like its assisted decoding, a draft model drafts for one prompt at a time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from runtime.artifact import SessionOptions
from runtime.cache.device_cache import DeviceCache
from runtime.decode.model import Model
from runtime.decode.prefill import left_padded, prefill
from runtime.decode.sampling import Sampler, SamplingConfig
from runtime.decode.search import GenerationConfig
from runtime.decode.step import DecodeStep, fitted
from runtime.errors import RequestError


@dataclass(frozen=True)
class DraftModel:
    """Draft up to `tokens` tokens a run with `model` (greedily, or sampling as the request does)."""

    model: Model
    tokens: int = 5
    max_rows = 1  # its drafts take a run a row: beside other rows, more than they save (the engine's default)

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise RequestError(f"a draft model needs tokens (--draft-tokens) >= 1, got {self.tokens}")

    @classmethod
    def open(cls, folder: str | Path, options: SessionOptions | None = None, tokens: int = 5) -> DraftModel:
        return cls(Model.open(folder, options), tokens)

    def check(self, target: Model, prompts: list[list[int]], config: GenerationConfig) -> None:
        """Refuse a draft that cannot draft for `target`'s request, naming why: other token ids, a batch, or a request
        its own artifact cannot hold."""
        difference = tokenizer_difference(self.model, target)
        if difference is not None:
            raise RequestError(
                f"the draft model {self.model.artifact.folder} does not share the target's tokens: {difference}; "
                "draft with a model exported from the same tokenizer, or use --speculative ngram"
            )
        if len(prompts) > 1:
            raise RequestError("a draft model drafts for one prompt at a time: send the prompts one by one", "prompt")
        self.model.check_request(prompts, replace(config, speculative=None))
        self.model.check_runs_of_tokens(1)

    def start(self, prompt: list[int], config: GenerationConfig) -> ModelDrafter:
        return ModelDrafter(self.model, prompt, config)


class ModelDrafter:
    """One request's draft, with a cache of its own for as long as the request runs."""

    distributions: list[np.ndarray]  # when sampling, the latest drafts' q, each `[vocab]` (see `Sampler.verify`)

    def __init__(self, model: Model, prompt: list[int], config: GenerationConfig):
        artifact = model.artifact
        self.cache = DeviceCache(artifact, 1)
        run = artifact.session.run_with_iobinding
        ids, mask = left_padded([prompt], model.pad, config.max_new_tokens)
        self.cache.start(model.thresholds(len(prompt) + config.max_new_tokens - 1), mask, len(prompt))
        prefill(artifact, self.cache, ids, config.prefill_chunk, run)
        self.step = DecodeStep(artifact, self.cache, run)
        self.text, self.fed = list(prompt), len(prompt)  # the tokens chosen so far, and those the cache holds
        sampling = config.sampling
        # Its own draws, seeded from the request's seed so that a seeded request repeats; no repetition penalty:
        # any q keeps the target's distribution (see `Sampler.verify`), and this one costs no context
        self.sampler = None if sampling.temperature == 0 else Sampler(
            SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed=_draft_seed(sampling.seed))
        )  # fmt: skip
        self.distributions = []

    def push(self, token: int) -> None:
        self.text.append(token)

    def propose(self, most: int) -> list[int]:
        """Up to `most` drafts after the text; none when a pruned cache could not take the tokens chosen since the
        last round (the next round feeds the rest)."""
        chosen = np.array([self.text[self.fed :]], dtype=np.int64)
        logits = self.step(fitted(self.cache, chosen))
        self.fed += logits.shape[1]
        self.distributions = []
        if self.fed < len(self.text):
            return []
        drafts = [self._draft(logits[:, -1])]
        if most > 1:  # drafts fed to the cache, which goes back after them
            self.cache.hold()
            while len(drafts) < most:
                latest = np.array([[drafts[-1]]], dtype=np.int64)
                drafts.append(self._draft(self.step(fitted(self.cache, latest))[:, -1]))
            self.cache.rewind()
        return drafts

    def _draft(self, logits: np.ndarray) -> int:
        if self.sampler is None:
            return int(logits[0].argmax())
        q = self.sampler.distribution(logits)
        self.distributions.append(q[0])
        return int(self.sampler.draw(q)[0])


def _draft_seed(seed: int | None) -> int | None:
    return None if seed is None else int(np.random.SeedSequence(seed).generate_state(1)[0])


@functools.lru_cache(maxsize=8)
def tokenizer_difference(draft: Model, target: Model) -> str | None:
    """How the draft's token ids differ from the target's, in words; None when they mean the same text. Kept for
    the pair: the engine checks every request, and reading two vocabularies each time is work for nothing."""
    ours, theirs = draft.artifact.manifest, target.artifact.manifest
    if draft.artifact.vocab_size != target.artifact.vocab_size:
        return f"its vocabulary has {draft.artifact.vocab_size} ids, the target's {target.artifact.vocab_size}"
    for key in ("special_tokens", "text"):
        if ours.get(key) != theirs.get(key):
            return f"its {key} are {ours.get(key)}, the target's {theirs.get(key)}"
    if (draft.tokenizer is None) != (target.tokenizer is None):
        return "one has a tokenizer and the other none" if draft.tokenizer else "the target has a tokenizer, it none"
    if draft.tokenizer is None:
        return None
    vocab, target_vocab = draft.tokenizer.bpe.get_vocab(), target.tokenizer.bpe.get_vocab()
    if vocab != target_vocab:
        ours_alone = set(vocab.items()) - set(target_vocab.items())  # the draft's view first: one answer, every run
        token = min(ours_alone or set(target_vocab.items()) - set(vocab.items()), key=lambda item: item[::-1])[0]
        return f"its tokenizer gives {token!r} id {vocab.get(token)}, the target's id {target_vocab.get(token)}"
    if draft.tokenizer.bpe.to_str() != target.tokenizer.bpe.to_str():
        return "its tokenizer.json differs from the target's beyond the vocabulary (merges or text handling)"
    return None
