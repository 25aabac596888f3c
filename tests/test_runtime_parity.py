"""The runtime generates exactly what eager PyTorch generate() does, for every preset and cache kind (trained presets
too, whose logits are far from flat, so a flipped token would show). The other attention kinds and fp16 across the
presets export artifacts of their own: they carry the `matrix` marker and run in `make test-matrix`."""

import json

import numpy as np
import pytest
import torch
from conftest import CPU_FP32_ATTENTION

from exporters.checks.references import eager_generate
from exporters.checks.validate import TOLERANCES, greedy_disagreement
from exporters.pipeline.lowering import TORCH_DTYPES
from kvg_export.presets import load_model
from runtime.artifact import SessionOptions
from runtime.cache.device_cache import RESERVED_NEW_TOKENS, DeviceCache
from runtime.decode.generator import GenerationConfig, Generator

PRESETS = ("fox-tiny", "fox-pro-tiny", "fox-gqa-tiny", "fox-small", "fox-py", "fox-pro-py")
NEW_TOKENS = 32
FP16_NEW_TOKENS = 16  # eager fp16 runs slowly on the CPU; a near-tie often parts the rows early anyway
PROMPTS = {"single": [9], "left-padded-batch": [5, 11, 8]}


def random_prompts(lengths, vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("prompt_kind", PROMPTS)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("preset", PRESETS)
def test_runtime_greedy_tokens_and_logits_equal_eager_generate(exported, preset, cache, prompt_kind):
    check_parity(exported, preset, cache, prompt_kind, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("prompt_kind", PROMPTS)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("preset", ["fox-pro-tiny", "fox-small"])
def test_runtime_on_cuda_generates_what_eager_generates(exported, preset, dtype, cache, prompt_kind):
    """Exports for CUDA, attention as `auto` picks it there (fp32: onnx-attention static, standard dynamic;
    fp16, bf16: gqa), against eager on the CPU in the same dtype."""
    check_parity(exported, preset, cache, prompt_kind, "cuda", dtype=dtype)


@pytest.mark.matrix
@pytest.mark.parametrize("prompt_kind", PROMPTS)
@pytest.mark.parametrize(
    ("preset", "cache", "attention"),
    [("fox-tiny", "static", "standard"), ("fox-pro-tiny", "static", "standard"),
     ("fox-pro-tiny", "dynamic", "standard"), ("fox-tiny", "static", "onnx-attention"),
     ("fox-pro-tiny", "static", "onnx-attention"), ("fox-tiny", "dynamic", "gqa"), ("fox-pro-tiny", "static", "gqa"),
     ("fox-gqa-tiny", "dynamic", "gqa"), ("fox-pro-py", "static", "gqa")],
)  # fmt: skip
def test_the_other_attention_kinds_generate_what_eager_generates(exported, preset, cache, attention, prompt_kind):
    """fp32 exports attend through the fused operator by default on the CPU; GroupQueryAttention (where the operator
    cannot be built), the portable path, and the graph made for fp32 on CUDA must hold on the CPU provider too."""
    check_parity(exported, preset, cache, prompt_kind, "cpu", attention=attention)


FP16_CASES = [("fox-tiny", "static"), ("fox-gqa-tiny", "dynamic"), ("fox-pro-tiny", "static"), ("fox-mini", "dynamic"),
              ("fox-small", "static"), ("fox-py", "dynamic"), ("fox-pro-py", "static")]  # fmt: skip


@pytest.mark.matrix
@pytest.mark.parametrize(("preset", "cache"), FP16_CASES)
def test_fp16_gqa_artifacts_of_every_preset_generate_what_eager_fp16_generates(exported, preset, cache):
    """fp16 exports attend through GroupQueryAttention with the FoX bias (in fp32 up to the kernel); each
    preset, in one cache kind or the other, generates eager fp16's greedy tokens with its logits within the
    fp16 tolerance, up to a step where eager's two best tokens are closer than fp16 can resolve (eager
    fp16 and fp32 already differ by 1.3e-2 on the trained presets), after which the rows may part."""
    check_parity(exported, preset, cache, "left-padded-batch", "cpu", dtype="fp16", new_tokens=FP16_NEW_TOKENS)


def check_parity(exported, preset, cache, prompt_kind, provider, attention="auto", dtype="fp32", new_tokens=NEW_TOKENS):
    result, _ = exported(preset, cache, dtype, attention=attention, provider=provider)
    manifest = json.loads((result.path / "kvg_config.json").read_text())
    if provider == "cpu":  # what auto picks for CUDA is tested in test_export_artifact
        default = CPU_FP32_ATTENTION if dtype == "fp32" else "gqa"
        assert manifest["attention"] == (default if attention == "auto" else attention)
    model = load_model(preset, dtype=TORCH_DTYPES[dtype])
    prompts = random_prompts(PROMPTS[prompt_kind], model.config.vocab_size, seed=len(preset))
    want_tokens, want_logits = eager_generate(model, prompts, new_tokens)
    generator = Generator.open(result.path, SessionOptions(provider=provider))
    assert generator.model.artifact.device == provider
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    got = generator.generate(prompts, config, keep_logits=True)
    assert greedy_disagreement(got.tokens, want_tokens, got.step_logits, want_logits, manifest["dtype"]) is None


def test_a_static_artifact_fills_its_buffer_to_the_last_slot(exported):
    """The last step attends over the whole buffer, a window one longer than the export traced."""
    result, _ = exported("fox-tiny", "static")
    length = json.loads((result.path / "kvg_config.json").read_text())["cache"]["max_cache_len"]
    assert_generates_what_eager_generates(result.path, [length + 1 - NEW_TOKENS, 7], NEW_TOKENS)


def test_a_dynamic_generation_outgrowing_its_first_buffers_generates_what_eager_generates(exported):
    """A gqa dynamic artifact's key, value and gate buffers are doubled mid-generation, keeping what they hold."""
    cache = assert_generates_what_eager_generates(
        exported("fox-tiny", "dynamic")[0].path, [5, 11], RESERVED_NEW_TOKENS + 40
    )
    assert cache.length == 2 * (11 + RESERVED_NEW_TOKENS)


def assert_generates_what_eager_generates(path, prompt_lengths, new_tokens) -> DeviceCache:
    """Returns the cache the generation ran in."""
    model = load_model("fox-tiny")
    prompts = random_prompts(prompt_lengths, model.config.vocab_size, seed=3)
    want_tokens, want_logits = eager_generate(model, prompts, new_tokens)
    generator = Generator.open(path, SessionOptions(provider="cpu"))
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    cache = DeviceCache(generator.model.artifact, len(prompts))
    got = generator.generate(prompts, config, keep_logits=True, cache=cache)
    assert got.tokens == want_tokens
    worst = max(float(np.abs(g - w).max()) for g, w in zip(got.step_logits, want_logits, strict=True))
    assert worst < TOLERANCES["float32"]
    return cache
