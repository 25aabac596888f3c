"""exporters/graph/translations.py: each custom lowering, exported alone through torch.onnx and run by onnxruntime,
against
eager PyTorch (or float64) on random inputs, and the nodes it emits."""

import inspect

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from exporters.graph.translations import (  # registers the kvg ops too
    lower_decay_after,
    lower_fox_attention,
    lower_softplus,
    translations,
)
from runtime.contract import OP_INPUTS

HEADS, KV_HEADS, HEAD_DIM, BUFFER = 4, 2, 8, 10  # the in-place attention's cases: two query heads a kv head


def run_lowered(module: torch.nn.Module, inputs: tuple, table: dict, opset: int = 20):
    """`module` exported through torch.onnx with the lowerings `table`: its graph, and onnxruntime's outputs."""
    program = torch.onnx.export(module.eval(), inputs, dynamo=True, opset_version=opset, custom_translation_table=table)
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {given.name: value.numpy() for given, value in zip(session.get_inputs(), inputs, strict=True)}
    return program.model_proto.graph, session.run(None, feed)


def constant(graph: onnx.GraphProto, name: str) -> np.ndarray:
    """The value of `name`, an initializer or a Constant node's output."""
    for tensor in graph.initializer:
        if tensor.name == name:
            return onnx.numpy_helper.to_array(tensor)
    (node,) = [n for n in graph.node if n.op_type == "Constant" and name in n.output]
    return onnx.numpy_helper.to_array(node.attribute[0].t)


@pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")
@pytest.mark.parametrize("beta", [1.0, 2.0])
def test_the_softplus_lowering_matches_torch_across_the_gate_range(beta):
    class Softplus(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.softplus(x, beta=beta)

    x = torch.linspace(-200.0, 200.0, 801)
    program = torch.onnx.export(
        Softplus(), (x,), dynamo=True, custom_translation_table={torch.ops.aten.softplus.default: lower_softplus}
    )
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    want = torch.nn.functional.softplus(x.double(), beta=beta).numpy()
    # float32 against float64: measured 1.5e-7 relative (about one ulp) at beta 1 and 2; values below float32's
    # normal range flush to zero
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-37)
    assert "Where" not in {node.op_type for node in program.model_proto.graph.node}


@pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")
def test_decay_after_lowers_to_one_reverse_exclusive_cumsum_along_a_leading_axis():
    """kvg::decay_after gives float64's sums of the gates after each position (0 at the last), as one CumSum that
    sums from the end and leaves each position's own term out, with the keys' axis moved to the front for it."""

    class Decay(torch.nn.Module):
        def forward(self, log_gates):
            return torch.ops.kvg.decay_after(log_gates)

    log_gates = -torch.rand(2, 3, 17, generator=torch.Generator().manual_seed(0)) * 5
    table = {torch.ops.kvg.decay_after.default: lower_decay_after}
    graph, (got,) = run_lowered(Decay(), (log_gates,), table)
    naive = np.stack([log_gates.double().numpy()[..., j + 1 :].sum(-1) for j in range(17)], axis=-1)
    np.testing.assert_allclose(got, naive, rtol=0, atol=17 * 5 * 2e-7)  # as test_fox_reference's decay_after check
    (cumsum,) = [node for node in graph.node if node.op_type == "CumSum"]
    assert {a.name: a.i for a in cumsum.attribute} == {"exclusive": 1, "reverse": 1}
    assert constant(graph, cumsum.input[1]).item() == 0
    perms = [next(a.ints for a in n.attribute if a.name == "perm") for n in graph.node if n.op_type == "Transpose"]
    assert perms == [[2, 0, 1], [1, 2, 0]]


class InPlaceAttention(torch.nn.Module):
    """kvg::group_query_attention over one layer's buffers, every kv head's rows starting at the window's first slot."""

    def forward(self, query, key, value, key_cache, value_cache, bias, allowed, cache_position):
        return torch.ops.kvg.group_query_attention(
            query, key, value, key_cache, value_cache, bias, allowed, cache_position, None, HEADS, KV_HEADS
        )


