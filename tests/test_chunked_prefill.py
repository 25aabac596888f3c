"""A prompt prefilled in chunks gives what it gives in one run, on every artifact kind and in eager PyTorch.

Chunks bound a prefill's memory (no run holds more than a chunk's attention terms), so they are how every
prompt is prefilled; these tests cross several chunk boundaries with short prompts and small chunks.
"""

import numpy as np
import pytest
import torch
from conftest import CPU_FP32_ATTENTION

import kvg_export.fox.modeling as modeling
import kvg_export.onnx_model as onnx_model
from kvg_export import DynamicCache, StaticCache
from kvg_export.onnx_model import OnnxFoxForCausalLM
from kvg_export.presets import load_model
from runtime.artifact import SessionOptions
from runtime.cache import buffers
from runtime.cache.device_cache import DeviceCache
from runtime.decode.generator import GenerationConfig, Generator
from runtime.decode.prefill import PREFILL_WORKING_SET, chunk_size

CPU = SessionOptions(provider="cpu")
# Left-padded into a batch of width 11: chunks of 4 split it in three, and the short row's first chunk is all padding
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [16, 17, 18, 19], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
# Chunks change the shapes of the matrix products, so float32 sums round differently. QK-norm then scales each
# head's key to unit size, and the rounding of a small projection with it: fox-pro-tiny's layer-1 keys (up to
# 2.7) are 1.0-1.2e-6 from float64 eager's, whole or chunked alike (measured), 4-5 units in the last place of
# their largest value, and the two runs differ by up to 1.07e-6 (4.5 such units, the worst of these cases). So a
# chunked run is held to ULPS units in the last place of each tensor's largest value, at least of 1: a chunking
# mistake (a wrong position, mask or state) is off by orders more.
ULPS = 6


def assert_float32_close(got, want, err_msg: str = "") -> None:
    got, want = np.asarray(got), np.asarray(want)
    scale = np.float32(max(1.0, float(np.abs(want).max())))
    np.testing.assert_allclose(got, want, rtol=0, atol=ULPS * np.spacing(scale), err_msg=err_msg)


KINDS = [("dynamic", "gqa"), ("dynamic", "standard"), ("static", "gqa"), ("static", "standard"),
         ("static", "onnx-attention")]  # fmt: skip
KINDS += [("dynamic", "fused"), ("static", "fused")] if CPU_FP32_ATTENTION == "fused" else []
# The kinds OnnxFoxForCausalLM runs each its own way: dynamic graphs, and in-place static ones
MODEL_KINDS = KINDS[:3] + KINDS[5:]


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one left-padded batch: ids and attention mask `[rows, longest]`."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    return ids, (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()


def _prefilled(generator: Generator, prompts: list[list[int]], chunk: int) -> tuple[np.ndarray, dict]:
    """The prefill's last logits `[batch, vocab]` and, copied to the host, every cache tensor it left (the
    filled slots of those held in longer buffers)."""
    config = GenerationConfig(max_new_tokens=1, prefill_chunk=chunk)
    cache, width = DeviceCache(generator.model.artifact, len(prompts)), max(map(len, prompts))
    logits = generator.generate(prompts, config, keep_logits=True, cache=cache).step_logits[0]
    host = {}
    for past in generator.model.artifact.past_names():
        array = np.array(buffers.to_host(cache.held_in(past), generator.model.artifact.input_spec(past)["dtype"]))
        host[past] = array if past.endswith("shift") else array[:, :, :width]
    return logits, host


