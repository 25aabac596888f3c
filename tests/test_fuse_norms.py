"""Joining a residual add with its RMSNorm: one SkipSimplifiedLayerNormalization, the same sum and norm."""

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from exporters.fuse_norms import fuse_residual_norms

EPS = 1e-6
HIDDEN = 16


def residual_norm_graph(dtype: np.dtype, weight: np.ndarray, other_shape=(2, 3, HIDDEN)) -> ir.Model:
    """normed = rms_normalize(a + b) * weight, written as torch.onnx writes `layers.rms_normalize` (cast to
    float32 and back for a half-precision model), and the sum itself, which the next block adds to."""
    elem = ir.DataType.from_numpy(np.dtype(dtype))
    a = ir.Value(name="a", shape=ir.Shape([2, 3, HIDDEN]), type=ir.TensorType(elem))
    b = ir.Value(name="b", shape=ir.Shape(list(other_shape)), type=ir.TensorType(elem))
    graph = ir.Graph([a, b], [], nodes=[], opset_imports={"": 20}, name="residual_norm")
    constants = {"two": np.array(2.0, np.float32), "eps": np.array(EPS, np.float32),
                 "axes": np.array([-1], np.int64), "weight": weight}  # fmt: skip
    for name, value in constants.items():
        graph.register_initializer(ir.Value(name=name, const_value=ir.tensor(value, name=name)))
    init = graph.initializers
    total = ir.node("Add", [a, b])
    nodes = [total]
    x = total.outputs[0]
    if elem != ir.DataType.FLOAT:
        nodes.append(ir.node("Cast", [x], {"to": ir.DataType.FLOAT}))
        x = nodes[-1].outputs[0]
    nodes.append(ir.node("Pow", [x, init["two"]]))
    reduce_attributes = {"keepdims": 1, "noop_with_empty_axes": 0}
    nodes.append(ir.node("ReduceMean", [nodes[-1].outputs[0], init["axes"]], reduce_attributes))
    nodes.append(ir.node("Add", [nodes[-1].outputs[0], init["eps"]]))
    nodes.append(ir.node("Sqrt", [nodes[-1].outputs[0]]))
    nodes.append(ir.node("Div", [x, nodes[-1].outputs[0]]))
    nodes.append(ir.node("Mul", [nodes[-1].outputs[0], init["weight"]]))
    if elem != ir.DataType.FLOAT:
        nodes.append(ir.node("Cast", [nodes[-1].outputs[0]], {"to": elem}))
    for node in nodes:
        graph.append(node)
    normed = ir.node("Identity", [nodes[-1].outputs[0]])
    carried = ir.node("Identity", [total.outputs[0]])
    graph.extend([normed, carried])
    for node, name in ((normed, "normed"), (carried, "sum")):
        node.outputs[0].name, node.outputs[0].dtype = name, elem
        graph.outputs.append(node.outputs[0])
    return ir.Model(graph, ir_version=10)


def run(model: ir.Model, feeds: dict) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString())
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


def rms_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + EPS) * weight


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_residual_add_and_its_norm_become_one_node_with_the_same_results(dtype):
    rng = np.random.default_rng(0)
    weight = rng.uniform(0.5, 1.5, HIDDEN).astype(dtype).astype(np.float32)  # fp16 models: an fp16 value in fp32
    model = residual_norm_graph(dtype, weight)
    assert fuse_residual_norms(model) == 1
    assert [n.op_type for n in model.graph] == ["SkipSimplifiedLayerNormalization", "Identity", "Identity"]
    a, b = (rng.standard_normal((2, 3, HIDDEN)).astype(dtype) for _ in range(2))
    got = run(model, {"a": a, "b": b})
    total = a + b  # in the model's dtype, as the add before the fusion computed it
    tolerance = 1e-6 if dtype == np.float32 else 2e-3  # float32's rounding; fp16's half ulp at |x| < 4
    np.testing.assert_array_equal(got["sum"], total)  # one rounding of the exact sum either way
    np.testing.assert_allclose(got["normed"], rms_norm(a.astype(np.float32) + b, weight), atol=tolerance)


def test_a_broadcast_add_is_not_a_residual_and_is_left_alone():
    weight = np.ones(HIDDEN, np.float32)
    model = residual_norm_graph(np.float32, weight, other_shape=(1, 1, HIDDEN))
    assert fuse_residual_norms(model) == 0
    assert "SkipSimplifiedLayerNormalization" not in {n.op_type for n in model.graph}


def test_a_weight_the_half_precision_model_cannot_hold_is_left_alone():
    """The fused op takes its weight in the summands' dtype; 1 + 2^-20 has no fp16 value, so rounding it
    would change the norm."""
    weight = np.full(HIDDEN, 1 + 2.0**-20, np.float32)
    model = residual_norm_graph(np.float16, weight)
    assert fuse_residual_norms(model) == 0
