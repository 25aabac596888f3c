"""The graph passes that follow torch.onnx's lowering, in the order they run: `PASSES`.

Each takes the lowered model and the export's `Choices` and returns how many places it changed (0 where the export
does not call for it); `run` applies them in order and returns those counts by the passes' names, which the export's
`lower` line reports. Each pass's module says what it rewrites and why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx_ir as ir

from exporters.graph.passes.fuse_norms import fusable_head_norms, fuse_residual_norms
from exporters.graph.passes.fuse_projections import fuse_projections
from exporters.graph.passes.in_place_scatter import scatter_in_place
from exporters.graph.passes.last_logits import keep_last_logits
from exporters.graph.passes.lean_gates import lean_gates
from exporters.graph.passes.names import name_by_module, unique_names
from exporters.graph.passes.pack_attention import pack_attention_inputs
from exporters.graph.passes.shift_states import expose_shift_states
from exporters.graph.passes.window_offsets import default_to_zeros, name_present_axes


@dataclass(frozen=True)
class Choices:
    """What of the export the passes depend on."""

    attention: str  # how attention was lowered (exporters/graph/translations.py)
    window_offsets: bool  # whether the graph takes forget-gate pruning's window offsets
    keep_unjoined: Callable[[str], bool] = lambda module: False  # modules whose projections are not joined
    # the each-token shift-state outputs the graph gives (runtime/contract.py's CacheLayout.shift_state_names())
    shift_states: tuple[str, ...] = ()


@dataclass(frozen=True)
class GraphPass:
    name: str  # what its count counts
    run: Callable[[ir.Model, Choices], int]
    report: Callable[[int], str] = lambda count: ""  # its count as the export's log line says it ("": not said)


PASSES = (
    GraphPass("weight readers named by module", lambda model, _: name_by_module(model.graph)),
    GraphPass(
        "projections joined", lambda model, c: fuse_projections(model.graph, lambda node: c.keep_unjoined(node.name)),
        lambda count: f"{count} fewer MatMuls (projections joined)",
    ),
    GraphPass("attention nodes reading a joined projection whole", lambda model, _: pack_attention_inputs(model.graph)),
    GraphPass(
        "residual adds joined with their norms", lambda model, _: fuse_residual_norms(model),
        lambda count: f"{count} residual adds joined with their norms",
    ),
    GraphPass(
        "head norms onnxruntime fuses", lambda model, _: fusable_head_norms(model),
        lambda count: f"{count} head norms fusable by onnxruntime" if count else "",
    ),
    GraphPass(
        "forget-gate nodes taken out", lambda model, _: lean_gates(model),
        lambda count: f"forget-gate rewrites {-count:+d} nodes",
    ),
    GraphPass(
        "gate writes in place", lambda model, _: scatter_in_place(model.graph),
        lambda count: f"{count} gate writes in place in a long enough buffer" if count else "",
    ),
    GraphPass(
        "window offsets given a default", lambda model, c: default_to_zeros(model.graph) if c.window_offsets else 0
    ),
    GraphPass(  # the fused operator reads each head's window without folding heads into rows
        "present axes named for folded heads",
        lambda model, c: name_present_axes(model.graph) if c.window_offsets and c.attention != "fused" else 0,
    ),
    GraphPass(
        "shift-state outputs of each token",
        lambda model, c: expose_shift_states(model.graph, list(c.shift_states)),
    ),
    GraphPass("logits_to_keep inputs", lambda model, _: keep_last_logits(model.graph)),
    GraphPass("values named uniquely", lambda model, _: unique_names(model.graph)),
)  # fmt: skip


def run(model: ir.Model, choices: Choices) -> dict[str, int]:
    """Every pass in order, in place; their counts by name."""
    return {graph_pass.name: graph_pass.run(model, choices) for graph_pass in PASSES}


def summary(counts: dict[str, int]) -> str:
    """What the passes did, as the export's `lower` line says it."""
    return ", ".join(text for graph_pass in PASSES if (text := graph_pass.report(counts[graph_pass.name])))
