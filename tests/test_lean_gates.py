"""The forget-gate rewrites: fewer nodes, the same bits, and the formulas they stand for."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from exporters.lean_gates import lean_gates

BATCH, HEADS, BUFFER = 2, 3, 9
FLOAT, INT64 = ir.DataType.FLOAT, ir.DataType.INT64


def graph_of(inputs: dict[str, tuple[ir.DataType, list]], constants: dict[str, np.ndarray], build) -> ir.Model:
    """A model whose inputs and initializers are named as given and whose one output `build(values)` makes
    from them with ir.node calls (it returns the nodes, the last one's output being the result)."""
    values = {name: ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype))
              for name, (dtype, shape) in inputs.items()}  # fmt: skip
    graph = ir.Graph(list(values.values()), [], nodes=[], opset_imports={"": 20}, name="gates")
    for name, array in constants.items():
        values[name] = ir.Value(name=name, const_value=ir.tensor(array, name=name))
        graph.register_initializer(values[name])
    nodes = build(values)
    graph.extend(nodes)
    result = nodes[-1].outputs[0]
    result.name, result.dtype = "result", FLOAT
    graph.outputs.append(result)
    return ir.Model(graph, ir_version=10)


def run(model: ir.Model, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString())
    return session.run(None, feeds)[0]


def chain(first: tuple, *rest: tuple):
    """`build` for a chain of nodes: `first`'s op on the listed inputs, then each (op, extra inputs,
    attributes) on the previous output."""

    def build(values):
        op, inputs, attributes = first
        nodes = [ir.node(op, [values[name] for name in inputs], attributes)]
        for op, extra, attributes in rest:
            nodes.append(ir.node(op, [nodes[-1].outputs[0], *(values[name] for name in extra)], attributes))
        return nodes

    return build


def log_gate_model(bias: np.ndarray) -> ir.Model:
    """-softplus(-(z + b)) * keep, as torch.onnx writes `log_forget_gate` and the padding mask after it."""
    return graph_of(
        {"z": (FLOAT, [BATCH, 1, HEADS]), "keep": (FLOAT, [BATCH, 1, 1])},
        {"bias": bias},
        chain(
            ("Add", ["z", "bias"], {}),
            ("Transpose", [], {"perm": [0, 2, 1]}),
            ("Neg", [], {}),
            ("Softplus", [], {}),
            ("Neg", [], {}),
            ("Mul", ["keep"], {}),
        ),
    )


def window_decay_model() -> ir.Model:
    """The row of gate sums after each key of the mask's window, as `_attend_in_place` is exported."""
    return graph_of(
        {"gates": (FLOAT, [BATCH, HEADS, BUFFER]), "mask": (INT64, [BATCH, "window"])},
        {
            "zero": np.array([0]),
            "one": np.array([1]),
            "last": np.array([2]),
            "sum_axis": np.array(-1),
            "query_axis": np.array([2]),
        },
        lambda v: [
            shape := ir.node("Shape", [v["mask"]], {"start": 1, "end": 2}),
            cut := ir.node("Slice", [v["gates"], v["zero"], shape.outputs[0], v["last"], v["one"]]),
            summed := ir.node("CumSum", [cut.outputs[0], v["sum_axis"]], {"exclusive": 1, "reverse": 1}),
            ir.node("Unsqueeze", [summed.outputs[0], v["query_axis"]]),
        ],
    )


def test_the_log_gate_loses_both_negations_and_keeps_every_bit():
    rng = np.random.default_rng(0)
    bias = np.array([-200.0, 0.5, 200.0], np.float32)  # saturated gates both ways
    z = (rng.standard_normal((BATCH, 1, HEADS)) * 30).astype(np.float32)
    keep = np.array([1.0, 0.0], np.float32).reshape(BATCH, 1, 1)  # a padded row's gate is 0
    before = run(log_gate_model(bias), {"z": z, "keep": keep})
    model = log_gate_model(bias)
    assert lean_gates(model) == 1  # Add, Neg and Neg out; Sub and the shared Neg of keep in
    ops = [node.op_type for node in model.graph]
    assert sorted(ops) == sorted(["Sub", "Transpose", "Softplus", "Neg", "Mul"])
    after = run(model, {"z": z, "keep": keep})
    np.testing.assert_array_equal(after, before)
    logits = z.astype(np.float64) + bias
    expected = -np.logaddexp(0.0, -logits).transpose(0, 2, 1) * keep.reshape(BATCH, 1, 1)  # log sigmoid, masked
    np.testing.assert_allclose(after, expected, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("window", [1, 5, BUFFER])
def test_the_window_decay_is_gathered_with_its_query_axis_and_sums_alike(window):
    rng = np.random.default_rng(window)
    gates = -rng.exponential(1.0, (BATCH, HEADS, BUFFER)).astype(np.float32)
    feeds = {"gates": gates, "mask": np.ones((BATCH, window), np.int64)}
    before = run(window_decay_model(), feeds)
    model = window_decay_model()
    lean_gates(model)
    ops = [node.op_type for node in model.graph]
    assert "Slice" not in ops and "Unsqueeze" in ops and ops.count("CumSum") == 1
    assert next(n for n in model.graph if n.op_type == "CumSum").inputs[0].producer().op_type == "Gather"
    after = run(model, feeds)
    np.testing.assert_array_equal(after, before)
    held = gates[..., :window].astype(np.float64)
    after_each = np.array([[[held[b, h, j + 1 :].sum() for j in range(window)] for h in range(HEADS)]
                           for b in range(BATCH)])  # fmt: skip
    np.testing.assert_allclose(after[:, :, 0], after_each, rtol=1e-6, atol=1e-6)
    assert after.shape == (BATCH, HEADS, 1, window)


def test_a_slice_that_does_not_start_at_the_first_slot_is_left_alone():
    model = window_decay_model()
    model.graph.initializers["zero"].const_value = ir.tensor(np.array([1]), name="zero")
    assert lean_gates(model) == 0
    assert [node.op_type for node in model.graph] == ["Shape", "Slice", "CumSum", "Unsqueeze"]


def test_an_exported_gqa_graph_runs_each_layers_gates_in_the_lean_form(exported):
    result, _ = exported("fox-tiny", "dynamic")
    graph = onnx.load(str(result.path / "model.onnx"), load_external_data=False).graph
    producers = {output: node for node in graph.node for output in node.output}
    layers = sum(1 for node in graph.node if node.op_type == "GroupQueryAttention")
    softplus = [node for node in graph.node if node.op_type == "Softplus"]
    assert len(softplus) == layers and all(producers[n.input[0]].op_type == "Transpose" for n in softplus)
    assert sum(1 for node in graph.node if node.op_type == "Neg") == 1  # -keep, shared
    sums = [node for node in graph.node if node.op_type == "CumSum"]
    assert len(sums) == layers and all(producers[n.input[0]].op_type == "Gather" for n in sums)
