"""Several answers from one prompt in the Generator (`num_return_sequences`): the prompt is prefilled once and its row
forked, keys, values, gates, shift states and pruned windows, into the rows of its answers, which then decode as
rows prefilled each on their own do: greedy, they are transformers' generate() on the eager model; sampled, the
same seed draws the same tokens as the prompts repeated in the batch (a prefill each). tests/test_pruning.py forks
rows after pruning."""

import numpy as np
import pytest

from exporters.checks.references import eager_generate
from exporters.checks.validate import greedy_disagreement
from kvg_export.presets import load_model
from runtime.artifact import SessionOptions
from runtime.cli import generate as cli
from runtime.decode.engine import Engine
from runtime.decode.generator import GenerationConfig, Generator
from runtime.decode.sampling import SamplingConfig
from runtime.errors import RequestError

CPU = SessionOptions(provider="cpu")
NEW = 16
SAMPLED = SamplingConfig(temperature=1.0, top_k=20, seed=5)


def repeated(prompts: list[list[int]], answers: int) -> list[list[int]]:
    """Each prompt `answers` times in a row, the order of the forked rows."""
    return [prompt for prompt in prompts for _ in range(answers)]


@pytest.mark.parametrize(("preset", "cache"), [("fox-pro-tiny", "static"), ("fox-pro-tiny", "dynamic"),
                                               ("fox-gqa-tiny", "dynamic")])  # fmt: skip
def test_greedy_answers_are_eagers_for_each_prompt(exported, preset, cache):
    generator = Generator.open(exported(preset, cache)[0].path, CPU)
    model = load_model(preset)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, model.config.vocab_size, n).tolist() for n in (7, 3)]
    want_tokens, want_logits = eager_generate(model, repeated(prompts, 3), NEW)
    config = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW, num_return_sequences=3)
    got = generator.generate(prompts, config, keep_logits=True)
    assert len(got.tokens) == 6
    assert greedy_disagreement(got.tokens, want_tokens, got.step_logits, want_logits, "float32") is None


@pytest.mark.parametrize(("preset", "cache"), [("fox-pro-tiny", "static"), ("fox-tiny", "dynamic")])
def test_sampled_answers_draw_what_rows_prefilled_each_on_their_own_draw(exported, preset, cache):
    generator = Generator.open(exported(preset, cache)[0].path, CPU)
    prompts = [[5, 9, 11, 4], [7, 3]]
    forked = generator.generate(prompts, GenerationConfig(max_new_tokens=NEW, sampling=SAMPLED, num_return_sequences=4))
    apart = generator.generate(repeated(prompts, 4), GenerationConfig(max_new_tokens=NEW, sampling=SAMPLED))
    assert forked.tokens == apart.tokens
    assert len({tuple(tokens) for tokens in forked.tokens[:4]}) > 1  # the answers differ


def test_more_answers_than_rows_is_refused_naming_both(exported):
    generator = Generator.open(exported("fox-tiny", "static")[0].path, CPU)
    config = GenerationConfig(max_new_tokens=4, num_return_sequences=9)
    with pytest.raises(RequestError, match=r"batch 18 \(2 prompts x 9 answers\) exceeds this artifact's max batch"):
        generator.generate([[5, 6], [7]], config)
    with pytest.raises(RequestError, match="num_return_sequences must be >= 1"):
        generator.generate([[5, 6]], GenerationConfig(num_return_sequences=0))


def test_kvg_generate_prints_each_answer_after_the_other(exported, capsys):
    folder = str(exported("fox-tiny", "static")[0].path)
    flags = ["--ids", "5,6,7", "--max-new-tokens", "6", "--temperature", "1", "--seed", "4", "--provider", "cpu"]
    assert cli.main([folder, *flags, "--num-return-sequences", "3"]) == 0
    printed = capsys.readouterr().out
    sampling = SamplingConfig(temperature=1.0, seed=4)
    config = GenerationConfig(max_new_tokens=6, sampling=sampling, num_return_sequences=3)
    want = Generator.open(folder, CPU).generate([[5, 6, 7]], config)
    assert len(want.text) == 3 and printed == "".join(f"{text}\n" for text in want.text)


def test_the_engine_refuses_several_answers_a_request(exported):
    """It answers a request with one row; a request's several answers are the Generator's so far."""
    generator = Generator.open(exported("fox-tiny", "static")[0].path, CPU)
    with pytest.raises(RequestError, match="one sequence"):
        Engine(generator.model, 2).check([5, 6], GenerationConfig(max_new_tokens=4, num_return_sequences=2))
