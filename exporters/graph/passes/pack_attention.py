"""A fused attention node reads its layer's joined projection itself: the Split that cut it into the query, key,
value, forget-gate and FoX-Pro logits goes, and the Add of the forget gate's bias becomes the node's gate_bias.

`fuse_projections` joins a layer's projections into one MatMul and a Split. onnxruntime runs each Split and Add as
a node of its own, with its own dispatch and output buffer, where the fused operator can read its inputs' columns
of the joined output directly (its `packed_offsets`, exporters/native/fox_attention.cc). The rewrite is exact, and
export validation checks the graph against eager PyTorch as it checks any other.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from runtime.contract import OP_DOMAIN, OP_INPUTS, OP_NAME, OP_PACKED_INPUTS

PACKED_INPUTS = tuple(OP_INPUTS.index(name) for name in OP_PACKED_INPUTS)  # the node's inputs packed_offsets places
GATE_LOGITS, GATE_BIAS = OP_INPUTS.index("gate_logits"), OP_INPUTS.index("gate_bias")


def _split_widths(split: ir.Node) -> np.ndarray | None:
    """The widths a Split along the last axis cuts, where they are a constant."""
    shape = split.inputs[0].shape
    axis = split.attributes.get_int("axis", 0)
    sizes = split.inputs[1] if len(split.inputs) > 1 else None
    if (axis != -1 and (shape is None or axis != len(shape) - 1)) or sizes is None or sizes.const_value is None:
        return None
    return sizes.const_value.numpy()


def _unbiased(value: ir.Value, heads: int) -> tuple[ir.Value, ir.Value, ir.Node] | None:
    """Where `value` is read once and is an Add of a constant `[heads]` bias: the other operand, the bias, the Add."""
    add = value.producer()
    if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(value.uses()) != 1:
        return None
    for part, bias in (add.inputs, add.inputs[::-1]):
        if bias is not None and bias.const_value is not None and tuple(bias.const_value.shape) == (heads,):
            return part, bias, add
    return None


def _packing(node: ir.Node, split: ir.Node, widths: np.ndarray) -> tuple[list[int], ir.Value | None, list] | None:
    """The node's packed_offsets, its gate bias and the nodes that go, where it reads every part of `split` once
    (the forget gate's perhaps through its bias Add) and nothing else from it; else None."""
    offsets = dict(zip(split.outputs, np.concatenate([[0], np.cumsum(widths)[:-1]]).tolist(), strict=True))
    packed, bias, gone = [-1] * len(PACKED_INPUTS), None, [split]
    for index in PACKED_INPUTS:
        part = node.inputs[index] if index < len(node.inputs) else None
        if part is None:
            continue
        if index == GATE_LOGITS and part not in offsets and node.inputs[GATE_BIAS] is None:
            found = _unbiased(part, node.attributes.get_int("num_heads"))
            if found is not None:
                part, bias, add = found
                gone.insert(0, add)
        if part not in offsets or len(part.uses()) != 1:
            return None
        packed[PACKED_INPUTS.index(index)] = offsets.pop(part)
    return (packed, bias, gone) if not offsets else None


def pack_attention_inputs(graph: ir.Graph) -> int:
    """Give every fused attention node whose inputs are the parts of one Split that Split's input, with each part's
    column offset, in place of the parts; returns how many nodes now read a joined projection whole."""
    packed_nodes = 0
    for node in list(graph):
        if node.op_type != OP_NAME or node.domain != OP_DOMAIN or node.inputs[0] is None:
            continue
        split = node.inputs[0].producer()
        if split is None or split.op_type != "Split" or split.domain not in ("", "ai.onnx"):
            continue
        widths = _split_widths(split)
        packing = None if widths is None else _packing(node, split, widths)
        if packing is None:
            continue
        packed, bias, gone = packing
        joined = split.inputs[0]
        for index in PACKED_INPUTS[1:]:
            if index < len(node.inputs):
                node.replace_input_with(index, None)
        node.replace_input_with(0, joined)
        if bias is not None:
            node.replace_input_with(GATE_BIAS, bias)
        node.attributes["packed_offsets"] = ir.AttrInt64s("packed_offsets", packed)
        graph.remove(gone, safe=True)
        packed_nodes += 1
    return packed_nodes
