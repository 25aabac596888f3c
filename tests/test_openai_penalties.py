"""OpenAI's presence and frequency penalties and logit_bias: against their documented formula computed token by token,
and end to end against transformers' generate() on the eager model with the same changes made to its logits, through
the Generator (plain, speculative and constrained), the engine and the server."""

import json
from collections import Counter

import httpx
import numpy as np
import pytest
import torch
from scripted_drafts import Scripted
from test_serve import MODEL, serving
from transformers import LogitsProcessor, LogitsProcessorList

from exporters.checks.references import eager_generate, left_padded_tensors
from kvg_export.presets import load_model
from runtime.artifact import SessionOptions
from runtime.decode.generator import GenerationConfig, Generator
from runtime.decode.sampling import Sampler, SamplingConfig, filtered_logits
from runtime.errors import RequestError
from runtime.structured.constraints import Constraint

CPU = SessionOptions(provider="cpu")
NEW = 24


def openai_formula(logits: np.ndarray, generated: list[list[int]], config: SamplingConfig) -> np.ndarray:
    """OpenAI's documented adjustment, one token at a time: mu[j] - c[j] * frequency - (c[j] > 0) * presence, with
    logit_bias added first and a bias of -100 a ban."""
    out = np.array(logits, dtype=np.float64)
    biases = dict(config.logit_bias)
    for row, ids in enumerate(generated):
        counts = Counter(ids)
        for token in range(out.shape[1]):
            if token in biases:
                out[row, token] = -np.inf if biases[token] == -100 else out[row, token] + biases[token]
            count = counts.get(token, 0)
            out[row, token] -= count * config.frequency_penalty + (count > 0) * config.presence_penalty
    return out


def test_the_penalties_and_the_bias_are_openais_formula():
    rng = np.random.default_rng(3)
    for case in range(200):
        batch, vocab = int(rng.integers(1, 4)), int(rng.choice([7, 40]))
        logits = (rng.standard_normal((batch, vocab)) * 2).astype(np.float32)
        generated = [rng.integers(0, vocab, int(rng.integers(0, 12))).tolist() for _ in range(batch)]
        biased = rng.choice(vocab, size=int(rng.integers(0, 4)), replace=False).tolist()
        config = SamplingConfig(
            presence_penalty=float(rng.uniform(-2, 2)), frequency_penalty=float(rng.uniform(-2, 2)),
            logit_bias=tuple((t, float(rng.choice([-100.0, -3.5, 0.25, 7.0]))) for t in biased),
        )  # fmt: skip
        got = filtered_logits(logits, config, generated=generated)
        want = openai_formula(logits, generated, config)
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=f"case {case}")
        finite = np.isfinite(want)
        # float32's few roundings (eps 1.2e-7) of a bias and two penalties, against the float64 formula
        np.testing.assert_allclose(got[finite], want[finite], rtol=4e-7, atol=4e-7, err_msg=f"case {case}")
        np.testing.assert_array_equal(Sampler(config).choose(logits, generated=generated), want.argmax(-1))


def test_a_bias_of_minus_100_bans_and_of_100_all_but_chooses():
    logits = np.array([[5.0, 1.0, 0.0, -1.0]], dtype=np.float32)
    assert Sampler(SamplingConfig(logit_bias=((0, -100.0),))).choose(logits).tolist() == [1]
    assert Sampler(SamplingConfig(logit_bias=((3, 100.0),))).choose(logits).tolist() == [3]
    sampled = SamplingConfig(temperature=1.0, seed=0, logit_bias=((0, -100.0), (1, -100.0)))
    assert set(Sampler(sampled).choose(np.repeat(logits, 500, axis=0)).tolist()) == {2, 3}
    with pytest.raises(ValueError, match="forbid every token"):
        filtered_logits(logits, SamplingConfig(logit_bias=tuple((t, -100.0) for t in range(4))))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"logit_bias": ((3, 100.5),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((96, 1.0),)}, "logit_bias"),  # the vocabulary below is 96 ids
    ],
)
def test_values_openai_refuses_are_refused_naming_the_field(fields, param):
    with pytest.raises(RequestError, match=param) as refused:
        SamplingConfig(**fields).validate(vocab=96)
    assert refused.value.param == param


