"""The token-choice step of the torch-free decode loop: generate()'s logits processing and sampling, in numpy.

Greedy decoding picks the same tokens as transformers' generate(); sampling draws from the same filtered distribution.
"""

from dataclasses import dataclass

import numpy as np

from runtime.errors import RequestError


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen; the defaults are plain greedy decoding."""

    temperature: float = 0.0  # 0 = greedy (argmax); > 0 samples from softmax(logits / temperature)
    top_k: int = 0  # 0 = off; keeps every logit >= the k-th largest (ties at the k-th value are all kept)
    top_p: float = 1.0  # 1.0 = off; keeps the smallest set of most probable tokens holding >= top_p probability
    repetition_penalty: float = 1.0  # 1.0 = off; makes every token id already in the row's context less likely
    seed: int | None = None  # seeds the numpy Generator, so a seeded run repeats its tokens exactly
    # OpenAI's penalties, over the tokens a row has generated (not its prompt): a token's logit less
    # frequency_penalty times its count, and less presence_penalty once if it came at all
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits; a bias of -100 bans

    @property
    def counts_generated(self) -> bool:
        """Whether choosing needs each row's generated tokens (`filtered_logits`' `generated`)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def neutral(self) -> bool:
        """Whether the logits reach the choice as they are (before temperature, top-k and top-p)."""
        return self.repetition_penalty == 1.0 and not self.counts_generated and not self.logit_bias

    def validate(self, vocab: int | None = None) -> None:
        """Rejects values that transformers or OpenAI would reject or that make no distribution; with `vocab`, a
        biased token id outside the vocabulary too."""
        if not self.temperature >= 0:
            raise RequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise RequestError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise RequestError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}", name)
        for token, bias in self.logit_bias:
            if not -100 <= bias <= 100:
                raise RequestError(f"logit_bias of token {token} must be in [-100, 100], got {bias}", "logit_bias")
            if token < 0 or (vocab is not None and token >= vocab):
                raise RequestError(f"logit_bias names token {token}, outside the vocabulary [0, {vocab})", "logit_bias")


def filtered_logits(
    logits: np.ndarray,
    config: SamplingConfig,
    context: list[np.ndarray] | None = None,
    banned: np.ndarray | None = None,
    generated: list[list[int]] | None = None,
) -> np.ndarray:
    """The logits `Sampler.choose` picks from, processed in generate()'s order; removed tokens are -inf.

    logits: [batch, vocab], the last position's; context: per row, the token ids seen so far (needed only for a
    repetition penalty); banned: token ids forbidden for every row this step (eos ids while min_new_tokens is unmet);
    generated: per row, the ids it has generated (needed only for the presence and frequency penalties). Banning and
    the logit bias, then the repetition penalty, then the presence and frequency penalties (vLLM's order); when
    sampling, then temperature, top-k and top-p. Each row depends only on its own logits and history. The input is
    not modified. The result equals transformers' processors' except where float rounding decides: a cumulative
    probability within rounding of 1 - top_p, or which of equal logits top-p cuts.
    """
    config.validate()
    scores = np.array(logits, dtype=np.float32)
    if scores.ndim != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {scores.shape}")
    if config.logit_bias:
        _bias(scores, config.logit_bias)
    if banned is not None:
        scores[:, np.asarray(banned, dtype=np.int64)] = -np.inf
    if (banned is not None or config.logit_bias) and np.isneginf(scores).all(axis=-1).any():
        raise ValueError("banned and logit_bias forbid every token of a row: nothing is left to choose")
    if config.repetition_penalty != 1.0:
        _penalise_repetitions(scores, context, config.repetition_penalty)
    if config.counts_generated:
        _penalise_generated(scores, generated, config.presence_penalty, config.frequency_penalty)
    if config.temperature == 0:
        return scores
    scores /= np.float32(config.temperature)
    vocab = scores.shape[-1]
    if 0 < config.top_k < vocab:
        kth_largest = np.partition(scores, vocab - config.top_k, axis=-1)[:, vocab - config.top_k, None]
        scores[scores < kth_largest] = -np.inf
    if config.top_p < 1.0:
        # TopPLogitsWarper: sort ascending, drop the tokens whose cumulative probability is <= 1 - top_p, but never
        # the most probable one. torch's sort leaves the order of equal logits open; a stable one drops lower ids first.
        order = np.argsort(scores, axis=-1, kind="stable")
        ascending = np.take_along_axis(scores, order, axis=-1)
        drop = np.cumsum(softmax(ascending), axis=-1) <= 1 - config.top_p
        drop[:, -1] = False
        np.put_along_axis(scores, order, np.where(drop, -np.inf, ascending), axis=-1)
    return scores


def _penalise_repetitions(scores: np.ndarray, context: list[np.ndarray] | None, penalty: float) -> None:
    """RepetitionPenaltyLogitsProcessor, in place: seen ids' positive logits are divided, negative ones multiplied."""
    if context is None or len(context) != scores.shape[0]:
        raise ValueError("repetition_penalty != 1 needs context: one array of seen token ids per row of logits")
    for row, ids in zip(scores, context, strict=True):
        seen = np.unique(np.asarray(ids, dtype=np.int64))
        if seen.size and (seen[0] < 0 or seen[-1] >= row.size):
            raise ValueError(f"context holds token ids outside [0, {row.size}): {seen[0]}..{seen[-1]}")
        hit = row[seen]
        row[seen] = np.where(hit > 0, hit / penalty, hit * penalty)


