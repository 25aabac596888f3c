"""Speculative decoding in the engine: each row verifies its own drafts in one step and keeps its own count of them
(the other slots become holes, or, where FoX-Pro shifts tokens, the row goes back and feeds its kept tokens again),
and each request still gets the tokens it gets alone, as requests join and leave and the rows are compacted; through
kvg-serve too, which reports the drafts accepted in /metrics."""

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import pytest
from scripted_drafts import Scripted
from test_engine import CPU, Collector, schedule, served, watch_compactions
from test_serve import metric, run_cli, serving

from runtime.decode.engine import Engine
from runtime.decode.generator import GenerationConfig, Generator
from runtime.decode.model import Model
from runtime.decode.sampling import SamplingConfig
from runtime.errors import RequestError
from runtime.speculative.draft_model import DraftModel
from runtime.speculative.prompt_lookup import PromptLookup

# (preset, attention): shift states or none, through the fused operator and the portable graph
KINDS = [("fox-pro-tiny", "auto"), ("fox-pro-tiny", "standard"), ("fox-tiny", "auto")]


@pytest.mark.parametrize("kind", KINDS, ids=["-".join(kind) for kind in KINDS])
def test_speculating_requests_in_a_running_batch_get_the_tokens_they_get_alone(exported, monkeypatch, kind):
    """Drafts right at positions that differ by request, so rows keep different counts from one step; greedy and
    seeded sampling; the rows outgrow the cache and are compacted, holes and all."""
    preset, attention = kind
    generator = Generator.open(exported(preset, "static", attention=attention)[0].path, CPU)
    requests, triggers = schedule(20, seed=11)
    alone = [generator.generate([prompt], config).tokens[0] for prompt, config in requests]
    drafts = Scripted.of([prompt for prompt, _ in requests], alone, lambda row, position: (position + row) % 4 != 1,
                         generator.model.artifact.vocab_size)  # fmt: skip
    compactions = watch_compactions(monkeypatch)
    engine = Engine(generator.model, 3, max_queue=len(requests), speculative_max_rows=3)
    speculating = [(prompt, replace(config, speculative=drafts)) for prompt, config in requests]
    assert served(engine, speculating, triggers) == alone
    assert compactions, "no compaction happened"
    assert 0 < engine.drafts_accepted < engine.drafts_proposed


def test_prompt_lookup_in_the_engine_is_refused_where_group_query_attention_cannot_verify_several_rows(exported):
    generator = Generator.open(exported("fox-tiny", "static", attention="gqa")[0].path, CPU)
    engine = Engine(generator.model, max_batch=2)
    try:
        with pytest.raises(RequestError, match="GroupQueryAttention takes for one row only"):
            engine.check([5, 6, 7], GenerationConfig(speculative=PromptLookup()))
    finally:
        engine.close()


def test_kvg_serve_speculates_for_every_request_and_reports_the_acceptance_in_its_metrics(exported):
    """Prompt lookup for requests from several clients at once: each answer is the Generator's alone, and /metrics
    counts the drafts the ended requests verified and kept."""
    generator = Generator.open(exported("fox-tiny", "static")[0].path, CPU)
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4, [12, 13] * 5, [14, 15, 16, 17, 18] * 2]
    config = GenerationConfig(40, 40)
    expected = [generator.generate([prompt], config).tokens[0] for prompt in prompts]
    with serving(generator, max_batch=3, engine_options={"speculative": PromptLookup(tokens=4)}) as (url, engine):
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda prompt: complete(url, prompt), prompts))
        metrics = httpx.get(f"{url}/metrics").text
    assert answers == expected
    proposed, accepted = (metric(metrics, f"kvg_speculative_drafts_{name}") for name in ("proposed", "accepted"))
    assert (proposed, accepted) == (engine.drafts_proposed, engine.drafts_accepted) and 0 < accepted < proposed
    assert metric(metrics, "kvg_speculative_acceptance_rate") == pytest.approx(accepted / proposed)


@pytest.mark.parametrize(("engine_rows", "proposer_rows"), [(0, math.inf), (None, 0)])
def test_no_step_verifies_drafts_while_more_requests_run_than_the_limit(exported, engine_rows, proposer_rows):
    """A limit of 0, the engine's or (by default) the proposer's own: requests whose drafts would all be right are
    served a token a step, the same tokens."""
    generator = Generator.open(exported("fox-tiny", "static")[0].path, CPU)
    prompts, config = [[5, 6, 7, 8], [9, 10, 11]], GenerationConfig(20, 20)
    expected = [generator.generate([prompt], config).tokens[0] for prompt in prompts]
    drafts = Scripted.of(prompts, expected, lambda row, position: True, generator.model.artifact.vocab_size)
    drafts = replace(drafts, max_rows=proposer_rows)
    engine, got = Engine(generator.model, 2, speculative=drafts, speculative_max_rows=engine_rows), Collector(2)
    for index, prompt in enumerate(prompts):
        engine.submit(prompt, config, got.emit(index))
    got.wait(len(prompts))
    engine.close()
    assert [got.tokens[i] for i in range(len(prompts))] == expected and engine.drafts_proposed == 0


def complete(url: str, prompt: list[int]) -> list[int]:
    answer = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 40, "min_tokens": 40, "temperature": 0},
        timeout=60,
    )
    return answer.json()["choices"][0]["token_ids"]


def test_kvg_serve_refuses_a_speculative_that_names_nothing(exported):
    static = exported("fox-tiny", "static")[0].path
    refused = run_cli(str(static), "--speculative", str(static.parent / "nowhere"), "--provider", "cpu")
    assert refused.wait(60) == 2 and "--speculative takes ngram or a folder made by kvg-export" in refused.stderr.read()


def test_a_draft_model_drafts_for_each_request_in_the_engine(exported):
    """fox-tiny's dynamic artifact drafting for its static one (the same weights): each request's draft keeps a
    cache of its own and every draft is kept. Greedy, the tokens are the requests' alone; sampled (where speculative
    sampling's draws are not plain decoding's), those the Generator draws with the same draft and seed."""
    target = Generator.open(exported("fox-tiny", "static")[0].path, CPU)
    draft = DraftModel(Model.open(exported("fox-tiny", "dynamic")[0].path, CPU), tokens=3)
    sampled = GenerationConfig(30, 30, sampling=SamplingConfig(0.9, 20, seed=4))
    requests = [([5, 6, 7], GenerationConfig(30, 30)), ([8, 9], GenerationConfig(24, 24)), ([10, 11, 12], sampled)]
    expected = [target.generate([prompt], config).tokens[0] for prompt, config in requests[:2]]
    expected.append(target.generate([requests[2][0]], replace(sampled, speculative=draft)).tokens[0])
    engine, got = Engine(target.model, 3, speculative=draft, speculative_max_rows=3), Collector(len(requests))
    for index, (prompt, config) in enumerate(requests):
        engine.submit(prompt, config, got.emit(index))
    got.wait(len(requests))
    engine.close()
    assert [got.tokens[i] for i in range(len(requests))] == expected
    assert 0 < engine.drafts_accepted == engine.drafts_proposed