class OpenAIPenalties(LogitsProcessor):
    """The same adjustment in torch on the eager model's scores, over the tokens after the prompt."""

    def __init__(self, config: SamplingConfig, prompt_width: int):
        self.config, self.width = config, prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.width :].tolist()
        return torch.from_numpy(openai_formula(scores.numpy(), generated, self.config).astype(np.float32))


def eager_tokens(model, prompts: list[list[int]], config: SamplingConfig) -> list[list[int]]:
    """transformers' greedy generate() on the left-padded batch, the adjustment as a logits processor."""
    ids, mask = left_padded_tensors(prompts)
    width = ids.shape[1]
    processors = LogitsProcessorList([OpenAIPenalties(config, width)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             pad_token_id=0, logits_processor=processors)  # fmt: skip
    return out[:, width:].tolist()


# Strong enough that the greedy tokens part from plain decoding's within a few steps
PENALISED = SamplingConfig(presence_penalty=1.5, frequency_penalty=0.75, logit_bias=((5, -100.0), (7, 2.5)))


@pytest.fixture(scope="module")
def penalised(exported):
    """(generator, prompts, eager's tokens with the penalties) on fox-pro-tiny's static artifact."""
    generator = Generator.open(exported("fox-pro-tiny", "static")[0].path, CPU)
    model = load_model("fox-pro-tiny")
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, model.config.vocab_size, n).tolist() for n in (9, 4)]
    want = eager_tokens(model, prompts, PENALISED)
    plain, _ = eager_generate(model, prompts, NEW)
    assert want != plain  # the adjustment changes what greedy decoding chooses
    return generator, prompts, want


def test_the_generator_chooses_what_eager_chooses_with_the_same_adjustment(penalised):
    generator, prompts, want = penalised
    config = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW, sampling=PENALISED)
    assert generator.generate(prompts, config).tokens == want
    assert not any(5 in row for row in want)  # banned


def test_speculative_verification_keeps_the_adjustment(penalised):
    """Drafts right at some positions and wrong at others (eager's own tokens, or another): a run verifying several
    chooses each by the history up to its draft."""
    generator, prompts, want = penalised
    vocab = generator.model.artifact.vocab_size
    drafts = Scripted.of(prompts, want, lambda row, position: (3 * position + row) % 5 < 3, vocab)
    config = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW, sampling=PENALISED, speculative=drafts)
    result = generator.generate(prompts, config)
    assert result.tokens == want
    assert 0 < result.drafts_accepted < result.drafts_proposed


def test_a_constrained_answer_takes_the_bias_among_the_texts_it_allows(exported):
    """Of two allowed answers, the one greedy decoding picks unbiased loses its first token to a ban."""
    generator = Generator.open(exported("fox-py", "static")[0].path, CPU)
    options = ["yes", "no"]
    config = GenerationConfig(max_new_tokens=8, constraint=Constraint.choice(options))
    [first] = generator.generate(["Answer: "], config).text
    [banned] = generator.model.tokenizer.encode_batch([first])
    biased = GenerationConfig(max_new_tokens=8, constraint=Constraint.choice(options),
                              sampling=SamplingConfig(logit_bias=((banned[0], -100.0),)))  # fmt: skip
    assert generator.generate(["Answer: "], biased).text == [next(o for o in options if o != first)]


def test_the_server_answers_what_eager_chooses_with_the_same_adjustment(penalised):
    generator, prompts, want = penalised
    body = {"max_tokens": NEW, "min_tokens": NEW, "temperature": 0, "presence_penalty": 1.5,
            "frequency_penalty": 0.75, "logit_bias": {"5": -100, "7": 2.5}}  # fmt: skip
    with serving(generator) as (url, _engine):
        for prompt, tokens in zip(prompts, want, strict=True):
            answer = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, **body}, timeout=60)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["token_ids"] == tokens
        bad = httpx.post(f"{url}/v1/completions", json={"prompt": prompts[0], "logit_bias": {"one": 1}}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"
        outside = {"prompt": prompts[0], "logit_bias": {str(generator.model.artifact.vocab_size): 1}, "model": MODEL}
        refused = httpx.post(f"{url}/v1/completions", content=json.dumps(outside), timeout=60)
        assert refused.status_code == 400 and "outside the vocabulary" in refused.json()["error"]["message"]
