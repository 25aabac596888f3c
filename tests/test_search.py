"""The request search that the Generator and the engine share: bans, penalties, ends and padding, on logits
built by hand so that each expected token follows from the arithmetic in the test."""

import numpy as np

from runtime.decode.sampling import SamplingConfig
from runtime.decode.search import GenerationConfig, Search

EOS, PAD = 3, 0


def logits_favouring(*order: int, vocab: int = 5) -> np.ndarray:
    """One row's logits `[1, vocab]` whose ranking is `order` (the first the likeliest), the rest far below."""
    row = np.full(vocab, -10.0, dtype=np.float32)
    for rank, token in enumerate(order):
        row[token] = 5.0 - rank
    return row[None]


def test_stop_tokens_are_banned_until_min_new_tokens_then_end_the_row():
    search = Search(GenerationConfig(max_new_tokens=8, min_new_tokens=2), [[1, 2]], eos=[EOS], pad=PAD)
    taken = []
    for _ in range(3):
        taken += search.record(search.choose(logits_favouring(EOS, 4)))
    assert taken == [(0, 4, False), (0, 4, False), (0, EOS, True)]
    assert search.reasons == ["stop"] and search.done and search.tokens == [[4, 4, EOS]]


def test_a_request_stop_token_ends_a_row_as_eos_does():
    search = Search(GenerationConfig(max_new_tokens=8, stop_tokens=(4,)), [[1]], eos=[EOS], pad=PAD)
    assert search.record(search.choose(logits_favouring(4, 2))) == [(0, 4, True)]
    assert search.reasons == ["stop"]


def test_rows_end_at_max_new_tokens_and_an_ended_row_is_fed_padding():
    search = Search(GenerationConfig(max_new_tokens=3), [[1], [2]], eos=[EOS], pad=PAD)
    both = np.concatenate([logits_favouring(EOS), logits_favouring(2)])
    assert search.record(search.choose(both)) == [(0, EOS, True), (1, 2, False)]
    chosen = search.choose(both)
    assert chosen.tolist() == [PAD, 2]  # row 0 ended: padding, and it takes no token
    assert search.record(chosen) == [(1, 2, False)]
    assert search.record(search.choose(both)) == [(1, 2, True)]
    assert search.reasons == ["stop", "length"] and search.tokens == [[EOS], [2, 2, 2]]


def test_the_repetition_penalty_counts_the_prompt_and_each_token_chosen():
    """Logits 2.0 and 1.5 with penalty 2: a seen token's positive logit halves. Token 0 is in the prompt (1.0 <
    1.5: token 1 wins); then both are seen (1.0 > 0.75: token 0 wins)."""
    config = GenerationConfig(max_new_tokens=4, sampling=SamplingConfig(repetition_penalty=2.0))
    search = Search(config, [[0]], eos=[EOS], pad=PAD)
    logits = np.array([[2.0, 1.5, -5.0, -5.0]], dtype=np.float32)
    first = search.choose(logits)
    search.record(first)
    second = search.choose(logits)
    assert first.tolist() == [1] and second.tolist() == [0]
    assert search.context[0].tolist() == [0, 1]


def test_seeded_sampling_repeats_and_draws_from_the_kept_tokens():
    config = GenerationConfig(max_new_tokens=50, sampling=SamplingConfig(temperature=1.0, top_k=2, seed=7))
    logits = np.log(np.array([[0.1, 0.4, 0.2, 0.0001, 0.3]], dtype=np.float32))
    runs = []
    for _ in range(2):
        search = Search(config, [[1]], eos=[], pad=PAD)
        while not search.done:
            search.record(search.choose(logits))
        runs.append(search.tokens[0])
    assert runs[0] == runs[1] and len(runs[0]) == 50
    assert set(runs[0]) == {1, 4}  # top-2 keeps the two likeliest; 50 draws at 4:3 odds see both


class Fours:
    """A drafter that drafts 4 for as many tokens as it is asked."""

    tokens = 5
    distributions = ()

    def check(self, target, prompts, config) -> None:
        pass

    def start(self, prompt: list[int], config) -> "Fours":
        return self

    def push(self, token: int) -> None:
        pass

    def propose(self, most: int) -> list[int]:
        return [4] * most


def test_the_drafts_a_run_verifies_shrink_by_one_after_a_miss_and_grow_by_two_after_a_run_chosen_whole():
    """Each run: choose after the latest token, then after each draft while the one before was chosen; the logits
    favour 1 (a miss at once) or 4 (every draft chosen)."""
    search = Search(GenerationConfig(max_new_tokens=100, speculative=Fours()), [[4, 4]], eos=[EOS], pad=PAD)
    counts = []
    for favoured in [1, 1, 1, 1, 1, 1, 4, 4, 1]:
        drafts = search.drafts()
        counts.append(drafts.shape[1])
        for index in range(drafts.shape[1] + 1):
            chosen = search.choose(logits_favouring(favoured))
            search.record(chosen)
            if not search.accepts(chosen, drafts, index):
                break
    assert counts == [5, 4, 3, 2, 1, 1, 1, 3, 5]
    assert search.proposed == sum(counts) and search.accepted == 1 + 3
