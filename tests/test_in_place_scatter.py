"""The gate write of a gqa dynamic graph: a Pad and a scatter, becoming an If that scatters in place when the pad
is nothing; the same values either way, checked against numpy."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from exporters.graph.passes.in_place_scatter import scatter_in_place

BATCH, HEADS = 2, 3


def padded_scatter_model() -> ir.Model:
    """present = ScatterElements(Pad(past, [0, 0, 0, 0, 0, grow]), slot, new) along the last axis: a gate
    write as torch.onnx lowers the cache update, `grow` the window's excess over the past."""
    past = ir.Value(name="past", shape=ir.Shape([BATCH, HEADS, "past"]), type=ir.TensorType(ir.DataType.FLOAT))
    new = ir.Value(name="new", shape=ir.Shape([BATCH, HEADS, 1]), type=ir.TensorType(ir.DataType.FLOAT))
    slot = ir.Value(name="slot", shape=ir.Shape([BATCH, HEADS, 1]), type=ir.TensorType(ir.DataType.INT64))
    grow = ir.Value(name="grow", shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64))
    zeros = ir.Value(name="zeros", const_value=ir.tensor(np.zeros(5, np.int64)))
    graph = ir.Graph([past, new, slot, grow], [], nodes=[], opset_imports={"": 20}, name="gate_write")
    graph.register_initializer(zeros)
    pads = ir.node("Concat", [zeros, grow], {"axis": 0})
    pad = ir.node("Pad", [past, pads.outputs[0]], {"mode": "constant"}, name="pad")
    scatter = ir.node("ScatterElements", [pad.outputs[0], slot, new], {"axis": -1}, name="scatter")
    graph.extend([pads, pad, scatter])
    scatter.outputs[0].name, scatter.outputs[0].dtype = "present", ir.DataType.FLOAT
    graph.outputs.append(scatter.outputs[0])
    return ir.Model(graph, ir_version=10)


def session(model: ir.Model) -> ort.InferenceSession:
    return ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"])


def expected(past: np.ndarray, grow: int, slot: int, new: np.ndarray) -> np.ndarray:
    written = np.concatenate([past, np.zeros((BATCH, HEADS, grow), np.float32)], axis=-1)
    written[..., slot] = new[..., 0]
    return written


def feeds(past: np.ndarray, grow: int, slot: int, new: np.ndarray) -> dict:
    return {"past": past, "new": new, "slot": np.full((BATCH, HEADS, 1), slot), "grow": np.array([grow])}


def test_the_pad_and_scatter_become_an_if_that_scatters_into_the_past_itself():
    model = padded_scatter_model()
    assert scatter_in_place(model.graph) == 1
    (written,) = [node for node in model.graph if node.op_type == "If"]
    assert written.outputs[0].name == "present" and written.outputs[0].is_graph_output()
    then_branch = written.attributes["then_branch"].as_graph()
    assert [(node.op_type, node.inputs[0].name) for node in then_branch] == [("ScatterElements", "past")]
    else_branch = written.attributes["else_branch"].as_graph()
    assert [node.op_type for node in else_branch] == ["Pad", "ScatterElements"]
    assert not any(node.op_type == "Pad" for node in model.graph)  # only the else-branch pads
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)


@pytest.mark.parametrize(("length", "grow", "slot"), [(4, 1, 4), (4, 3, 5), (9, 0, 4), (9, 0, 8)])
def test_either_branch_writes_what_pad_then_scatter_writes(length, grow, slot):
    rng = np.random.default_rng(length + grow + slot)
    past = rng.standard_normal((BATCH, HEADS, length)).astype(np.float32)
    new = rng.standard_normal((BATCH, HEADS, 1)).astype(np.float32)
    model = padded_scatter_model()
    scatter_in_place(model.graph)
    (present,) = session(model).run(None, feeds(past, grow, slot, new))
    np.testing.assert_array_equal(present, expected(past, grow, slot, new))


def test_a_buffer_bound_as_past_and_present_is_written_where_it_lies():
    """How the runtime runs it: one buffer as both; the untouched slots keep their values."""
    rng = np.random.default_rng(7)
    past = rng.standard_normal((BATCH, HEADS, 12)).astype(np.float32)
    new = rng.standard_normal((BATCH, HEADS, 1)).astype(np.float32)
    want = expected(past, 0, 5, new)
    model = padded_scatter_model()
    scatter_in_place(model.graph)
    run = session(model)
    buffer = ort.OrtValue.ortvalue_from_numpy(past)
    binding = run.io_binding()
    binding.bind_ortvalue_input("past", buffer)
    binding.bind_ortvalue_output("present", buffer)
    for name, value in feeds(past, 0, 5, new).items():
        if name != "past":
            binding.bind_cpu_input(name, value)
    run.run_with_iobinding(binding)
    np.testing.assert_array_equal(past, want)  # `past` is the buffer's memory


def test_a_pad_of_a_computed_tensor_is_left_alone():
    model = padded_scatter_model()
    pad = next(node for node in model.graph if node.op_type == "Pad")
    doubled = ir.node("Add", [pad.inputs[0], pad.inputs[0]])
    model.graph.insert_before(pad, doubled)
    pad.replace_input_with(0, doubled.outputs[0])  # not a graph input: no buffer to write in place
    assert scatter_in_place(model.graph) == 0


def test_an_exported_gqa_dynamic_graph_writes_every_layers_gates_in_place(exported):
    result, _ = exported("fox-tiny", "dynamic")
    graph = onnx.load(str(result.path / "model.onnx"), load_external_data=False).graph
    layers = sum(1 for node in graph.node if node.op_type == "GroupQueryAttention")
    gate_writes = {node.output[0]: node for node in graph.node if node.output[0].endswith(".gate")}
    assert len(gate_writes) == layers and all(node.op_type == "If" for node in gate_writes.values())
    for name, node in gate_writes.items():
        then_branch = next(a.g for a in node.attribute if a.name == "then_branch")
        assert [(n.op_type, n.input[0]) for n in then_branch.node] == [
            ("ScatterElements", name.replace("present", "past_key_values"))
        ]
    assert not any(node.op_type == "Pad" for node in graph.node)
