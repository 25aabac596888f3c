"""The trained presets as a fresh clone has them: committed weights that load, export and generate at once."""

import json
import platform
import shutil

import pytest
import torch
from safetensors import safe_open

from kvg_export.corpus import SPLITS, describe, read_split
from kvg_export.presets import MODELS_DIR, load_model, resolve_checkpoint
from runtime.artifact import SessionOptions
from runtime.decode.generator import GenerationConfig, Generator

TRAINED = ("fox-py", "fox-pro-py")
PROMPT = "def __init__(self, name, value=None):\n"


@pytest.mark.parametrize("preset", TRAINED)
def test_a_trained_preset_is_its_own_checkpoint_folder_and_builds_nothing(preset, tmp_path, monkeypatch):
    monkeypatch.setenv("KVG_CACHE_DIR", str(tmp_path / "cache"))
    assert resolve_checkpoint(preset) == MODELS_DIR / preset
    assert not (tmp_path / "cache").exists()


def test_a_trained_preset_missing_its_weights_says_how_to_get_them_back(tmp_path):
    copy = tmp_path / "fox-py"
    shutil.copytree(MODELS_DIR / "fox-py", copy, ignore=shutil.ignore_patterns("model.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"has no weights.*make train PRESET=fox-py"):
        resolve_checkpoint(copy)


def test_the_trained_presets_keep_the_official_state_dict_names():
    with safe_open(MODELS_DIR / "fox-pro-py" / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert {"model.embeddings.weight", "lm_head.weight", "model.layers.0.attn.fgate_proj.weight",
            "model.layers.0.attn.k_proj.linear.weight", "model.layers.0.attn.k_proj.shift_proj.weight",
            "model.layers.0.attn.ogate_proj.weight", "model.layers.0.mlp.gate_proj.weight"} <= names  # fmt: skip


def test_the_trained_presets_weights_fit_their_budget():
    assert sum((MODELS_DIR / p / "model.safetensors").stat().st_size for p in TRAINED) <= 25_000_000


@pytest.mark.parametrize("preset", TRAINED)
def test_the_training_report_names_the_corpus_it_was_trained_on(preset):
    recorded = json.loads((MODELS_DIR / preset / "training.json").read_text())["corpus"]
    if recorded["python"] != platform.python_version():  # this Python's stdlib is another corpus
        pytest.skip(f"trained on Python {recorded['python']}'s stdlib; this is {platform.python_version()}")
    assert recorded == describe({name: read_split(name) for name in SPLITS})


@pytest.mark.parametrize("preset", TRAINED)
def test_the_training_report_puts_the_test_perplexity_below_the_unigram_one(preset):
    """Both measured at training on its own held-out split, whatever Python runs this."""
    report = json.loads((MODELS_DIR / preset / "training.json").read_text())
    assert report["test"]["perplexity"] < report["test"]["unigram_perplexity"]


@pytest.mark.parametrize(("preset", "cache"), [("fox-py", "dynamic"), ("fox-pro-py", "static")])
def test_a_trained_preset_exports_and_the_runtime_continues_python_as_eager_does(exported, preset, cache):
    artifact = exported(preset, cache)[0].path
    generator = Generator.open(artifact, SessionOptions(provider="cpu"))
    got = generator.generate(PROMPT, GenerationConfig(max_new_tokens=32))
    ids = torch.tensor([generator.model.tokenizer.encode(PROMPT)])
    with torch.no_grad():
        want = load_model(preset).generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert got.tokens[0] == want[0, ids.shape[1] :].tolist()
    assert got.text[0].isascii() and "\ufffd" not in got.text[0]
