"""A scatter into a padded cache input writes into the cache in place whenever the pad is nothing.

A gqa dynamic graph writes each layer's new gates with `ScatterElements(Pad(past_gates, pads))`: the Pad
grows a past exactly as long as the filled positions (the contract's `present = past + seq`) to the
attention window. The runtime instead binds one buffer longer than the window as both past and present,
and then the pads are zero, but onnxruntime's Pad copies the whole buffer anyway, every step and in every
layer, so the step's cost grew with the buffer's length. Here the pair becomes an If on "the pads are all
zero": its then-branch scatters into the past itself (onnxruntime's ScatterElements skips its copy when
its input and output are one buffer), its else-branch pads as before. Both branches compute the same
tensor, so the rewrite is exact, and export validation runs both (the contract's past and the runtime's
longer buffers).
"""

from __future__ import annotations

import onnx_ir as ir


def _padded_input(node: ir.Node) -> ir.Node | None:
    """The Pad feeding a ScatterElements' data, if it pads a graph input with zeros and nothing else reads it."""
    if node.op_type != "ScatterElements" or node.domain not in ("", "ai.onnx"):
        return None
    pad = node.inputs[0].producer() if node.inputs[0] is not None else None
    if pad is None or pad.op_type != "Pad" or pad.domain not in ("", "ai.onnx") or len(pad.outputs[0].uses()) != 1:
        return None
    mode = pad.attributes.get("mode")
    plain = (mode is None or mode.as_string() == "constant") and len(pad.inputs) == 2  # no fill value, no axes
    return pad if plain and pad.inputs[0].is_graph_input() else None


def _all_zero(graph: ir.Graph, pads: ir.Value, before: ir.Node) -> ir.Value:
    """A bool scalar: whether every pad amount is 0 (ReduceMax of their absolute values equals 0)."""
    size = ir.node("Abs", [pads])
    largest = ir.node("ReduceMax", [size.outputs[0]], {"keepdims": 0})
    zero = ir.Value(name=f"{before.name}.zero", const_value=ir.tensor(0, dtype=ir.DataType.INT64))
    graph.register_initializer(zero)
    nothing = ir.node("Equal", [largest.outputs[0], zero])
    for node, name in ((size, "size"), (largest, "largest"), (nothing, "nothing")):
        node.outputs[0].name = f"{before.name}.pads_{name}"
    graph.insert_before(before, [size, largest, nothing])
    return nothing.outputs[0]


def _branch(name: str, nodes: list[ir.Node]) -> ir.Graph:
    return ir.Graph(inputs=[], outputs=[nodes[-1].outputs[0]], nodes=nodes, name=name)


def scatter_in_place(graph: ir.Graph) -> int:
    """Rewrite every ScatterElements into a zero-padded graph input as described above; returns how many."""
    pairs = [(node, pad) for node in graph if (pad := _padded_input(node)) is not None]
    unpadded: dict[ir.Value, ir.Value] = {}  # pads -> "they are all zero", computed once for the layers sharing them
    for scatter, pad in pairs:
        past, pads = pad.inputs
        if pads not in unpadded:
            unpadded[pads] = _all_zero(graph, pads, pad)
        indices, updates = scatter.inputs[1:]
        result = scatter.outputs[0]
        shape = result.shape or ir.Shape([None] * len(past.shape))  # a branch output needs one
        attributes = dict(scatter.attributes)
        in_place = ir.node("ScatterElements", [past, indices, updates], attributes, name=f"{scatter.name}.in_place")
        padded = ir.node("Pad", [past, pads], dict(pad.attributes), name=pad.name)
        grown = ir.node("ScatterElements", [padded.outputs[0], indices, updates], attributes, name=scatter.name)
        for node, name in ((in_place, "in_place"), (padded, "padded"), (grown, "grown")):
            node.outputs[0].name = f"{scatter.name}.{name}"  # a subgraph shares the graph's names: none may repeat
            node.outputs[0].dtype, node.outputs[0].shape = result.dtype, shape
        branches = {"then_branch": _branch(f"{scatter.name}.in_place", [in_place]),
                    "else_branch": _branch(f"{scatter.name}.padded", [padded, grown])}  # fmt: skip
        written = ir.node("If", [unpadded[pads]], branches, name=f"{scatter.name}.if_unpadded")
        graph.insert_before(scatter, written)
        output = written.outputs[0]
        output.dtype, output.shape = result.dtype, shape
        name, result.name = result.name, None  # a graph output keeps its contract name
        ir.convenience.replace_all_uses_with(result, output, replace_graph_outputs=True)
        output.name = name
        graph.remove([scatter, pad], safe=True)
    return len(pairs)
