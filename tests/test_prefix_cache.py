"""Prefix caching: a prompt resumed from a recent prompt's cached prefix gets the tokens and log-probabilities it
gets prefilled from nothing."""

import threading

import httpx
import numpy as np
import pytest
from test_serve import metric, serving

from runtime.artifact import SessionOptions
from runtime.cache.prefix_cache import Block, PrefixCache
from runtime.decode.engine import Engine
from runtime.decode.generator import GenerationConfig, Generator
from runtime.decode.requests import Finished, Token
from runtime.decode.sampling import SamplingConfig

CPU = SessionOptions(provider="cpu")
SHARED = [3 + (11 * i) % 300 for i in range(27)]
PROMPTS = [  # one after another: each shares a prefix with those before it, of 0, 27, 16, 27 and 24 tokens
    SHARED,
    [*SHARED, 9, 40, 41],
    [*SHARED[:16], 77, 78, 79, 80, 81],
    SHARED,  # itself: its last token is prefilled again, for the first new token's logits
    [*SHARED[:24], 5],
]


def run_in_turn(engine: Engine, prompts, config: GenerationConfig) -> list[list[Token]]:
    """Each prompt's Token events, each request submitted once the one before has ended."""
    answers = []
    for prompt in prompts:
        events, ended = [], threading.Event()

        def record(event, events=events, ended=ended):
            events.append(event)
            if not isinstance(event, Token):
                ended.set()

        engine.submit(prompt, config, record, logprobs=4)
        assert ended.wait(60)
        assert isinstance(events[-1], Finished), events[-1]
        answers.append(events[:-1])
    return answers


@pytest.mark.parametrize("preset", ["fox-tiny", "fox-pro-tiny", "fox-gqa-tiny"])  # plain, token shift, RoPE
def test_resumed_prompts_get_the_tokens_and_log_probabilities_of_a_prefill_from_nothing(exported, preset):
    generator = Generator.open(exported(preset, "static")[0].path, CPU)
    config = GenerationConfig(12, 12, sampling=SamplingConfig(temperature=0.7, top_k=40, seed=5))
    cached = Engine(generator.model, 2, prefill_budget=8, prefix_cache_bytes=1 << 30)
    uncached = Engine(generator.model, 2, prefill_budget=8)
    try:
        with_cache = run_in_turn(cached, PROMPTS, config)
        without = run_in_turn(uncached, PROMPTS, config)
    finally:
        cached.close()
        uncached.close()
    assert with_cache == without  # tokens, log-probabilities and alternatives, exactly
    alone = [generator.generate([prompt], config).tokens[0] for prompt in PROMPTS]
    assert [[event.token for event in answer] for answer in with_cache] == alone
    # blocks end every 8 tokens: 24 of prompt 1's 30 tokens, 16 of prompt 2's, 24 of prompt 3's (not 27: its
    # last token is prefilled again) and 24 of prompt 4's were restored
    assert cached.prefixes.reused == 24 + 16 + 24 + 24
    assert cached.prefixes.looked_up == sum(map(len, PROMPTS))


def block(end: int, begin: int, size: int) -> Block:
    return Block(end, begin, {"key": np.zeros(size, dtype=np.uint8)}, {})


def test_the_least_recently_used_blocks_go_first_and_a_chain_loses_its_last_blocks_first():
    cache = PrefixCache(budget_bytes=300)
    first, second = list(range(10)), [*range(5), 50, 51, 52, 53, 54]
    cache.add(first, block(5, 0, 100))
    cache.add(first, block(10, 5, 100))
    assert [b.end for b in cache.longest(first, 10)] == [5, 10]
    assert [b.end for b in cache.longest(second, 10)] == [5]  # shares the first block only
    cache.add(second, block(10, 5, 100))
    assert cache.held_bytes == 300
    cache.add([7] * 10, block(5, 0, 100))  # over the budget: the least recently used goes, first's last block
    assert [b.end for b in cache.longest(first, 10)] == [5]
    assert [b.end for b in cache.longest(second, 10)] == [5, 10]
    assert cache.longest(first, 4) == []  # no block ends within 4 tokens
    assert cache.held_bytes == 300
    assert cache.reused == 10 + 5 + 5 + 10 and cache.looked_up == 5 * 10
    cache.add(list(range(100)), block(100, 0, 301))  # larger than the budget: not kept, nothing evicted
    assert cache.held_bytes == 300


def test_the_server_answers_a_resumed_prompt_as_a_fresh_one_and_reports_the_hit_rate(exported):
    generator = Generator.open(exported("fox-pro-tiny", "static")[0].path, CPU)
    body = {"max_tokens": 10, "temperature": 0, "logprobs": 3}
    answers, hit_rates = {}, {}
    for cached in (True, False):
        options = {"prefill_budget": 8, "prefix_cache_bytes": (1 << 30) if cached else 0}
        with serving(generator, engine_options=options) as (url, _engine):
            answers[cached] = [
                httpx.post(f"{url}/v1/completions", json={**body, "prompt": prompt}, timeout=60).json()["choices"]
                for prompt in PROMPTS
            ]
            hit_rates[cached] = metric(httpx.get(f"{url}/metrics").text, "kvg_prefix_cache_hit_rate")
    assert answers[True] == answers[False]
    assert hit_rates == {True: (24 + 16 + 24 + 24) / sum(map(len, PROMPTS)), False: 0}  # as in the engine's test