def _bias(scores: np.ndarray, logit_bias: tuple[tuple[int, float], ...]) -> None:
    """OpenAI's logit_bias, in place: each bias added to its token's logit in every row, -100 a ban (-inf)."""
    tokens = np.array([token for token, _ in logit_bias], dtype=np.int64)
    if tokens.size and tokens.max() >= scores.shape[-1]:
        raise ValueError(f"logit_bias names token {tokens.max()}, outside the vocabulary [0, {scores.shape[-1]})")
    biases = np.array([-np.inf if bias <= -100 else bias for _, bias in logit_bias], dtype=np.float32)
    scores[:, tokens] += biases


def _penalise_generated(
    scores: np.ndarray, generated: list[list[int]] | None, presence: float, frequency: float
) -> None:  # fmt: skip
    """OpenAI's presence and frequency penalties, in place: each row's logits less frequency x how often the row
    generated the token, less presence for each token it generated at all."""
    if generated is None or len(generated) != scores.shape[0]:
        raise ValueError("presence or frequency penalties need generated: one list of generated ids per row")
    for row, ids in zip(scores, generated, strict=True):
        if ids:
            counts = np.bincount(np.asarray(ids, dtype=np.int64), minlength=row.size)[: row.size]
            row -= np.float32(frequency) * counts + np.float32(presence) * (counts > 0)


def softmax(scores: np.ndarray, dtype: type = np.float64, log: bool = False) -> np.ndarray:
    """Row-wise (the last axis) softmax of `scores` taken in `dtype`, or with `log` its log: the scores less their
    maximum, exponentiated and summed. A score of -inf (a token removed) has probability 0, log-probability -inf.
    The runtime's one softmax: sampling takes it in float64, so the probabilities of a large vocabulary still sum to
    1 closely; log-probabilities (runtime/decode/logprobs.py) in float32, scoring (runtime/decode/scoring.py) in
    float64."""
    scores = np.asarray(scores, dtype=dtype)
    shifted = scores - scores.max(axis=-1, keepdims=True)
    exponentials = np.exp(shifted)
    total = exponentials.sum(axis=-1, keepdims=True)
    return shifted - np.log(total) if log else exponentials / total


class Sampler:
    """Chooses each row's next token; it owns the random generator, so one seeded Sampler per run repeats exactly."""

    def __init__(self, config: SamplingConfig) -> None:
        config.validate()
        self.config = config
        self._rng = np.random.default_rng(config.seed)

    def choose(
        self, logits: np.ndarray, context: list[np.ndarray] | None = None, banned: np.ndarray | None = None,
        generated: list[list[int]] | None = None,
    ) -> np.ndarray:  # fmt: skip
        """Next token ids [batch] int64 for logits [batch, vocab]; the arguments are those of `filtered_logits`."""
        greedy = self.config.temperature == 0
        if greedy and self.config.neutral:
            # Banning only lowers the banned ids, so the plain argmax stands unless it is one of them; this
            # spares a decode step a copy and three passes over the vocabulary (min_new_tokens bans every step).
            # The check is on Python lists: a handful of ids, where numpy's per-call cost would dominate.
            top = np.asarray(logits).argmax(axis=-1).astype(np.int64, copy=False)
            if banned is None or set(np.asarray(banned).tolist()).isdisjoint(top.tolist()):
                return top
        scores = filtered_logits(logits, self.config, context, banned, generated)
        if greedy:
            return scores.argmax(axis=-1).astype(np.int64)
        return self.draw(softmax(scores))

    def distribution(
        self, logits: np.ndarray, context: list[np.ndarray] | None = None, banned: np.ndarray | None = None,
        generated: list[list[int]] | None = None,
    ) -> np.ndarray:  # fmt: skip
        """What `choose` samples from when sampling `[batch, vocab]` (float64): a draft model's q, the target's p."""
        return softmax(filtered_logits(logits, self.config, context, banned, generated))

    def draw(self, probs: np.ndarray) -> np.ndarray:
        """One id per row `[batch]` int64 from (not necessarily normalised) probabilities `[batch, vocab]`."""
        cdf = np.cumsum(probs, axis=-1)
        draws = self._rng.random(probs.shape[0]) * cdf[:, -1]
        # Inverse CDF: the first id whose cumulative probability exceeds the draw. That id never has probability 0
        # (its cdf would equal its predecessor's); the clamp covers a draw rounding up to the total.
        tokens = (cdf <= draws[:, None]).sum(axis=-1)
        last_possible = probs.shape[-1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=-1)
        return np.minimum(tokens, last_possible).astype(np.int64)

    def verify(
        self, logits: np.ndarray, drafts: np.ndarray, drawn_from: np.ndarray, context: list[np.ndarray] | None = None,
        banned: np.ndarray | None = None, generated: list[list[int]] | None = None,
    ) -> np.ndarray:  # fmt: skip
        """Speculative sampling's rule (Leviathan et al. 2023, Chen et al. 2023): each row's draft `[batch]`, drawn
        from q `drawn_from` `[batch, vocab]`, is kept with probability min(1, p/q) (p: the target's distribution from
        `logits`, as `choose` samples it), else replaced by a draw from what p has beyond q, max(p - q, 0). The
        token is then distributed as p, whatever q; it is the draft exactly when kept (a rejected draft has
        p < q, so no mass beyond q)."""
        p = self.distribution(logits, context, banned, generated)
        at = np.arange(len(p)), drafts  # each row's draft
        kept = self._rng.random(len(p)) * drawn_from[at] < p[at]
        if kept.all():
            return np.asarray(drafts, dtype=np.int64)
        return np.where(kept, drafts, self.draw(np.maximum(p - drawn_from, 0.0))).astype(np.int64)
