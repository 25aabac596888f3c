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

Which of them a graph gives is not decided here: the export's layout names them (runtime/contract.py's
`CacheLayout.each_token`, from `operator_shifts`, which the model also follows), the manifest lists those, and this
pass exposes exactly those or refuses, so the manifest and the graph cannot disagree.
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


def expose_shift_states(graph: ir.Graph, names: list[str]) -> int:
    """Make `names` (SHIFT_STATES_TEMPLATE's, the layout's `shift_state_names()`) graph outputs, each the per-token
    states of the fused attention node whose present state it continues; returns how many outputs it added. Raises
    ValueError naming any it cannot give: a shift the graph does around the operator, not in it."""
    prefix = SHIFT_STATES_TEMPLATE.partition("{")[0]
    wanted = {PRESENT_PREFIX + name.removeprefix(prefix): name for name in names}  # present state -> its each-token
    added = {}
    for node in list(graph):
        if node.op_type != OP_NAME or node.domain != OP_DOMAIN:
            continue
        outputs = [value.name for value in node.outputs]
        shifted = [i for i in STATES if i < len(outputs) and outputs[i] in wanted]
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
            states.name = wanted[present.name]
            states.dtype, states.shape = present.dtype, ir.Shape([BATCH_AXIS, SEQ_AXIS, present.shape[1]])
            added[states.name] = states
        graph.remove(node, safe=True)
    missing = [name for name in names if name not in added]
    if missing:
        raise ValueError(
            f"the layout names shift-state outputs {missing} that no fused attention node gives: the model does "
            "those token shifts around the operator (runtime/contract.py's operator_shifts decides which it does)"
        )
    graph.outputs.extend(added[name] for name in names)  # in the layout's order, as the manifest lists them
    return len(added)
