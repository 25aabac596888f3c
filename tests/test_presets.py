"""MODEL= resolution: preset names and folders, local checkpoints, and clear errors."""

import json

import pytest
import torch
from safetensors.torch import load_file

from kvg_export.fox.configuration import FoxConfig
from kvg_export.presets import MODELS_DIR, load_model, preset_names, resolve_checkpoint

EXPECTED_PRESETS = {"fox-tiny", "fox-pro-tiny", "fox-gqa-tiny", "fox-small", "fox-base", "fox-pro-760m", "fox-py",
                    "fox-pro-py"}  # fmt: skip


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVG_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_bundled_presets_are_listed():
    assert set(preset_names()) >= EXPECTED_PRESETS


def test_fox_small_has_the_benchmark_size():
    config = json.loads((MODELS_DIR / "fox-small" / "config.json").read_text())
    sizes = {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_heads", "vocab_size", "intermediate_size")}
    assert sizes == dict(hidden_size=512, num_hidden_layers=8, num_heads=8, vocab_size=32000, intermediate_size=1536)


OFFICIAL_SHAPES = {
    "fox-base": dict(hidden_size=768, num_hidden_layers=12, num_heads=12, vocab_size=32000, mlp=2048),
    "fox-pro-760m": dict(hidden_size=1536, num_hidden_layers=24, num_heads=24, vocab_size=32768, mlp=3584,
                         qk_norm=True, use_k_shift=True, use_v_shift=True, use_output_gate=True, use_output_norm=True),
}  # fmt: skip


@pytest.mark.parametrize(("preset", "shape"), OFFICIAL_SHAPES.items())
def test_the_official_shapes_are_those_of_the_released_models(preset, shape):
    """fox-base is the 125M FoX's shape and fox-pro-760m the 760M FoX-Pro's (hidden_ratio 3.5: an MLP of
    2/3 x 3.5 x 1536 = 3584)."""
    config = FoxConfig.from_pretrained(MODELS_DIR / preset)
    assert {key: config.mlp_size if key == "mlp" else getattr(config, key) for key in shape} == shape


def test_an_unknown_name_is_refused_with_the_list_of_presets(fresh_cache):
    with pytest.raises(ValueError, match=r"unknown model 'fox-huge'.*fox-pro-tiny.*fox-tiny"):
        resolve_checkpoint("fox-huge")


def test_a_folder_without_weights_is_refused(tmp_path, fresh_cache):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"needs config\.json and weight files"):
        resolve_checkpoint(tmp_path)


def test_a_checkpoint_of_another_architecture_is_refused_naming_it(tmp_path, fresh_cache):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds a 'llama' model .* not a FoX"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"holds a 'llama' model"):  # the benchmarks' LLaMA peer, a preset folder
        resolve_checkpoint(MODELS_DIR.parent / "bench" / "peer-models" / "llama-py")


def test_preset_weights_are_built_once_deterministically_and_found_by_name_or_folder(tmp_path, monkeypatch):
    built = []
    for run in ("a", "b"):
        monkeypatch.setenv("KVG_CACHE_DIR", str(tmp_path / run))
        built.append(resolve_checkpoint("fox-tiny"))
    assert built[0] != built[1]
    assert resolve_checkpoint(MODELS_DIR / "fox-tiny") == built[1]
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (built[1] / name).read_bytes() == (MODELS_DIR / "fox-tiny" / name).read_bytes()
    first, second = (load_file(p / "model.safetensors") for p in built)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_a_local_checkpoint_folder_loads_as_it_is(tmp_path, fresh_cache):
    preset_model = load_model("fox-pro-tiny")
    preset_model.save_pretrained(tmp_path / "mine")
    assert resolve_checkpoint(tmp_path / "mine") == tmp_path / "mine"
    assert load_model(tmp_path / "mine", dtype=torch.float16).dtype == torch.float16
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(load_model(tmp_path / "mine")(ids).logits, preset_model(ids).logits)