def attention_inputs(batch: int, seq: int, window: int, padding: list[int], seed: int) -> tuple:
    """Random states, buffers of BUFFER slots (filled past the window too) and gate bias; the new tokens take the
    window's last `seq` slots, and row r's first `padding[r]` slots are padding (a padding query attends itself)."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=generator)

    cache_position = torch.arange(window - seq, window)
    allowed = torch.ones(batch, 1, seq, window, dtype=torch.bool)
    for row, pad in enumerate(padding):
        allowed[row, 0, :, :pad] = False
        for query, slot in enumerate(cache_position.tolist()):
            if slot < pad:
                allowed[row, 0, query, slot] = True
    bias = -3 * torch.rand(batch, HEADS, seq, window, generator=generator)
    return (
        normal(batch, seq, HEADS * HEAD_DIM), normal(batch, seq, KV_HEADS * HEAD_DIM),
        normal(batch, seq, KV_HEADS * HEAD_DIM), normal(batch, KV_HEADS, BUFFER, HEAD_DIM),
        normal(batch, KV_HEADS, BUFFER, HEAD_DIM), bias, allowed, cache_position,
    )  # fmt: skip


@pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")
@pytest.mark.parametrize("attention", ["gqa", "onnx-attention"])
@pytest.mark.parametrize(
    ("batch", "seq", "window", "padding"),
    [(2, 1, 6, [2, 0]), (1, 3, 5, [0]), (2, 4, 4, [1, 0])],
    ids=["decode-step", "later-chunk", "padded-prompt"],
)
def test_the_in_place_attention_lowering_matches_the_ops_eager_implementation(attention, batch, seq, window, padding):
    """kvg::group_query_attention lowered to onnxruntime's GroupQueryAttention (gqa) or to TensorScatter and ONNX
    Attention (onnx-attention) gives the op's eager output (PyTorch's scaled_dot_product_attention) and writes the
    same keys and values into the window's slots of the buffers; each lowering emits its own nodes alone."""
    inputs = attention_inputs(batch, seq, window, padding, seed=seq)
    graph, (out, present_key, present_value) = run_lowered(
        InPlaceAttention(), inputs, translations(attention), opset=24 if attention == "onnx-attention" else 20
    )
    with torch.no_grad():
        want = [tensor.numpy() for tensor in InPlaceAttention()(*inputs)]
    np.testing.assert_allclose(out, want[0], rtol=0, atol=2e-5)  # as test_fused_attention's outputs
    np.testing.assert_array_equal(present_key[:, :, :window], want[1][:, :, :window])
    np.testing.assert_array_equal(present_value[:, :, :window], want[2][:, :, :window])
    ops = [node.op_type for node in graph.node]
    if attention == "gqa":
        (node,) = [node for node in graph.node if node.op_type == "GroupQueryAttention"]
        assert node.domain == "com.microsoft" and "Attention" not in ops and "TensorScatter" not in ops
        assert {a.name: a.i for a in node.attribute} == {"num_heads": HEADS, "kv_num_heads": KV_HEADS}
    else:
        assert ops.count("TensorScatter") == 2 and ops.count("Attention") == 1 and "GroupQueryAttention" not in ops


def test_the_fused_attention_op_and_its_lowering_take_the_contracts_inputs_in_its_order():
    """kvg::fox_attention's tensors and the lowering's first parameters are the fused operator's inputs."""
    schema = torch.ops.kvg.fox_attention.default._schema
    tensors = [argument.name for argument in schema.arguments if "Tensor" in str(argument.type)]
    assert tensors == list(OP_INPUTS)
    assert list(inspect.signature(lower_fox_attention).parameters)[: len(OP_INPUTS)] == list(OP_INPUTS)