@pytest.mark.parametrize(("cache", "attention"), KINDS, ids=["-".join(kind) for kind in KINDS])
@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one-row", "left-padded-batch"])
def test_a_prompt_prefilled_in_chunks_leaves_the_logits_and_cache_of_one_run(exported, cache, attention, prompts):
    generator = Generator.open(exported("fox-pro-tiny", cache, attention=attention)[0].path, CPU)
    whole_logits, whole = _prefilled(generator, prompts, chunk=256)
    chunked_logits, chunked = _prefilled(generator, prompts, chunk=4)
    assert_float32_close(chunked_logits, whole_logits)
    assert chunked.keys() == whole.keys()
    for name, tensor in whole.items():
        assert_float32_close(chunked[name], tensor, err_msg=name)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_teacher_forced_logits_of_a_batch_in_chunks_equal_one_run(exported, kind):
    """Scoring reads every position's logits: a gqa artifact's batch is scored row by row past one chunk."""
    generator = Generator.open(exported("fox-pro-tiny", kind)[0].path, CPU)
    ids = np.random.default_rng(0).integers(3, 512, size=(3, 13))
    whole = generator.teacher_forced_logits(ids, prefill_chunk=256)
    assert_float32_close(generator.teacher_forced_logits(ids, prefill_chunk=5), whole)


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_eager_forward_with_a_cache_runs_a_long_input_in_chunks_as_one(monkeypatch, cache_kind):
    """With a cache, the model runs a longer input through its layers a chunk at a time (so no layer builds a
    `[heads, seq, seq]` term), and gives the logits and cache of one pass over it, left padding included."""
    model = load_model("fox-pro-tiny")
    ids, mask = left_padded(PROMPTS)
    width = ids.shape[1]

    def run(chunk: int):
        monkeypatch.setattr(modeling, "PREFILL_CHUNK", chunk)
        if cache_kind == "dynamic":
            cache = DynamicCache()
        else:
            cache = StaticCache(model.config.num_hidden_layers, max_cache_len=32, max_batch_size=len(PROMPTS))
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
        layer = cache.layers[-1]
        return logits, [t[:, :, :width] for t in (layer.keys, layer.values, layer.gates)]

    whole_logits, whole_cache = run(256)
    chunked_logits, chunked_cache = run(4)
    real = mask.bool()  # a padding position's own output is whatever it attends alone: not compared
    assert_float32_close(chunked_logits[real], whole_logits[real])
    for chunked, whole in zip(chunked_cache, whole_cache, strict=True):
        assert_float32_close(chunked, whole)


@pytest.mark.parametrize(("cache", "attention"), MODEL_KINDS, ids=["-".join(kind) for kind in MODEL_KINDS])
def test_the_transformers_model_over_an_artifact_runs_a_long_input_in_chunks_as_one(
    exported, monkeypatch, cache, attention
):
    """OnnxFoxForCausalLM feeds a longer input in chunks, row by row where GroupQueryAttention needs it; asked for
    the last positions' logits alone (generate() asks for one), it gives those of one run."""
    model = OnnxFoxForCausalLM.from_pretrained(exported("fox-pro-tiny", cache, attention=attention)[0].path, "cpu")
    ids, mask = left_padded(PROMPTS)
    width = ids.shape[1]

    def run(chunk: int, logits_to_keep: int = 0):
        monkeypatch.setattr(onnx_model, "PREFILL_CHUNK", chunk)
        state = model.new_cache(len(PROMPTS))
        logits = model(input_ids=ids, attention_mask=mask, past_key_values=state, logits_to_keep=logits_to_keep).logits
        layer = state.layers[-1]
        return logits, [t[:, :, :width] for t in (layer.keys, layer.values, layer.gates)] + [layer.key_shift]

    whole_logits, whole_cache = run(256)
    chunked_logits, chunked_cache = run(4)
    assert_float32_close(chunked_logits, whole_logits)
    for chunked, whole in zip(chunked_cache, whole_cache, strict=True):
        assert_float32_close(chunked, whole)
    for kept in (1, 6):  # within the last chunk, and across the last two
        assert_float32_close(run(4, kept)[0], whole_logits[:, -kept:])


@pytest.mark.parametrize("buffer", [1024, 16_640, 65_536])
@pytest.mark.parametrize("attention", sorted({"gqa", CPU_FP32_ATTENTION}))
def test_a_prefill_runs_attention_terms_stay_within_the_working_set_however_long_the_cache(exported, buffer, attention):
    """Chunks shrink as the cache grows, so a run's terms stay bounded: GroupQueryAttention's float32 scores
    `[rows, heads, chunk, buffer]`, and the bias and its masked copy over the slots the run attends; the fused
    operator's pattern `[rows, chunk, window]`, a byte each."""
    artifact = Generator.open(exported("fox-pro-tiny", "static", attention=attention)[0].path, CPU).model.artifact
    assert artifact.attention == attention
    heads = artifact.manifest["model"]["num_heads"]
    for rows in (1, 8):
        for window in (buffer, buffer // 4):  # a prompt as long as the buffer, or into an empty one 4x as long
            chunk = chunk_size(artifact, rows, buffer, most=256, window=window)
            terms = rows * window if attention == "fused" else 4 * rows * heads * (buffer + 2 * window)  # per token
            assert 1 <= chunk <= 256
            assert chunk == 256 or terms * chunk <= PREFILL_WORKING_SET < terms * (chunk + 1)
        assert chunk_size(artifact, rows, buffer, most=256) == chunk_size(artifact, rows, buffer, 256, window=buffer)
