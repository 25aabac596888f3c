"""Joining a residual add with its RMSNorm: one SkipSimplifiedLayerNormalization, the same sum and norm."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from exporters.graph.passes.fuse_norms import fusable_head_norms, fuse_residual_norms

EPS = 1e-6
HIDDEN = 16


def norm_constants(graph: ir.Graph, weight: np.ndarray) -> dict[str, ir.Value]:
    """The initializers `rms_norm_nodes` reads."""
    constants = {"two": np.array(2.0, np.float32), "eps": np.array(EPS, np.float32),
                 "axes": np.array([-1], np.int64), "weight": weight}  # fmt: skip
    for name, value in constants.items():
        graph.register_initializer(ir.Value(name=name, const_value=ir.tensor(value, name=name)))
    return graph.initializers


def rms_norm_nodes(x: ir.Value, init: dict[str, ir.Value]) -> list[ir.Node]:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, as torch.onnx writes `layers.rms_normalize`."""
    nodes = [ir.node("Pow", [x, init["two"]])]
    reduce_attributes = {"keepdims": 1, "noop_with_empty_axes": 0}
    nodes.append(ir.node("ReduceMean", [nodes[-1].outputs[0], init["axes"]], reduce_attributes))
    nodes.append(ir.node("Add", [nodes[-1].outputs[0], init["eps"]]))
    nodes.append(ir.node("Sqrt", [nodes[-1].outputs[0]]))
    nodes.append(ir.node("Div", [x, nodes[-1].outputs[0]]))
    nodes.append(ir.node("Mul", [nodes[-1].outputs[0], init["weight"]]))
    return nodes


def with_outputs(graph: ir.Graph, outputs: dict[str, ir.Value], dtype: ir.DataType) -> ir.Model:
    """The graph with an Identity of each value as its named output."""
    for name, value in outputs.items():
        node = ir.node("Identity", [value])
        graph.append(node)
        node.outputs[0].name, node.outputs[0].dtype, node.outputs[0].shape = name, dtype, value.shape
        graph.outputs.append(node.outputs[0])
    return ir.Model(graph, ir_version=10)


def residual_norm_graph(dtype: np.dtype, weight: np.ndarray, other_shape=(2, 3, HIDDEN)) -> ir.Model:
    """normed = rms_normalize(a + b) * weight, written as torch.onnx writes `layers.rms_normalize` (cast to
    float32 and back for a half-precision model), and the sum itself, which the next block adds to."""
    elem = ir.DataType.from_numpy(np.dtype(dtype))
    a = ir.Value(name="a", shape=ir.Shape([2, 3, HIDDEN]), type=ir.TensorType(elem))
    b = ir.Value(name="b", shape=ir.Shape(list(other_shape)), type=ir.TensorType(elem))
    graph = ir.Graph([a, b], [], nodes=[], opset_imports={"": 20}, name="residual_norm")
    init = norm_constants(graph, weight)
    total = ir.node("Add", [a, b])
    nodes = [total]
    x = total.outputs[0]
    if elem != ir.DataType.FLOAT:
        nodes.append(ir.node("Cast", [x], {"to": ir.DataType.FLOAT}))
        x = nodes[-1].outputs[0]
    nodes += rms_norm_nodes(x, init)
    if elem != ir.DataType.FLOAT:
        nodes.append(ir.node("Cast", [nodes[-1].outputs[0]], {"to": elem}))
    for node in nodes:
        graph.append(node)
    return with_outputs(graph, {"normed": nodes[-1].outputs[0], "sum": total.outputs[0]}, elem)


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


HEADS, HEAD_DIM = 3, 8
# Two float32 units in the last place at the norms' largest values here (about 3.4): the fused norm is within
# 3.4e-7 of the float64 one (measured)
HEAD_NORM_TOLERANCE = 2 * float(np.spacing(np.float32(3.4)))


def head_norm_graph(weight: np.ndarray, times: int = 1) -> ir.Model:
    """`layers.HeadRMSNorm` of x `[2, 5, HEADS, HEAD_DIM]` with `weight` `[1 or HEADS, HEAD_DIM]`, `times` over
    (each norm reading the one weight, as torch.onnx leaves weights of equal values)."""
    x = ir.Value(name="x", shape=ir.Shape([2, 5, HEADS, HEAD_DIM]), type=ir.TensorType(ir.DataType.FLOAT))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 20}, name="head_norm")
    init = norm_constants(graph, weight)
    for _ in range(times):
        graph.extend(nodes := rms_norm_nodes(x, init))
        nodes[-1].outputs[0].shape, nodes[-1].outputs[0].type = x.shape, x.type  # as torch.onnx infers them
        x = nodes[-1].outputs[0]
    return with_outputs(graph, {"normed": x}, ir.DataType.FLOAT)


@pytest.mark.parametrize("heads", [1, HEADS], ids=["shared", "per-head"])
def test_a_heads_norm_is_one_onnxruntime_fuses_with_the_same_results(heads, tmp_path):
    """onnxruntime fuses an RMSNorm whose weight is one-dimensional only: after the rewrite a head's norm, with one
    weight for every head or a weight per head, is a SimplifiedLayerNormalization in the graph it runs."""
    rng = np.random.default_rng(1)
    weight = rng.uniform(0.5, 1.5, (heads, HEAD_DIM)).astype(np.float32)
    model = head_norm_graph(weight)
    assert fusable_head_norms(model) == 1
    x = rng.standard_normal((2, 5, HEADS, HEAD_DIM)).astype(np.float32)
    np.testing.assert_allclose(run(model, {"x": x})["normed"], rms_norm(x, weight), atol=HEAD_NORM_TOLERANCE)
    settings = ort.SessionOptions()
    settings.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), settings)
    ran = [node.op_type for node in onnx.load(settings.optimized_model_filepath).graph.node]
    assert "SimplifiedLayerNormalization" in ran and "Pow" not in ran, ran


@pytest.mark.parametrize("shape", [(HEADS, 1), (1, 1, 1, 1, HEAD_DIM)], ids=["per-head scale", "higher rank"])
def test_a_weight_that_is_not_a_heads_is_left_alone(shape):
    """A weight whose last axis is not the normalized one (one scale per head), or of a higher rank than the
    input (the product broadcasts to more axes), is not a head's norm weight: its norm keeps its nodes."""
    model = head_norm_graph(np.ones(shape, np.float32))
    assert fusable_head_norms(model) == 0


def test_norms_that_read_one_weight_are_each_rewritten():
    rng = np.random.default_rng(2)
    weight = rng.uniform(0.5, 1.5, (1, HEAD_DIM)).astype(np.float32)
    model = head_norm_graph(weight, times=2)
    assert fusable_head_norms(model) == 2
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    x = rng.standard_normal((2, 5, HEADS, HEAD_DIM)).astype(np.float32)
    np.testing.assert_allclose(
        run(model, {"x": x})["normed"], rms_norm(rms_norm(x, weight), weight), atol=HEAD_NORM_TOLERANCE
    )
