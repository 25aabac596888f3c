"""Names in the lowered graph: nodes that read a weight named after their module, and every value's name unique
across the graph and its branches."""

from __future__ import annotations

import ast

import onnx_ir as ir


def name_by_module(graph: ir.Graph) -> int:
    """Name each node that reads a weight (MatMul, the embedding's Gather) after its module as the state dict
    names it (`model.layers.0.attn.fgate_proj`, `lm_head`), so that a quantization pass can choose by role and
    a reader of the graph sees what each product is. Returns how many were named."""
    taken, named = {node.name for node in graph}, 0
    for node in graph:
        scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
        weight = {"MatMul": 1, "Gather": 0}.get(node.op_type)
        if scopes is None or weight is None or not node.inputs[weight].is_initializer():
            continue
        module = ast.literal_eval(scopes)[-2].removeprefix("model.")  # the wrapper holds the model as `model`
        if module not in taken:
            taken.add(module)
            node.name = module
            named += 1
    return named


def unique_names(graph: ir.Graph) -> int:
    """Rename each value whose name an earlier one in `graph` or its If branches took. The rewrites name what they
    add uniquely in its own graph only, and onnx resolves a branch's name to an outer value first, wherever in the
    outer graph that is (onnx_ir's NameFixPass sees only the outer names before the branch). Returns how many."""
    taken = {value.name for value in (*graph.inputs, *graph.outputs, *graph.initializers.values())}
    kept = {*graph.inputs, *graph.outputs, *graph.initializers.values()}
    renamed = []

    def claim(value: ir.Value) -> None:
        if value in kept or value.name not in taken:
            taken.add(value.name)
            return
        index = 1
        while f"{value.name}_{index}" in taken:
            index += 1
        value.name = f"{value.name}_{index}"
        taken.add(value.name)
        renamed.append(value)

    for node in ir.traversal.RecursiveGraphIterator(graph):
        for attribute in node.attributes.values():
            if attribute.type == ir.AttributeType.GRAPH:
                for value in (*attribute.value.inputs, *attribute.value.initializers.values()):
                    claim(value)
        for value in node.outputs:
            claim(value)
    return len(renamed)
