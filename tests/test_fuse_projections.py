"""Joining projections: one MatMul per shared activation, the same products as separate matmuls."""

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from exporters.graph.passes.fuse_projections import fuse_projections


def graph_with_projections(weights: dict[str, np.ndarray], outputs_as_graph_outputs=()) -> ir.Model:
    """y_name = x @ weight for each weight; `outputs_as_graph_outputs` are returned as they are, the rest
    through an Identity."""
    x = ir.Value(name="x", shape=ir.Shape([2, 3, 8]), type=ir.TensorType(ir.DataType.FLOAT))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 20}, name="projections")
    for name, weight in weights.items():
        initializer = ir.Value(name=f"w_{name}", const_value=ir.tensor(weight))
        graph.register_initializer(initializer)
        product = ir.node("MatMul", [x, initializer], name=f"matmul_{name}")
        graph.append(product)
        if name in outputs_as_graph_outputs:
            product.outputs[0].name = name
            graph.outputs.append(product.outputs[0])
        else:
            identity = ir.node("Identity", [product.outputs[0]])
            identity.outputs[0].name = name
            graph.append(identity)
            graph.outputs.append(identity.outputs[0])
    for output in graph.outputs:
        output.dtype = ir.DataType.FLOAT
    return ir.Model(graph, ir_version=10)


def assert_products(got: np.ndarray, x: np.ndarray, weight: np.ndarray) -> None:
    """got == x @ weight within float32's rounding bound for dot products of this length (K eps sum |x w|)."""
    exact = x.astype(np.float64) @ weight.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(weight).astype(np.float64)
    assert np.all(np.abs(got - exact) <= weight.shape[0] * np.finfo(np.float32).eps * scale)


def run(model: ir.Model, x: np.ndarray) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString())
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x}), strict=True))


def assert_every_product(model: ir.Model, weights: dict[str, np.ndarray], rng: np.random.Generator) -> None:
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    got = run(model, x)
    for name, weight in weights.items():
        assert_products(got[name], x, weight)


def test_projections_of_one_activation_become_one_matmul_with_the_same_products():
    rng = np.random.default_rng(0)
    weights = {name: rng.standard_normal((8, width)).astype(np.float32) for name, width in
               (("query", 8), ("key", 4), ("value", 4), ("gate", 2))}  # fmt: skip
    model = graph_with_projections(weights)
    assert fuse_projections(model.graph) == 3
    assert [n.op_type for n in model.graph].count("MatMul") == 1
    joined = "matmul_query+matmul_key+matmul_value+matmul_gate"
    assert set(model.graph.initializers) == {f"{joined}.joined_weight", f"{joined}.joined_widths"}
    assert_every_product(model, weights, rng)


def test_a_projection_that_is_a_graph_output_is_left_alone():
    rng = np.random.default_rng(1)
    weights = {name: rng.standard_normal((8, 5)).astype(np.float32) for name in ("kept", "first", "second")}
    model = graph_with_projections(weights, outputs_as_graph_outputs=("kept",))
    assert fuse_projections(model.graph) == 1
    matmuls = [n for n in model.graph if n.op_type == "MatMul"]
    assert sorted(n.name for n in matmuls) == ["matmul_first+matmul_second", "matmul_kept"]
    assert_every_product(model, weights, rng)


def test_a_projection_kept_unjoined_stays_its_own_matmul():
    """A quantized export can keep the forget gate's projection in float, so it must not be joined then."""
    rng = np.random.default_rng(2)
    weights = {name: rng.standard_normal((8, 6)).astype(np.float32) for name in ("query", "key", "gate")}
    model = graph_with_projections(weights)
    assert fuse_projections(model.graph, keep_unjoined=lambda node: node.name == "matmul_gate") == 1
    matmuls = [n for n in model.graph if n.op_type == "MatMul"]
    assert sorted(n.name for n in matmuls) == ["matmul_gate", "matmul_query+matmul_key"]
    assert_every_product(model, weights, rng)
