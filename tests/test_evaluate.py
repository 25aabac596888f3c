"""`kvg-eval`: eager PyTorch and an artifact score held-out text alike, and bad input is refused clearly."""

import json
import math
import shutil

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from exporters.evaluation.cli import main
from exporters.evaluation.evaluate import (
    Band,
    EvalError,
    Evaluation,
    SystemResult,
    default_bands,
    eager_logit_blocks,
    evaluate,
    position_bins,
)
from kvg_export.corpus import read_split, segments, token_stream
from kvg_export.presets import MODELS_DIR, load_model
from kvg_export.training.loop import mean_loss
from runtime.decode.scoring import Scores, next_token_scores

SEGMENTS = 6  # of the test split: enough positions to see a disagreement, few enough to be quick


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_an_artifact_scores_the_held_out_text_as_eager_pytorch_does(exported, cache):
    artifact = exported("fox-py", cache)[0].path
    evaluation = evaluate("fox-py", artifact, max_segments=SEGMENTS)
    max_cache_len = json.loads((artifact / "kvg_config.json").read_text())["cache"]["max_cache_len"]
    assert evaluation.segment_tokens == (min(512, max_cache_len) if cache == "static" else 512)
    assert evaluation.failures == []  # perplexity within 0.1% of eager's, top-1 agreement >= 99.9%
    assert abs(evaluation.relative_perplexity_diff) < 1e-3 and evaluation.top1_agreement >= 0.999
    # eager's figure against the training loop's torch cross-entropy over the same segments
    model = load_model("fox-py")
    tokenizer = Tokenizer.from_file(str(MODELS_DIR / "fox-py" / "tokenizer.json"))
    stream = token_stream(tokenizer, read_split("test"), 2)  # path order: segments of 512 or fewer
    chosen = segments(stream, evaluation.segment_tokens)[:SEGMENTS]
    assert evaluation.eager.nll == pytest.approx(mean_loss(model, chosen), rel=1e-5)
    assert evaluation.predicted_tokens == sum(len(s) - 1 for s in chosen)


def test_the_trained_preset_predicts_held_out_code_far_better_than_chance():
    evaluation = evaluate("fox-py", max_segments=4)
    assert evaluation.artifact is None and evaluation.failures == []
    assert evaluation.eager.perplexity < 2048 / 20  # an untrained model scores about its vocabulary size


