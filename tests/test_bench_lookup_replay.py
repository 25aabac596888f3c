"""bench/lookup_replay.py's walk through a continuation: the runs it counts and what each costs, on texts whose
runs can be worked out by hand."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from lookup_replay import best_occurrence_time, rule_time
from speculative import LOOKUP

COST = [1.0 + 0.25 * k + 0.01 * k * k for k in range(LOOKUP.tokens + 1)]  # a run verifying k drafts


def test_a_continuation_that_never_repeats_is_a_run_a_token_after_the_prompts():
    prompt, truth = list(range(100, 140)), list(range(20))
    assert rule_time(prompt, truth, COST) == (19 * COST[0], 0, 0)
    assert rule_time(prompt, truth, COST, cut=True)[0] == 19 * COST[0]
    assert best_occurrence_time(prompt, truth, COST) == 19 * COST[0]


def test_a_continuation_that_repeats_the_prompt_is_guessed_whole_after_its_second_token():
    """The prompt read again: after its first token (the prompt's run's) the final two tokens, the prompt's last and
    first, occurred nowhere (a run of one token); after the second, the prompt's first two did, and what followed
    them is the rest: runs of eight right drafts, nine tokens each, 2 + 3 * 9 = 29."""
    prompt = list(range(100, 129))
    assert best_occurrence_time(prompt, prompt, COST) == pytest.approx(COST[0] + 3 * COST[LOOKUP.tokens])
