"""Positions far past the short prompts of the other tests: a static artifact of 8,256 slots against eager
PyTorch (prefill in chunks, then decode) on a model with extreme forget gates, the gate sums of a 64k-position
cache, and prefill logits against a float64 reference where the gate sums reach the thousands.
"""

import copy

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import export_here

from exporters.checks.validate import TOLERANCES
from exporters.pipeline.options import ExportOptions
from kvg_export import DynamicCache
from kvg_export.cache_layers import DynamicLayer
from kvg_export.presets import load_model
from runtime.artifact import SessionOptions, session_options
from runtime.decode.generator import GenerationConfig, Generator

CPU = SessionOptions(provider="cpu")
SLOTS, PROMPT = 8256, 8200  # the prompt fills 33 chunks of 256
# Per head, from forgetting everything at once to forgetting nothing; at -4 a head's gate sum passes -4,000
# within 1,000 tokens, as a weakly forgetting head's does in 6,000 (the forget-gate projection keeps its small
# random weights: scaled up, its float32 rounding alone moves the logits by 1e-4)
GATE_BIASES = [-200.0, -4.0, 4.0, 200.0]


@pytest.fixture(scope="module")
def extreme_gates(tmp_path_factory):
    """fox-pro-tiny (QK-norm, shifts, output gate and norm) with extreme forget gates, as an official-format
    checkpoint and as a static artifact of SLOTS slots."""
    model = load_model("fox-pro-tiny")
    with torch.no_grad():
        for block in model.model.layers:
            block.attn.fgate_proj.bias.copy_(torch.tensor(GATE_BIASES))
    folder = tmp_path_factory.mktemp("extreme-gates")
    model.save_pretrained(folder / "checkpoint")
    return model, export_here(ExportOptions(str(folder / "checkpoint"), folder / "artifact", "static",
                                            max_cache_len=SLOTS))  # fmt: skip


def test_a_static_artifact_matches_eager_past_8k_positions_prefill_then_decode(extreme_gates):
    model, artifact = extreme_gates
    ids = torch.randint(3, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    config = GenerationConfig(max_new_tokens=12, min_new_tokens=12)
    result = Generator.open(artifact, CPU).generate(ids.tolist(), config, keep_logits=True)
    cache = DynamicCache()
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        for step, token in enumerate(result.tokens[0]):
            worst = float(abs(torch.from_numpy(result.step_logits[step]) - logits).max())
            assert worst < TOLERANCES["float32"], (
                f"step {step} (position {PROMPT + step}): logits differ by {worst:.2e}"
            )
            logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[:, -1]


def test_prefill_logits_where_gate_sums_reach_thousands_are_within_1e_4_of_float64(extreme_gates):
    """What a 6,000-token prompt of an official-format FoX does to float32 (gate sums in the thousands, where
    float32 keeps about 1e-4), in fewer positions with stronger gates: eager and the artifact, both in chunks."""
    model, artifact = extreme_gates
    ids = torch.randint(3, model.config.vocab_size, (1, 1024), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(input_ids=ids, use_cache=False).logits
        gates = model.model.layers[0].attn.log_forget_gate(model.model.layers[0].attn_norm(model.model.embeddings(ids)))
        assert float(gates[0, 1].sum()) < -4000  # the gate sums are of the size in question
        eager = model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True).logits
    onnx = Generator.open(artifact, CPU).teacher_forced_logits(ids.numpy())
    assert float(abs(eager.double() - reference).max()) < 1e-4
    assert float(abs(torch.from_numpy(onnx).double() - reference).max()) < 1e-4


def test_a_decode_step_over_65k_cached_positions_of_strong_gates_stays_finite_and_matches_eager(exported):
    """The graph sums a 65,536-position gate buffer (log gates down to -88 a step: sums of millions) and attends
    over it; its logits are finite and equal eager's step over the same cache."""
    artifact = exported("fox-tiny", "dynamic")[0].path
    model = load_model("fox-tiny")
    config, past = model.config, 1 << 16
    rng = torch.Generator().manual_seed(2)
    layers = []
    for _ in range(config.num_hidden_layers):
        keys, values = (torch.randn(1, config.kv_heads, past, config.head_dim, generator=rng) for _ in range(2))
        gates = -88.0 * torch.rand(1, config.num_heads, past, generator=rng)
        gates[..., -512:] *= 1e-4  # the recent keys hardly decay, so the step attends over many of them
        layers.append((keys, values, gates))
    feeds = {"input_ids": np.array([[7]]), "attention_mask": np.ones((1, past + 1), dtype=np.int64)}
    for index, tensors in enumerate(layers):
        for field, tensor in zip(("key", "value", "gate"), tensors, strict=True):
            feeds[f"past_key_values.{index}.{field}"] = tensor.numpy()
    session = ort.InferenceSession(str(artifact / "model.onnx"), session_options(artifact),
                                   providers=["CPUExecutionProvider"])  # fmt: skip
    onnx = session.run(["logits"], feeds)[0]
    cache = DynamicCache()
    cache.layers = [DynamicLayer.from_tensors(*tensors, None, None) for tensors in layers]
    with torch.no_grad():
        eager = model(input_ids=torch.tensor([[7]]), past_key_values=cache, use_cache=True).logits
    assert np.isfinite(onnx).all()
    assert float(abs(torch.from_numpy(onnx) - eager).max()) < TOLERANCES["float32"]
