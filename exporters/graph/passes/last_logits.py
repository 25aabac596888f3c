"""An optional graph input, `logits_to_keep`, that limits the logits to a step's last positions.

A prefill needs the next-token logits of its last position only, yet the contract's `logits` covers every
new position, and the lm_head is a large part of a prefill (fox-small: 16.4M of 43.4M multiply-adds a
token, vocabulary 32,000). `logits_to_keep` (int64 `[1]`) is a graph input with a default of 0, as
transformers' argument of that name: 0 keeps every position, n > 0 the last n, so that a consumer that never
feeds it gets the contract's logits unchanged. The lm_head then reads `hidden[:, -n:]` (a Slice from -n, and
-0 is 0).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from runtime.contract import KEPT_AXIS, LOGITS
from runtime.contract import LOGITS_TO_KEEP as NAME


def keep_last_logits(graph: ir.Graph) -> int:
    """Add the input and slice the lm_head's activations by it, in place (1: the one lm_head)."""
    logits = next(value for value in graph.outputs if value.name == LOGITS)
    head = logits.producer()
    while head.op_type != "MatMul":  # a Cast to float32 may follow the lm_head
        head = head.inputs[0].producer()
    keep = ir.Value(name=NAME, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([1]))
    keep.const_value = ir.tensor(np.zeros(1, dtype=np.int64), name=NAME)
    graph.inputs.append(keep)
    graph.register_initializer(keep)
    start = ir.node("Neg", [keep], name="logits_to_keep.start")
    end = _constant(graph, "logits_to_keep.end", 1 << 62)
    axis = _constant(graph, "logits_to_keep.axis", 1)
    kept = ir.node("Slice", [head.inputs[0], start.outputs[0], end, axis], name="logits_to_keep.slice")
    graph.insert_before(head, [start, kept])
    head.replace_input_with(0, kept.outputs[0])
    logits.shape = ir.Shape([logits.shape[0], KEPT_AXIS, logits.shape[2]])
    return 1


def _constant(graph: ir.Graph, name: str, value: int) -> ir.Value:
    constant = ir.Value(name=name, const_value=ir.tensor(np.array([value], dtype=np.int64), name=name))
    graph.register_initializer(constant)
    return constant
