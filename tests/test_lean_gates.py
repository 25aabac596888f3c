"""The forget-gate rewrites: fewer nodes, the same bits, and the formulas they stand for."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from exporters.graph.passes.lean_gates import lean_gates

BATCH, HEADS, BUFFER = 2, 3, 9
FLOAT = ir.DataType.FLOAT


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


LOWEST = np.finfo(np.float32).min


def masked_bias_model(fill: float = LOWEST) -> ir.Model:
    """The gate-sum row masked where a key is not allowed, as the in-place attention's lowering writes it."""
    return graph_of(
        {"allowed": (ir.DataType.BOOL, [BATCH, 1, 2, BUFFER]), "bias": (FLOAT, [BATCH, HEADS, 1, BUFFER])},
        {"lowest": np.array(fill, np.float32)},
        chain(("Where", ["allowed", "bias", "lowest"], {})),
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
    # float32's rounding of z + b (in the graph, not in the float64 reference) reaches the log gate times
    # its slope; 1e-6 is a few ulp at these logits, and atol only admits gates that underflow float32
    np.testing.assert_allclose(after, expected, rtol=1e-6, atol=1e-30)


def test_the_masked_bias_becomes_an_add_of_one_shared_mask_and_keeps_every_bit():
    rng = np.random.default_rng(1)
    bias = np.cumsum(-rng.exponential(30.0, (BATCH, HEADS, 1, BUFFER)), axis=-1).astype(np.float32)[..., ::-1]
    allowed = rng.random((BATCH, 1, 2, BUFFER)) < 0.6
    allowed[..., 0] = True  # every query is allowed a key
    feeds = {"allowed": allowed, "bias": np.ascontiguousarray(bias)}
    before = run(masked_bias_model(), feeds)
    model = masked_bias_model()
    assert lean_gates(model) == -1  # Where becomes Where (of the mask) and Add: one more node, in every layer shared
    assert sorted(node.op_type for node in model.graph) == ["Add", "Where"]
    after = run(model, feeds)
    np.testing.assert_array_equal(after, before)
    np.testing.assert_array_equal(after, np.where(allowed, bias, LOWEST))


def test_a_mask_that_is_not_float32s_lowest_is_left_alone():
    model = masked_bias_model(fill=-1e9)  # bias + fill would not round to fill
    assert lean_gates(model) == 0
    assert [node.op_type for node in model.graph] == ["Where"]


def test_an_exported_gqa_graph_runs_each_layers_gates_in_the_lean_form(exported):
    result, _ = exported("fox-tiny", "dynamic", attention="gqa")
    graph = onnx.load(str(result.path / "model.onnx"), load_external_data=False).graph
    producers = {output: node for node in graph.node for output in node.output}
    layers = sum(1 for node in graph.node if node.op_type == "GroupQueryAttention")
    softplus = [node for node in graph.node if node.op_type == "Softplus"]
    assert len(softplus) == layers and all(producers[n.input[0]].op_type == "Transpose" for n in softplus)
    negations = [node for node in graph.node if node.op_type == "Neg" and not node.name.startswith("logits_to_keep")]
    assert len(negations) == 1  # -keep, shared
    masked = [node for node in graph.node if node.op_type == "GroupQueryAttention"]
    added = [producers[n.input[10]] for n in masked]  # attention_bias (fp32: no CastLike left)
    assert [node.op_type for node in added] == ["Add"] * layers
    assert len({node.input[1] for node in added}) == 1  # one mask for every layer
