"""transformers' generate() on an artifact (OnnxFoxForCausalLM) against the eager model's, and `optimum-cli export
onnx` on FoX models."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

from exporters.checks.references import eager_generate
from exporters.checks.validate import TOLERANCES, difference
from kvg_export.cache import GatedCache
from kvg_export.onnx_model import REFEED_ALONE, OnnxFoxForCausalLM
from kvg_export.presets import load_model
from runtime.artifact import SessionOptions
from runtime.decode.generator import GenerationConfig, Generator

PRESETS = ("fox-tiny", "fox-pro-tiny", "fox-gqa-tiny", "fox-small", "fox-py", "fox-pro-py")
NEW_TOKENS = 12
OPTIMUM_CLI = Path(sys.executable).parent / "optimum-cli"


def left_padded(vocab: int, lengths=(5, 11, 8), seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, -length:] = torch.randint(3, vocab, (length,), generator=generator)
        mask[row, -length:] = 1
    return ids, mask


def generate(model, ids, mask, **options):
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0,
            return_dict_in_generate=True, output_logits=True, **options,
        )  # fmt: skip


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("preset", PRESETS)
def test_generate_on_the_artifact_is_eager_generate(exported, preset, cache):
    """Greedy on a left-padded batch of 3 and 4-beam search on one prompt: the same tokens as the eager model's
    generate(), and greedy logits within the export's tolerance."""
    model = OnnxFoxForCausalLM.from_pretrained(exported(preset, cache)[0].path, provider="cpu")
    eager = load_model(preset)
    ids, mask = left_padded(eager.config.vocab_size)
    eager_options = {"cache_implementation": "static"} if cache == "static" else {}
    want, got = generate(eager, ids, mask, **eager_options), generate(model, ids, mask)
    assert torch.equal(got.sequences, want.sequences)
    worst = max(difference(g, w) for g, w in zip(got.logits, want.logits, strict=True))
    assert worst < TOLERANCES["float32"]
    beams, row = {"num_beams": 4, "num_return_sequences": 2}, ids[1:2]  # the unpadded row: 4 rows, not 12
    one = torch.ones_like(row)
    assert torch.equal(generate(model, row, one, **beams).sequences, generate(eager, row, one, **beams).sequences)


class Collect(BaseStreamer):
    def __init__(self):
        self.steps = []

    def put(self, value):
        self.steps.append(value.tolist())

    def end(self):
        self.steps.append("end")


def test_sampling_and_a_streamer_work_as_on_the_eager_model(exported):
    """Seeded sampling draws what the eager model draws; a streamer gets the prompt, each token, then the end."""
    model = OnnxFoxForCausalLM.from_pretrained(exported("fox-pro-tiny", "static")[0].path, provider="cpu")
    eager = load_model("fox-pro-tiny")
    ids = torch.tensor([[5, 6, 7, 8]])
    sampled = []
    for generator in (model, eager):
        torch.manual_seed(3)
        options = {"cache_implementation": "static"} if generator is eager else {}
        sampled.append(generate(generator, ids, torch.ones_like(ids), do_sample=True, top_k=20, **options).sequences)
    assert torch.equal(*sampled)
    streamer = Collect()
    out = generate(model, ids, torch.ones_like(ids), streamer=streamer).sequences
    assert streamer.steps == [ids.tolist(), *([token] for token in out[0, 4:].tolist()), "end"]


def test_too_many_rows_for_a_static_artifact_are_refused(exported):
    path = exported("fox-tiny", "static")[0].path
    model = OnnxFoxForCausalLM.from_pretrained(path, provider="cpu")
    limit = json.loads((path / "kvg_config.json").read_text())["cache"]["max_batch"]
    ids = torch.ones(limit // 2 + 1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=f"exceed this artifact's max_batch {limit}; re-export it"):
        generate(model, ids, torch.ones_like(ids), num_beams=2)


ASSISTED_TOKENS = 32
LOOKUP_PROMPT = torch.tensor([list(range(40, 52)) * 2])  # fox-pro-tiny takes some drafts its n-grams propose


def greedy(model, ids, new_tokens=ASSISTED_TOKENS, **options):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0, **options)  # fmt: skip


@pytest.fixture
def crops(monkeypatch) -> list[tuple[int, int]]:
    """Every cache crop while the test runs, as (length before, length asked for)."""
    seen, crop = [], GatedCache.crop

    def spy(cache, max_length):
        seen.append((cache.get_seq_length(), max_length))
        crop(cache, max_length)

    monkeypatch.setattr(GatedCache, "crop", spy)
    return seen


