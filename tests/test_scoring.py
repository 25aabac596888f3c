"""Teacher-forced scoring: the next-token arithmetic against hand-computed values, and segment batching."""

import math

import numpy as np
import pytest

from runtime.decode.scoring import next_token_scores, score_segments


def test_next_token_scores_on_a_tiny_text_match_hand_computed_values():
    # Vocabulary of 2, text [0, 1, 0]. Position 0 has logits [0, ln 3], so p(1) = 3/4; position 1 has logits
    # [ln 4, 0], so p(0) = 4/5. The last position predicts nothing.
    logits = np.array([[0.0, math.log(3)], [math.log(4), 0.0], [5.0, -5.0]], dtype=np.float32)
    nll, top1 = next_token_scores(logits, np.array([0, 1, 0]))
    assert nll == pytest.approx([math.log(4 / 3), math.log(5 / 4)], rel=1e-6)
    assert top1.tolist() == [1, 0]
    # perplexity = exp(mean nll) = sqrt(4/3 * 5/4) = sqrt(5/3)
    assert math.exp(nll.mean()) == pytest.approx(math.sqrt(5 / 3), rel=1e-6)


def test_uniform_logits_have_the_vocabulary_size_as_perplexity():
    nll, _ = next_token_scores(np.zeros((2, 6, 50), dtype=np.float32), np.arange(12).reshape(2, 6))
    assert math.exp(nll.mean()) == pytest.approx(50, rel=1e-9)


def test_large_logits_stay_finite():
    logits = np.array([[1000.0, -1000.0, 0.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    nll, _ = next_token_scores(logits, np.array([0, 2]))  # predicts token 2, whose logit is 1000 below the top
    assert nll.tolist() == pytest.approx([1000.0])


def naive_scores(logits_of, segment):
    """Per position, -log of the softmax probability of the next token, in plain Python."""
    logits = logits_of(segment[None])[0]
    out = []
    for t in range(len(segment) - 1):
        row = [float(x) for x in logits[t]]
        top = max(row)
        total = sum(math.exp(x - top) for x in row)
        out.append(-(row[segment[t + 1]] - top - math.log(total)))
    return out


def test_segments_are_scored_in_order_with_equal_lengths_batched_within_the_limit():
    rng = np.random.default_rng(0)
    table = rng.normal(size=(7, 7)).astype(np.float32)
    batches = []

    def logits_of(ids):
        batches.append(ids.shape)
        return table[ids]  # each token's logits depend on it alone: a bigram model

    segments = [rng.integers(0, 7, n) for n in (5, 5, 5, 3, 5, 2)]
    scores = score_segments(logits_of, segments, max_batch=2, vocab_size=7)
    assert batches == [(2, 5), (1, 5), (1, 3), (1, 5), (1, 2)]
    want = [x for s in segments for x in naive_scores(lambda ids: table[ids], s)]
    assert scores.nll.tolist() == pytest.approx(want, rel=1e-9)
    assert scores.targets.tolist() == [int(t) for s in segments for t in s[1:]]
    assert scores.top1.tolist() == [int(table[t].argmax()) for s in segments for t in s[:-1]]


@pytest.mark.parametrize("block", [1, 2, 3, 5])
def test_logits_given_in_blocks_of_positions_score_as_the_naive_formula(block):
    """A segment's logits may come as consecutive blocks of positions (eager's LM head goes block by block); the
    last position of a block is scored against the next block's first token."""
    rng = np.random.default_rng(1)
    table = rng.normal(size=(7, 7)).astype(np.float32)

    def blocks_of(ids):
        return (table[ids[:, begin : begin + block]] for begin in range(0, ids.shape[1], block))

    segments = [rng.integers(0, 7, n) for n in (5, 5, 4, 2)]
    scores = score_segments(blocks_of, segments, max_batch=2, vocab_size=7)
    want = [x for s in segments for x in naive_scores(lambda ids: table[ids], s)]
    assert scores.nll.tolist() == pytest.approx(want, rel=1e-9)
    assert scores.top1.tolist() == [int(table[t].argmax()) for s in segments for t in s[:-1]]


def test_no_segments_is_an_error():
    with pytest.raises(ValueError, match="no segments"):
        score_segments(lambda ids: ids, [], max_batch=4, vocab_size=3)
