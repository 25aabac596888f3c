"""Each new token's shift state as an output of a fused FoX-Pro graph, so that a speculative run that keeps only its
first tokens feeds none of them again.

FoX-Pro's token shift mixes each key and value with the token before's projection, and its state,
`present.{i}.key_shift`, is the run's last token's. A speculative run verifies a token and its drafts at once; where
only the first few are chosen, the next run must start from the state after the last of them, which that present
does not hold (the runtime otherwise goes back to the run's start and feeds the chosen tokens again). The fused
operator gives every new token's state (its outputs key_shift_states and value_shift_states, runtime/contract.py's
OP_OUTPUTS): this pass makes
them graph outputs, `shift_states.{i}.key_shift` and `.value_shift` `[batch, seq, kv_heads * head_dim]`, after the
contract's. A consumer that does not fetch them runs the graph as before.
"""

from __future__ import annotations

import onnx_ir as ir

from runtime.contract import (
    BATCH_AXIS,
    OP_DOMAIN,
    OP_NAME,
    OP_OUTPUTS,
    PRESENT_PREFIX,
    SEQ_AXIS,
    SHIFT_FIELDS,
    SHIFT_STATES_TEMPLATE,
)

# The node's output of each shift's state after the run, and of its state after each token
STATES = {OP_OUTPUTS.index(f"present_{f}"): OP_OUTPUTS.index(f"{f}_states") for f in SHIFT_FIELDS}


def expose_shift_states(graph: ir.Graph) -> int:
    """Give every fused attention node with a token shift its per-token state outputs, as graph outputs named after
    its present states; returns how many outputs it added."""
    outputs = {value.name for value in graph.outputs}
    added = []
    for node in list(graph):
        if node.op_type != OP_NAME or node.domain != OP_DOMAIN:
            continue
        names = [value.name for value in node.outputs]
        shifted = [i for i in STATES if i < len(names) and names[i] in outputs]
        if not shifted:
            continue
        wider = ir.node(OP_NAME, list(node.inputs), dict(node.attributes), domain=OP_DOMAIN,
                        num_outputs=len(OP_OUTPUTS), name=node.name)  # fmt: skip
        graph.insert_before(node, wider)
        for old, new in zip(node.outputs, wider.outputs, strict=False):
            name, old.name = old.name, None  # a graph output keeps its contract name
            new.dtype, new.shape = old.dtype, old.shape
            ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
            new.name = name
        for index in shifted:
            present, states = wider.outputs[index], wider.outputs[STATES[index]]
            layer, field = names[index].removeprefix(PRESENT_PREFIX).split(".")
            states.name = SHIFT_STATES_TEMPLATE.format(layer=layer, field=field)
            states.dtype, states.shape = present.dtype, ir.Shape([BATCH_AXIS, SEQ_AXIS, present.shape[1]])
            added.append(states)
        graph.remove(node, safe=True)
    graph.outputs.extend(added)
    return len(added)
