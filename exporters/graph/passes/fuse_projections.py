"""Projections of one activation through constant weights become one MatMul over the joined weights, then a Split.

FoX's attention reads its normed input through four projections (query, key, value and forget gate). At
decode time each is a matrix-vector product that onnxruntime dispatches on its own, to its thread pool;
joined, the same weight bytes stream through one kernel, as in the packed QKV weights of onnxruntime-genai's
models. The rewrite is exact (the columns are the same dot products), and export validation checks the
result against eager PyTorch like any other graph.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np
import onnx_ir as ir


def _projects_through_constant(node: ir.Node) -> bool:
    """Whether the node is a MatMul whose right operand is a constant 2-D weight."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
        return False
    weight = node.inputs[1]
    return (
        weight is not None
        and weight.is_initializer()
        and weight.const_value is not None
        and len(weight.const_value.shape) == 2
    )


def _joined(parts: list) -> ir.LazyTensor:
    """The weights side by side, joined only when read (as the graph is saved, one at a time): held joined, the
    copies would add about half the model's weights to the exporter's peak."""
    rows, widths = parts[0].shape[0], sum(part.shape[1] for part in parts)
    return ir.LazyTensor(
        lambda: ir.tensor(np.concatenate([part.numpy() for part in parts], axis=1)), parts[0].dtype,
        ir.Shape([rows, widths]),
    )  # fmt: skip


def fuse_projections(graph: ir.Graph, keep_unjoined: Callable[[ir.Node], bool] = lambda node: False) -> int:
    """Join every group of MatMuls that share their left operand and have constant weights of one dtype,
    leaving out those `keep_unjoined` names (a quantized export keeps some projections in float); returns how
    many MatMuls were removed. The joined MatMul is named after its parts, joined by "+"."""
    groups: dict[ir.Value, list[ir.Node]] = defaultdict(list)
    for node in graph:
        if _projects_through_constant(node) and not node.outputs[0].is_graph_output() and not keep_unjoined(node):
            groups[node.inputs[0]].append(node)
    removed = 0
    for nodes in groups.values():
        old_weights = [node.inputs[1] for node in nodes]
        if len(nodes) < 2 or len({weight.const_value.dtype for weight in old_weights}) > 1:
            continue
        parts = [weight.const_value for weight in old_weights]
        name = "+".join(node.name or node.outputs[0].name for node in nodes)
        joined = ir.Value(name=f"{name}.joined_weight", const_value=_joined(parts))
        widths = ir.Value(
            name=f"{name}.joined_widths", const_value=ir.tensor(np.array([p.shape[1] for p in parts], np.int64))
        )
        graph.register_initializer(joined)
        graph.register_initializer(widths)
        matmul = ir.node("MatMul", [nodes[0].inputs[0], joined], name=name)
        split = ir.node(
            "Split", [matmul.outputs[0], widths], {"axis": -1}, num_outputs=len(nodes), name=f"{name}.split"
        )
        graph.insert_before(nodes[0], [matmul, split])
        matmul.outputs[0].dtype = joined.const_value.dtype
        for node, output in zip(nodes, split.outputs, strict=True):
            output.shape, output.dtype = node.outputs[0].shape, joined.const_value.dtype
            ir.convenience.replace_all_uses_with(node.outputs[0], output)
        graph.remove(nodes, safe=True)
        for weight in old_weights:
            if not weight.uses():
                del graph.initializers[weight.name]
        removed += len(nodes) - 1
    return removed