def test_the_command_prints_both_systems_and_writes_the_report(exported, tmp_path, capsys):
    artifact = exported("fox-py", "dynamic")[0].path
    report = tmp_path / "eval.json"
    assert main(["fox-py", "--artifact", str(artifact), "--max-segments", "2", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "stdlib test split" in out and "eager PyTorch" in out and str(artifact) in out and ": pass" in out
    written = json.loads(report.read_text())
    assert written["passed"] and written["segments"] == 2 and written["artifact"]["perplexity"] > 1
    # A threshold the artifact cannot meet (agreement above 100%) exits 1 with the figures.
    assert main(["fox-py", "--artifact", str(artifact), "--max-segments", "2", "--json", str(report),
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
        evaluate(foreign_tokenizer_model, max_segments=1)
    with pytest.raises(EvalError, match="weights differ"):
        evaluate("fox-py", exported("fox-tiny", "dynamic")[0].path, max_segments=1)


def test_the_command_exits_2_on_bad_input(tmp_path, capsys):
    assert main(["fox-py", "--text", str(tmp_path / "missing.py")]) == 2
    assert "kvg-eval: error: text path" in capsys.readouterr().err
    assert main(["fox-py", "--max-segments", "0"]) == 2


def test_bands_score_the_positions_they_name(exported):
    """Each band's figures are those of the tokens at its segment positions, by torch's own log-softmax."""
    artifact = exported("fox-py", "dynamic")[0].path
    evaluation = evaluate("fox-py", artifact, context=64, max_segments=4, bands=[(1, 15), (32, 63)])
    model = load_model("fox-py")
    tokenizer = Tokenizer.from_file(str(MODELS_DIR / "fox-py" / "tokenizer.json"))
    ids = torch.tensor(np.stack(segments(token_stream(tokenizer, read_split("test"), 2), 64)[:4]))
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
    with pytest.raises(EvalError, match="positions 0-64 need segments of 65 tokens; the longest here has 64"):
        evaluate("fox-py", context=64, max_segments=1, bands=[(0, 64)])


def test_the_test_split_gives_long_segments_of_one_file_each():
    """Longest file first: the first segments of 8,192 tokens hold no end-of-text token, i.e. one file each."""
    tokenizer = Tokenizer.from_file(str(MODELS_DIR / "fox-py" / "tokenizer.json"))
    long_segments = segments(token_stream(tokenizer, read_split("test"), 2, longest_first=True), 8192)
    assert sum(len(s) == 8192 for s in long_segments) >= 8
    assert all(2 not in s for s in long_segments[:3])


def test_eager_scores_with_a_cache_equal_those_without():
    """The cache path eager scoring takes (which may run a long segment chunk by chunk) against one whole
    forward: equal on a short segment; on a longer one, as close as float32 rounding allows (each is about 1e-4
    nats from a float64 forward at some positions there), with the same mean."""
    model = load_model("fox-py")
    tokenizer = Tokenizer.from_file(str(MODELS_DIR / "fox-py" / "tokenizer.json"))
    stream = token_stream(tokenizer, read_split("test")[:8], 2)
    for length, per_token in [(200, 1e-5), (600, 1e-3)]:
        ids = np.stack(segments(stream, length)[:2])
        with torch.no_grad():
            whole, _ = next_token_scores(model(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy(), ids)
        cached, _ = next_token_scores(np.concatenate(list(eager_logit_blocks(model, ids)), axis=1), ids)
        np.testing.assert_allclose(cached, whole, rtol=0, atol=per_token)
        assert cached.mean() == pytest.approx(whole.mean(), abs=1e-5)


def test_a_band_is_the_perplexity_of_its_positions_by_hand():
    """Band.of against plain Python over per-position nll: exp of the mean over positions first..last."""
    rng = np.random.default_rng(0)
    lengths = [9, 9, 5]  # two full segments and a shorter last one
    positions = np.concatenate([np.arange(1, n) for n in lengths])
    eager = Scores(rng.uniform(0, 5, positions.size), rng.integers(0, 3, positions.size), positions * 0, positions)
    artifact = Scores(eager.nll + rng.normal(0, 0.01, positions.size), eager.top1.copy(), eager.targets, positions)
    artifact.top1[[0, 7]] += 1  # segment 0 position 1, segment 0 position 8
    for first, last in [(0, 3), (4, 8), (2, 2)]:
        band = Band.of(first, last, eager, artifact)
        picked = [i for i, p in enumerate(positions.tolist()) if first <= p <= last]
        assert band.predicted_tokens == len(picked)
        assert band.eager_perplexity == pytest.approx(math.exp(sum(eager.nll[i] for i in picked) / len(picked)))
        assert band.artifact_perplexity == pytest.approx(math.exp(sum(artifact.nll[i] for i in picked) / len(picked)))
        assert band.top1_agreement == sum(eager.top1[i] == artifact.top1[i] for i in picked) / len(picked)


def test_default_bands_are_log_spaced_and_cover_the_segment():
    assert default_bands(512) == [] and default_bands(64) == []
    assert default_bands(600) == [(0, 511), (512, 599)]
    assert default_bands(4096) == [(0, 511), (512, 2047), (2048, 4095)]
    assert default_bands(8192) == [(0, 511), (512, 2047), (2048, 8191)]
    assert default_bands(16384) == [(0, 511), (512, 2047), (2048, 8191), (8192, 16383)]
    for length in (2, 64, 513, 8192):  # the curve's bins tile every predicted position once, in order
        tiled = [p for first, last in position_bins(length) for p in range(first, last + 1)]
        assert tiled == list(range(1, length)) and len(position_bins(length)) <= 24


def judged(eager: float, artifact: float, bands: list[tuple[float, float]]) -> Evaluation:
    """An evaluation with these perplexities, overall and per band, and nothing else to fail on."""
    return Evaluation(
        model="m", text={}, segment_tokens=4096, segments=1, overall=Band(1, 4095, 4095, eager, artifact, 1.0),
        eager=SystemResult("eager", eager, math.log(eager), 0.5, 1.0),
        artifact=SystemResult("artifact", artifact, math.log(artifact), 0.5, 1.0),
        bands=[Band(i * 512, i * 512 + 511, 511, e, a, 1.0) for i, (e, a) in enumerate(bands)],
    )  # fmt: skip


def test_a_band_over_the_threshold_fails_the_artifact_though_the_whole_passes():
    assert judged(10.0, 10.001, [(11.0, 11.001), (9.0, 9.001)]).failures == []
    drifted = judged(10.0, 10.001, [(11.0, 11.0), (9.0, 9.05)])
    assert drifted.failures == ["positions 512-1023: perplexity 9.05 differs from eager's 9 by +0.556%, over 0.100%"]
    assert "thresholds: positions 512-1023: perplexity 9.05" in drifted.table()
    assert len(judged(10.0, 10.0, [(9.0, math.nan)]).failures) == 1  # a NaN is no pass


def test_a_long_context_evaluation_has_default_bands_and_draws_its_plot(exported, tmp_path, capsys):
    artifact = exported("fox-py", "dynamic")[0].path
    report, plot = tmp_path / "eval.json", tmp_path / "plots" / "ppl.png"
    argv = ["fox-py", "--artifact", str(artifact), "--context", "1024", "--max-segments", "1"]
    assert main([*argv, "--json", str(report), "--plot", str(plot)]) == 0
    written = json.loads(report.read_text())
    assert written["text"]["order"] == "longest first"  # a segment over 512 tokens: long files first
    assert [(b["first"], b["last"]) for b in written["bands"]] == [(0, 511), (512, 1023)]
    assert all(abs(b["relative_perplexity_diff"]) < 1e-3 for b in written["bands"] + written["curve"])
    assert written["curve"][0]["first"] == 1 and written["curve"][-1]["last"] == 1023
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and list(plot.parent.iterdir()) == [plot]
    assert "positions 512-1023: eager perplexity" in capsys.readouterr().out
