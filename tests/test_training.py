"""Training a preset from nothing: repeatable, resumable, safe to interrupt, and reporting what it reached."""

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvg_export.corpus import SPLITS, split_of, stdlib_root
from kvg_export.presets import load_model
from kvg_export.training import checkpoint as checkpoint_module
from kvg_export.training.checkpoint import load_checkpoint
from kvg_export.training.cli import main as train_main
from kvg_export.training.data import TrainingData
from kvg_export.training.loop import mean_loss, publish_to_preset, train
from kvg_export.training.recipe import TrainingRecipe
from runtime.decode.scoring import score_segments

RECIPE = dict(seed=3, seq_len=16, batch_size=2, steps=4, learning_rate=3e-3, warmup_steps=1,
              eval_every=2, eval_segments=2, checkpoint_every=2)  # fmt: skip
CONFIG = dict(model_type="forgetting_transformer-project_fox", vocab_size=300, hidden_size=32, num_heads=2,
              num_hidden_layers=1, intermediate_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
# the LLaMA peer bench/speculative.py runs through onnxruntime-genai trains by the same loop
LLAMA_CONFIG = dict(model_type="llama", vocab_size=300, hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                    intermediate_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A stdlib-like tree with files in every split, cut from real stdlib modules so BPE finds merges."""
    root = tmp_path_factory.mktemp("stdlib")
    source = (stdlib_root() / "argparse.py").read_text()
    placed = {name: 0 for name in SPLITS}
    i = 0
    while min(placed.values()) < 2:
        name = f"m{i}.py"
        placed[split_of(name)] += 1
        (root / name).write_text(source[i * 400 : i * 400 + 1200])
        i += 1
    return root


def make_preset(folder, config=CONFIG, **recipe_changes):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "preset.json").write_text(json.dumps({"training": {**RECIPE, **recipe_changes}}))
    return folder


def run(preset, run_dir, corpus, **kwargs):
    return train(preset, run_dir, compile_loss=False, corpus_root=corpus, log=lambda _: None, progress=False, **kwargs)


def weights(folder):
    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize("config", [CONFIG, LLAMA_CONFIG], ids=["fox", "llama"])
def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(tmp_path, corpus, config):
    preset = make_preset(tmp_path / "preset", config)
    straight = run(preset, tmp_path / "straight", corpus)
    assert json.loads((straight / "config.json").read_text())["model_type"] == config["model_type"]
    assert run(preset, tmp_path / "paused", corpus, pause_after=2) is None
    assert load_checkpoint(tmp_path / "paused" / "checkpoint")[1]["step"] == 2
    resumed = run(preset, tmp_path / "paused", corpus)
    a, b = weights(straight), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    reports = [json.loads((f / "training.json").read_text()) for f in (straight, resumed)]
    assert reports[0]["validation_history"] == reports[1]["validation_history"]


def test_an_interrupted_checkpoint_write_leaves_the_last_checkpoint_to_resume_from(tmp_path, corpus, monkeypatch):
    preset = make_preset(tmp_path / "preset")
    saves = []
    real_save = torch.save

    def save_then_fail(obj, path, *args, **kwargs):
        saves.append(path)
        if len(saves) == 2:
            raise OSError("No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "save", save_then_fail)
    with pytest.raises(OSError, match="No space"):
        run(preset, tmp_path / "run", corpus)
    monkeypatch.setattr(checkpoint_module.torch, "save", real_save)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint"]  # no half-written folder left
    model, state = load_checkpoint(tmp_path / "run" / "checkpoint")
    assert state["step"] == 2 and isinstance(model, torch.nn.Module)
    resumed = run(preset, tmp_path / "run", corpus)
    straight = run(preset, tmp_path / "straight", corpus)
    assert all(torch.equal(weights(resumed)[k], v) for k, v in weights(straight).items())


def test_a_finished_run_reports_its_losses_against_the_unigram_baseline(tmp_path, corpus):
    preset = make_preset(tmp_path / "preset")
    folder = run(preset, tmp_path / "run", corpus)
    report = json.loads((folder / "training.json").read_text())
    assert (folder / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["corpus"]["python"] and set(report["corpus"]["splits"]) == set(SPLITS)
    assert report["tokens_seen"] == RECIPE["steps"] * RECIPE["batch_size"] * RECIPE["seq_len"]
    model = load_model(folder)
    data = TrainingData.prepare(CONFIG["vocab_size"], corpus)
    for split in ("validation", "test"):
        segments = data.evaluation_segments(split, RECIPE["seq_len"])

        def logits_of(ids):
            with torch.no_grad():
                return model(input_ids=torch.from_numpy(ids)).logits.numpy()

        # The loop's torch cross-entropy against the runtime's numpy scoring of the same segments.
        scores = score_segments(logits_of, segments, max_batch=4, vocab_size=CONFIG["vocab_size"])
        assert report[split]["loss"] == pytest.approx(scores.mean_nll, rel=1e-5)
        assert report[split]["perplexity"] == pytest.approx(scores.perplexity, rel=1e-5)
        counts = np.bincount(data.streams["train"], minlength=CONFIG["vocab_size"]) + 1
        unigram = -np.mean([math.log(counts[t] / counts.sum()) for s in segments for t in s[1:]])
        assert report[split]["unigram_loss"] == pytest.approx(unigram, rel=1e-9)


def test_mean_loss_is_the_cross_entropy_of_each_segments_tokens_after_its_first():
    torch.manual_seed(0)
    from kvg_export.fox import FoxConfig, FoxForCausalLM

    model = FoxForCausalLM(FoxConfig(**{k: v for k, v in CONFIG.items() if k != "model_type"}))
    segments = [np.arange(3, 11), np.arange(20, 28), np.arange(40, 45)]
    losses = []
    for s in segments:
        logits = model(input_ids=torch.from_numpy(s)[None]).logits[0]
        losses += [-torch.log_softmax(logits[t], -1)[s[t + 1]].item() for t in range(len(s) - 1)]
    assert mean_loss(model, segments) == pytest.approx(sum(losses) / len(losses), rel=1e-5)


def test_a_changed_recipe_is_refused_on_resume(tmp_path, corpus):
    preset = make_preset(tmp_path / "preset")
    run(preset, tmp_path / "run", corpus, pause_after=2)
    make_preset(preset, learning_rate=1e-2)
    with pytest.raises(ValueError, match=r"another recipe.*--fresh"):
        run(preset, tmp_path / "run", corpus)


def test_the_learning_rate_warms_up_then_follows_a_cosine_to_its_floor():
    recipe = TrainingRecipe(seed=0, seq_len=8, batch_size=1, steps=110, learning_rate=1.0, warmup_steps=10)
    assert [recipe.learning_rate_at(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert recipe.learning_rate_at(10) == pytest.approx(1.0)
    assert recipe.learning_rate_at(60) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way down the cosine
    assert recipe.learning_rate_at(110) == pytest.approx(0.1)


def test_a_recipe_with_unknown_settings_or_none_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"unknown training settings \['epochs'\]"):
        TrainingRecipe.from_preset(make_preset(tmp_path / "a", epochs=3))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "preset.json").write_text(json.dumps({"seed": 1}))
    with pytest.raises(ValueError, match="random-weight preset"):
        TrainingRecipe.from_preset(tmp_path / "b")


def test_the_command_refuses_an_unknown_or_random_weight_preset_naming_the_trained_ones(capsys):
    assert train_main(["fox-huge"]) == 2
    assert "'fox-huge' is an unknown preset; trained presets: fox-pro-py, fox-py" in capsys.readouterr().err
    assert train_main(["fox-tiny"]) == 2
    assert "'fox-tiny' is a random-weight preset" in capsys.readouterr().err


def test_publishing_replaces_the_presets_weights_and_keeps_its_config(tmp_path, corpus):
    preset = make_preset(tmp_path / "preset")
    config = (preset / "config.json").read_text()
    folder = run(preset, tmp_path / "run", corpus)
    publish_to_preset(folder, preset)
    assert (preset / "config.json").read_text() == config
    for name in ("model.safetensors", "tokenizer.json", "training.json", "loss_curve.png"):
        assert (preset / name).read_bytes() == (folder / name).read_bytes()
    assert not list(preset.glob(".*"))
