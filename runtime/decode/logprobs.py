"""Log-probabilities of chosen and prompt tokens, as OpenAI's legacy completions API reports them.

They are taken from the distribution a token is drawn from: the step's logits in float32 after the sampling
processors that change it (a min_tokens ban, the logit bias, the repetition, presence and frequency penalties, and
when sampling temperature, top-k and top-p), what vLLM documents as `processed_logprobs`. Greedy decoding applies no
temperature, so there they are the model's own log-softmax (where nothing else changed them). A prompt token was
not sampled, but is scored the same way from the logits before it, with the prompt before it as the repetition
penalty's context (the presence and frequency penalties count generated tokens, so none yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.decode.sampling import SamplingConfig, filtered_logits, softmax

MAX_TOP = 20  # alternatives a request may ask for, as OpenAI allows


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float | None  # None for a prompt's first token, which nothing predicts
    top: tuple[tuple[int, float], ...] = ()  # the likeliest first, then the chosen one if not among them


def scored(logprobs: np.ndarray, tokens: np.ndarray, top: int) -> list[TokenLogprob]:
    """Each row's token with its log-probability and the `top` most likely alternatives: logprobs `[rows, vocab]`,
    tokens `[rows]`."""
    entries, top = [], min(top, logprobs.shape[-1])
    for row, token in zip(logprobs, tokens, strict=True):
        best = np.argpartition(-row, top - 1)[:top] if top else np.empty(0, dtype=np.int64)
        best = best[np.argsort(-row[best], kind="stable")]
        ids = [*best.tolist(), *([] if top == 0 or token in best else [int(token)])]
        entries.append(TokenLogprob(int(token), float(row[token]), tuple((i, float(row[i])) for i in ids)))
    return entries


def chosen_logprob(
    logits: np.ndarray, token: int, sampling: SamplingConfig, top: int,
    context: list[np.ndarray] | None = None, banned: np.ndarray | None = None,
    generated: list[list[int]] | None = None,
) -> TokenLogprob:  # fmt: skip
    """A generated token's entry from its step's logits `[1, vocab]`, processed as the Sampler processed them."""
    logprobs = softmax(filtered_logits(logits, sampling, context, banned, generated), np.float32, log=True)
    return scored(logprobs, np.array([token]), top)[0]


def prompt_logprobs(logits: np.ndarray, prompt: list[int], first: int, sampling: SamplingConfig, top: int):
    """Entries of the prompt tokens that logits `[positions, vocab]` predict: row q is position `first + q`, which
    predicts token `first + q + 1` (rows past the prompt's last token predict nothing and are left out)."""
    rows = min(len(logits), len(prompt) - 1 - first)
    if rows <= 0:
        return []
    penalised = sampling.repetition_penalty != 1.0
    context = [np.asarray(prompt[: first + q + 1]) for q in range(rows)] if penalised else None
    logprobs = softmax(filtered_logits(logits[:rows], sampling, context), np.float32, log=True)
    return scored(logprobs, np.asarray(prompt[first + 1 : first + 1 + rows]), top)