@pytest.mark.parametrize(
    ("cache", "attention"), [("dynamic", "auto"), ("static", "auto"), ("dynamic", "standard"), ("static", "gqa")]
)
def test_prompt_lookup_gives_plain_greedy_tokens_through_shift_states(exported, crops, cache, attention):
    """FoX-Pro's shift states are the latest run's last token's, so a crop among a run's drafts goes back to the
    run's start and feeds the tokens kept again: the first round's prompt on its own, later rounds' before the next
    drafts. The tokens are plain greedy's, though rounds took drafts and refused some."""
    path = exported("fox-pro-tiny", cache, attention=attention)[0].path
    model = OnnxFoxForCausalLM.from_pretrained(path, provider="cpu")
    want = greedy(model, LOOKUP_PROMPT)
    assert not crops
    assert torch.equal(greedy(model, LOOKUP_PROMPT, prompt_lookup_num_tokens=4), want)
    assert len(crops) < ASSISTED_TOKENS  # fewer rounds than tokens: drafts taken
    assert crops[0][0] > crops[0][1] > REFEED_ALONE  # the prompt's run cut: the prompt fed again on its own
    assert sum(length > kept for length, kept in crops) > 2


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize(("target", "draft"), [("fox-pro-tiny", "fox-pro-tiny"), ("fox-pro-tiny", "fox-tiny"),
                                               ("fox-tiny", "fox-pro-tiny")])  # fmt: skip
def test_a_draft_model_gives_plain_greedy_tokens_and_drafts_its_own_greedy_tokens(monkeypatch, exported, cache,
                                                                                   target, draft):  # fmt: skip
    """assistant_model: the target's plain greedy tokens, and each round's drafts the draft model's greedy tokens
    from a new cache, though a FoX-Pro draft's cache was cropped among runs whose drafts the target refused. A model
    drafting for itself has every draft taken."""
    model, assistant = (OnnxFoxForCausalLM.from_pretrained(exported(preset, cache)[0].path, provider="cpu")
                        for preset in (target, draft))  # fmt: skip
    rounds, propose = [], assistant.generate

    def spy(**options):
        out = propose(**options)
        rounds.append((options["input_ids"], out.sequences))
        return out

    monkeypatch.setattr(assistant, "generate", spy)
    assert torch.equal(greedy(model, LOOKUP_PROMPT, assistant_model=assistant), greedy(model, LOOKUP_PROMPT))
    monkeypatch.undo()
    for ids, drafted in rounds:
        assert torch.equal(greedy(assistant, ids, drafted.shape[1] - ids.shape[1]), drafted)
    # a round refused drafts where the next round's input does not start with them
    refused = [not torch.equal(ids[:, : out.shape[1]], out) for (_, out), (ids, _) in itertools.pairwise(rounds)]
    assert not any(refused) if target == draft else sum(refused) > 2


def test_assisted_sampling_repeats_with_its_seed(exported):
    """Sampling with prompt lookup and with a draft model (speculative sampling): a seed draws the same tokens
    again."""
    model = OnnxFoxForCausalLM.from_pretrained(exported("fox-pro-tiny", "static")[0].path, provider="cpu")
    drafts = exported("fox-tiny", "static")[0].path

    def sample(**options):
        torch.manual_seed(7)
        with torch.no_grad():
            return model.generate(LOOKUP_PROMPT, attention_mask=torch.ones_like(LOOKUP_PROMPT), do_sample=True,
                                  top_k=20, max_new_tokens=ASSISTED_TOKENS, pad_token_id=0, **options)  # fmt: skip

    def draft():  # a new one for each draw: generate() tunes a draft model's settings as it goes
        return OnnxFoxForCausalLM.from_pretrained(drafts, provider="cpu")

    for draws in ([sample(prompt_lookup_num_tokens=4) for _ in range(2)],
                  [sample(assistant_model=draft()) for _ in range(2)]):  # fmt: skip
        assert torch.equal(*draws) and draws[0].shape[1] == LOOKUP_PROMPT.shape[1] + ASSISTED_TOKENS


def test_optimum_cli_exports_a_fox_checkpoint_to_an_artifact_the_runtime_serves(tmp_path):
    out = tmp_path / "artifact"
    model = Path(__file__).resolve().parent.parent / "models" / "fox-tiny"
    task = ["--task", "text-generation-with-past"]
    command = [str(OPTIMUM_CLI), "export", "onnx", "--model", str(model), *task, str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "kvg_config.json").read_text())["validation"]["passed"]
    eager = load_model("fox-tiny")
    ids, mask = left_padded(eager.config.vocab_size)
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    want, _ = eager_generate(eager, prompts, NEW_TOKENS)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    assert Generator.open(out, SessionOptions(provider="cpu")).generate(prompts, config).tokens == want


def test_optimum_cli_refuses_a_fox_export_without_the_cache_and_writes_nothing(tmp_path):
    out = tmp_path / "a"
    command = [str(OPTIMUM_CLI), "export", "onnx", "--model", "fox-tiny", "--task", "text-generation", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "use --task text-generation-with-past" in result.stderr
    assert list(tmp_path.iterdir()) == []
