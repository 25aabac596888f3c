"""Beam search in the Generator against transformers' generate(num_beams=...) on the eager model, token for token:
beams forked from one prefill, copied over one another as they take each other's places (FoX-Pro's shift states
too), hypotheses ending early (a stop token the eager search takes too) or at max_new_tokens, each early_stopping
rule and length penalty, several answers a prompt."""

import numpy as np
import pytest
import torch

from exporters.checks.references import left_padded_tensors
from kvg_export.presets import load_model
from runtime.artifact import SessionOptions
from runtime.cli import generate as cli
from runtime.decode.beam_search import BeamSearch
from runtime.decode.engine import Engine
from runtime.decode.generator import GenerationConfig, Generator
from runtime.decode.sampling import SamplingConfig
from runtime.errors import RequestError

CPU = SessionOptions(provider="cpu")
NEW = 12


def eager_beams(model, prompts, beams: BeamSearch, answers: int, eos: list[int], min_new: int = 0):
    """transformers' beam search on the left-padded batch: each answer's tokens, up to and with its eos id."""
    ids, mask = left_padded_tensors(prompts)
    width = ids.shape[1]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=min_new,
                             num_beams=beams.num_beams, num_return_sequences=answers, do_sample=False,
                             length_penalty=beams.length_penalty, early_stopping=beams.early_stopping,
                             eos_token_id=eos, pad_token_id=0)  # fmt: skip
    answers = []
    for row in out[:, width:].tolist():
        ends = [i for i, token in enumerate(row) if token in eos]
        answers.append(row[: ends[0] + 1] if ends else row)
    return answers


@pytest.mark.parametrize(
    ("preset", "cache", "beams", "answers", "stopped"),
    [("fox-pro-tiny", "static", BeamSearch(4), 2, True),
     ("fox-pro-tiny", "dynamic", BeamSearch(3, length_penalty=0.5, early_stopping=True), 3, True),
     ("fox-tiny", "dynamic", BeamSearch(4, length_penalty=2.0, early_stopping="never"), 1, False),
     ("fox-pro-tiny", "static", BeamSearch(2, length_penalty=2.0, early_stopping="never"), 1, None),  # where "never"
     # searches on past the step at which False's heuristic would stop
     ("fox-gqa-tiny", "static", BeamSearch(2, early_stopping=False), 2, None)],
)  # fmt: skip
def test_beams_choose_what_transformers_beam_search_chooses(exported, preset, cache, beams, answers, stopped):
    """`stopped`: whether some answer ends with the stop token (a long length penalty favours the longest)."""
    generator = Generator.open(exported(preset, cache)[0].path, CPU)
    model = load_model(preset)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, model.config.vocab_size, n).tolist() for n in (8, 5)]
    greedy = generator.generate(prompts, GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW)).tokens
    stop = greedy[0][3]  # met early by some beam: hypotheses end before max_new_tokens
    eos = sorted({*generator.model.eos, stop})
    want = eager_beams(model, prompts, beams, answers, eos)
    config = GenerationConfig(max_new_tokens=NEW, stop_tokens=(stop,), beams=beams, num_return_sequences=answers)
    got = generator.generate(prompts, config)
    assert got.tokens == want
    assert stopped is None or any(tokens[-1] == stop for tokens in want) == stopped
    assert [reason == "stop" for reason in got.finish_reasons] == [tokens[-1] in eos for tokens in want]


def test_min_new_tokens_holds_the_stop_tokens_back_as_transformers_does(exported):
    generator = Generator.open(exported("fox-pro-tiny", "static")[0].path, CPU)
    model = load_model("fox-pro-tiny")
    prompts = [[5, 9, 14, 3]]
    stop = generator.generate(prompts, GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW)).tokens[0][1]
    eos = sorted({*generator.model.eos, stop})
    want = eager_beams(model, prompts, BeamSearch(3), 1, eos, min_new=6)
    config = GenerationConfig(max_new_tokens=NEW, min_new_tokens=6, stop_tokens=(stop,), beams=BeamSearch(3))
    assert generator.generate(prompts, config).tokens == want


@pytest.mark.parametrize(
    ("config", "message"),
    [(GenerationConfig(beams=BeamSearch(2), num_return_sequences=3), "at least as many beams"),
     (GenerationConfig(beams=BeamSearch(0)), "num_beams must be >= 1"),
     (GenerationConfig(beams=BeamSearch(2, early_stopping="soon")), "early_stopping must be"),
     (GenerationConfig(beams=BeamSearch(2), sampling=SamplingConfig(temperature=0.7)), "sampling"),
     (GenerationConfig(beams=BeamSearch(2), sampling=SamplingConfig(presence_penalty=1.0)), "penalties"),
     (GenerationConfig(beams=BeamSearch(9)), r"batch 18 \(2 prompts x 9 beams\)")],
)  # fmt: skip
def test_what_beam_search_cannot_take_is_refused_naming_it(exported, config, message):
    generator = Generator.open(exported("fox-tiny", "static")[0].path, CPU)
    with pytest.raises(RequestError, match=message):
        generator.generate([[5, 6], [7]], config)


def test_kvg_generate_searches_with_beams(exported, capsys):
    folder = str(exported("fox-pro-tiny", "static")[0].path)
    flags = ["--ids", "5,9,14,3", "--max-new-tokens", str(NEW), "--provider", "cpu", "--num-beams", "3",
             "--length-penalty", "0.5", "--early-stopping", "never", "--num-return-sequences", "2"]  # fmt: skip
    assert cli.main([folder, *flags]) == 0
    printed = capsys.readouterr().out
    beams = BeamSearch(3, length_penalty=0.5, early_stopping="never")
    config = GenerationConfig(max_new_tokens=NEW, beams=beams, num_return_sequences=2)
    want = Generator.open(folder, CPU).generate([[5, 9, 14, 3]], config)
    assert printed == "".join(f"{text}\n" for text in want.text)


def test_the_engine_refuses_beams(exported):
    """Its rows come and go token by token; beams are the Generator's so far."""
    generator = Generator.open(exported("fox-tiny", "static")[0].path, CPU)
    with pytest.raises(RequestError, match="search with beams in the Generator"):
        Engine(generator.model, 2).check([5, 6], GenerationConfig(max_new_tokens=4, beams=BeamSearch(2)))
