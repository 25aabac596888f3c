"""`kvg-eval`: eager PyTorch and an artifact score held-out text alike, and bad input is refused clearly."""

import json
import shutil

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from exporters.eval_cli import main
from exporters.evaluate import EvalError, evaluate
from kvg_export.corpus import read_split, token_stream, windows
from kvg_export.presets import MODELS_DIR, load_model
from kvg_export.training.loop import mean_loss

WINDOWS = 6  # of the test split: enough positions to see a disagreement, few enough to be quick


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_an_artifact_scores_the_held_out_text_as_eager_pytorch_does(exported, cache):
    artifact = exported("fox-py", cache)[0].path
    evaluation = evaluate("fox-py", artifact, max_windows=WINDOWS)
    max_cache_len = json.loads((artifact / "kvg_config.json").read_text())["cache"]["max_cache_len"]
    assert evaluation.window_tokens == (min(512, max_cache_len) if cache == "static" else 512)
    assert evaluation.failures == []  # perplexity within 0.1% of eager's, top-1 agreement >= 99.9%
    assert abs(evaluation.relative_perplexity_diff) < 1e-3 and evaluation.top1_agreement >= 0.999
    # eager's figure against the training loop's torch cross-entropy over the same windows
    model = load_model("fox-py")
    tokenizer = Tokenizer.from_file(str(MODELS_DIR / "fox-py" / "tokenizer.json"))
    stream = token_stream(tokenizer, read_split("test"), 2)
    chosen = windows(stream, evaluation.window_tokens)[:WINDOWS]
    assert evaluation.eager.nll == pytest.approx(mean_loss(model, chosen), rel=1e-5)
    assert evaluation.predicted_tokens == sum(len(w) - 1 for w in chosen)


def test_the_trained_preset_predicts_held_out_code_far_better_than_chance():
    evaluation = evaluate("fox-py", max_windows=4)
    assert evaluation.artifact is None and evaluation.failures == []
    assert evaluation.eager.perplexity < 2048 / 20  # an untrained model scores about its vocabulary size


def test_the_command_prints_both_systems_and_writes_the_report(exported, tmp_path, capsys):
    artifact = exported("fox-py", "dynamic")[0].path
    report = tmp_path / "eval.json"
    assert main(["fox-py", "--artifact", str(artifact), "--max-windows", "2", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "stdlib test split" in out and "eager PyTorch" in out and str(artifact) in out and ": pass" in out
    written = json.loads(report.read_text())
    assert written["passed"] and written["windows"] == 2 and written["artifact"]["perplexity"] > 1
    # A threshold the artifact cannot meet (agreement above 100%) exits 1 with the figures.
    assert main(["fox-py", "--artifact", str(artifact), "--max-windows", "2", "--json", str(report),
                 "--min-agreement", "1.01"]) == 1  # fmt: skip
    assert "is under 101.000%" in capsys.readouterr().out


@pytest.fixture
def foreign_tokenizer_model(tmp_path):
    folder = tmp_path / "fox-py-copy"
    shutil.copytree(MODELS_DIR / "fox-py", folder)
    shutil.copy(MODELS_DIR / "fox-small" / "tokenizer.json", folder / "tokenizer.json")  # 32000 ids, not 2048
    (folder / "preset.json").unlink()
    return folder


def test_bad_input_is_refused_with_the_problem_named(exported, tmp_path, foreign_tokenizer_model):
    (tmp_path / "empty").mkdir()
    with pytest.raises(EvalError, match="does not exist"):
        evaluate("fox-py", text_paths=[tmp_path / "missing.py"])
    with pytest.raises(EvalError, match=r"no text to evaluate: .*empty holds no files ending in \.py"):
        evaluate("fox-py", text_paths=[tmp_path / "empty"])
    (tmp_path / "blank.py").write_text("")  # its end-of-text token alone: nothing to predict
    with pytest.raises(EvalError, match="no text to evaluate: the text gives 1 tokens, fewer than the 2"):
        evaluate("fox-py", text_paths=[tmp_path / "blank.py"])
    with pytest.raises(EvalError, match="unknown model 'fox-huge'"):
        evaluate("fox-huge")
    with pytest.raises(EvalError, match=r"2048.*does not belong to this model"):
        evaluate(foreign_tokenizer_model, max_windows=1)
    with pytest.raises(EvalError, match="weights differ"):
        evaluate("fox-py", exported("fox-tiny", "dynamic")[0].path, max_windows=1)


def test_the_command_exits_2_on_bad_input(tmp_path, capsys):
    assert main(["fox-py", "--text", str(tmp_path / "missing.py")]) == 2
    assert "kvg-eval: error: text path" in capsys.readouterr().err
    assert main(["fox-py", "--max-windows", "0"]) == 2


def test_bands_score_the_positions_they_name(exported):
    """Each band's figures are those of the tokens at its window positions, by torch's own log-softmax."""
    artifact = exported("fox-py", "dynamic")[0].path
    evaluation = evaluate("fox-py", artifact, context=64, max_windows=4, bands=[(1, 15), (32, 63)])
    model = load_model("fox-py")
    tokenizer = Tokenizer.from_file(str(MODELS_DIR / "fox-py" / "tokenizer.json"))
    ids = torch.tensor(np.stack(windows(token_stream(tokenizer, read_split("test"), 2), 64)[:4]))
    with torch.no_grad():
        log_probs = torch.log_softmax(model(input_ids=ids).logits.double(), dim=-1)
    nll = -log_probs[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # column p - 1 predicts the token at p
    for band, (first, last) in zip(evaluation.bands, [(1, 15), (32, 63)], strict=True):
        chosen = nll[:, first - 1 : last]
        assert (band.first, band.last, band.predicted_tokens) == (first, last, chosen.numel())
        assert band.eager_perplexity == pytest.approx(float(chosen.mean().exp()), rel=1e-5)
        assert band.artifact_perplexity == pytest.approx(band.eager_perplexity, rel=1e-4)
        assert band.top1_agreement == 1.0
    assert "positions 32-63: eager perplexity" in evaluation.table()
    with pytest.raises(EvalError, match="positions 0-64 need windows of 65 tokens; the longest here has 64"):
        evaluate("fox-py", context=64, max_windows=1, bands=[(0, 64)])
