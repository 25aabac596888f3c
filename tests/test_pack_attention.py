"""A fused graph's attention node reads its layer's joined projection whole (exporters/graph/passes/pack_attention.py):
no Split cuts the projection and no Add biases the forget gate, and the graph still computes eager PyTorch's
logits."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from exporters.graph.onnx_export import export_program, lower_to_onnx
from exporters.graph.passes import PASSES, Choices
from exporters.native.library import available, build
from kvg_export import FoxConfig, FoxForCausalLM
from runtime.contract import DEFAULT_OPSET, OP_NAME, cache_layout

pytestmark = pytest.mark.skipif(not available(), reason="the fused attention library cannot be built here")
PRO = dict(use_k_shift=True, use_v_shift=True, qk_norm=True, use_output_gate=True, use_output_norm=True)


@pytest.fixture(scope="module", params=[{}, PRO], ids=["fox", "fox-pro"])
def fused(request, tmp_path_factory):
    torch.manual_seed(3)
    config = FoxConfig(
        vocab_size=80, hidden_size=32, num_hidden_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
        initializer_range=0.2, pad_token_id=0, **request.param,
    )  # fmt: skip
    model = FoxForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.attn.fgate_proj.bias.uniform_(-1.0, 4.0)
    layout = cache_layout(config, static=False)
    program, example = export_program(model, layout, None, in_place_attention="fused")
    path = tmp_path_factory.mktemp("fused") / "model.onnx"
    counts = lower_to_onnx(program, example, layout, path, DEFAULT_OPSET, Choices("fused", window_offsets=False))
    return model, path, counts


def test_the_attention_reads_the_joined_projection_and_its_bias(fused):
    model, path, _ = fused
    graph = onnx.load(str(path)).graph
    producer = {output: node for node in graph.node for output in node.output}
    initializers = {tensor.name for tensor in graph.initializer}
    nodes = [node for node in graph.node if node.op_type == OP_NAME]
    assert len(nodes) == model.config.num_hidden_layers
    for node in nodes:
        assert producer[node.input[0]].op_type == "MatMul"
        assert not any(node.input[1:4]) and node.input[4] in initializers  # the forget gate's bias
        offsets = next(attribute.ints for attribute in node.attribute if attribute.name == "packed_offsets")
        assert len(offsets) == 7 and len({o for o in offsets if o >= 0}) == 4 + 3 * model.config.use_k_shift
    assert not [node for node in graph.node if node.op_type == "Split" and any(
        output in node.input for node in nodes for output in node.output)]  # fmt: skip


def test_the_passes_report_what_they_did_by_name_in_their_order(fused):
    """The lowering's counts (exporters/graph/passes): every pass's, in `PASSES` order, and the packing's and the
    projections' as many as the graph shows."""
    model, path, counts = fused
    graph = onnx.load(str(path)).graph
    assert list(counts) == [graph_pass.name for graph_pass in PASSES]
    packed = [node for node in graph.node if any(a.name == "packed_offsets" for a in node.attribute)]
    assert counts["attention nodes reading a joined projection whole"] == len(packed) == model.config.num_hidden_layers
    matmuls = sum(node.op_type == "MatMul" for node in graph.node)
    # each layer's projections of one activation joined: the attention's (q, k, v, the forget gate's and FoX-Pro's),
    # the MLP's gate and up; left are those two, o_proj and down a layer, and the lm_head
    assert matmuls == 4 * model.config.num_hidden_layers + 1
    linears = sum(isinstance(module, torch.nn.Linear) for module in model.modules())
    assert counts["projections joined"] == linears - matmuls  # one MatMul a Linear, before joining


def test_the_packed_graph_computes_eager_logits(fused):
    """A prompt through the graph from an empty cache, against the model's own forward."""
    model, path, _ = fused
    config, seq = model.config, 7
    ids = torch.randint(1, config.vocab_size, (1, seq))
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(build()))
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    width, dim = config.kv_heads * config.head_dim, config.head_dim
    feeds = {"input_ids": ids.numpy(), "attention_mask": np.ones((1, seq), np.int64)}
    for value in session.get_inputs():
        if value.name.startswith("past_key_values"):
            field = value.name.rsplit(".", 1)[1]
            shapes = {"key": (1, config.kv_heads, 0, dim), "value": (1, config.kv_heads, 0, dim),
                      "gate": (1, config.num_heads, 0), "key_shift": (1, width), "value_shift": (1, width)}  # fmt: skip
            feeds[value.name] = np.zeros(shapes[field], np.float32)
    logits = session.run(["logits"], feeds)[0]
    with torch.no_grad():
        expected = model(ids).logits.numpy()
    scale = max(1.0, np.abs(expected).max())  # export validation's measure
    # measured 6.1e-7 (FoX) and 2.1e-6 (FoX-Pro) of the scale; export validation allows TOLERANCES["float32"], 1e-4
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5 * scale)
