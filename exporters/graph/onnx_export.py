"""torch.export of the exportable wrapper, then lowering to ONNX with the contract's names and axes.

Tracing uses non-degenerate example sizes (batch 2, past 3, seq 4) and named `Dim`s with `min=0` for
the past length: size-0/1 examples or automatic dims would specialise the graph.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import onnx_ir as ir
import torch
from torch.export import Dim, ExportedProgram

from exporters import weights_file
from exporters.graph import passes
from exporters.graph.translations import translations
from exporters.graph.wrappers import ExportableFox
from kvg_export import FoxForCausalLM
from runtime import contract
from runtime.contract import DYNAMIC_MAX_POSITIONS, WINDOW_OFFSETS, CacheLayout, cache_shape

EXAMPLE_BATCH, EXAMPLE_PAST, EXAMPLE_SEQ = 2, 3, 4


def _cache_tensor(model: FoxForCausalLM, field: str, batch: int, length: int) -> torch.Tensor:
    dtype = torch.float32 if field == "gate" else model.dtype
    return torch.randn(cache_shape(model.config, field, batch, length), dtype=dtype)


def example_inputs(model: FoxForCausalLM, layout: CacheLayout, max_cache_len: int | None = None) -> tuple:
    """Inputs in the wrapper's order; a static cache is `max_cache_len` long, a dynamic one EXAMPLE_PAST."""
    batch, seq = EXAMPLE_BATCH, EXAMPLE_SEQ
    length = max_cache_len if layout.static else EXAMPLE_PAST
    input_ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    if layout.static:  # the mask is the attention window: the filled slots and the new ones
        mask = torch.ones(batch, EXAMPLE_PAST + seq, dtype=torch.long)
        head = (input_ids, mask, torch.arange(EXAMPLE_PAST, EXAMPLE_PAST + seq))
    else:
        head = (input_ids, torch.ones(batch, length + seq, dtype=torch.long))
    past = [_cache_tensor(model, f, batch, length) for _ in range(layout.num_layers) for f in layout.fields]
    return (*head, *past)


def dynamic_shapes(layout: CacheLayout, max_batch: int, max_seq: int, window_offsets: bool) -> dict:
    """Shapes by the wrapper's parameters: input_ids, attention_mask, one tuple for its `*rest`, and its
    window_offsets when the graph takes them (one per layer and kv head: a fixed shape)."""
    batch = Dim(contract.BATCH_AXIS, min=1, max=max_batch)
    seq = Dim(contract.SEQ_AXIS, min=1, max=max_seq)
    if layout.static:
        # The window stops one short of the buffer for tracing only: a full-length slice is contiguous and a
        # shorter one is not, and torch.export guards on that. The ONNX graph is the same for every window.
        mask, rest = {0: batch, 1: Dim(contract.WINDOW_AXIS, min=1, max=max_seq - 1)}, [{0: seq}]
        per_field = {f: {0: batch} for f in layout.fields}
    else:
        past = Dim(contract.PAST_AXIS, min=0, max=max_seq)
        mask, rest = {0: batch, 1: Dim(contract.TOTAL_AXIS, min=1, max=2 * max_seq)}, []
        per_field = {f: ({0: batch} if contract.is_shift_state(f) else {0: batch, 2: past}) for f in layout.fields}
    rest += [per_field[f] for _ in range(layout.num_layers) for f in layout.fields]
    shapes = {contract.INPUT_IDS: {0: batch, 1: seq}, contract.ATTENTION_MASK: mask, "rest": tuple(rest)}
    return shapes | ({WINDOW_OFFSETS: None} if window_offsets else {})


def export_program(
    model: FoxForCausalLM,
    layout: CacheLayout,
    max_cache_len: int | None = None,
    max_batch: int = 256,
    in_place_attention: bool | str = False,
    window_offsets: bool = False,
) -> tuple[ExportedProgram, tuple]:
    """The ExportedProgram of one forward step, and the example inputs it was traced with; `window_offsets`: the
    step also takes them, by keyword (in-place attention only; see exporters/graph/passes/window_offsets.py)."""
    if layout.static and not max_cache_len:
        raise ValueError("a static export needs max_cache_len")
    example = example_inputs(model, layout, max_cache_len)
    max_seq = max_cache_len if layout.static else DYNAMIC_MAX_POSITIONS
    shapes = dynamic_shapes(layout, max_batch, max_seq, window_offsets)
    offsets = (
        {WINDOW_OFFSETS: torch.zeros(layout.num_layers, model.config.kv_heads, dtype=torch.long)}
        if window_offsets
        else {}
    )
    with torch.no_grad():
        wrapper = ExportableFox(model, layout, in_place_attention)
        program = torch.export.export(wrapper, example, offsets, dynamic_shapes=shapes, strict=False)
    return program, example


def _axis_names(layout: CacheLayout, name: str) -> list[str | None]:
    """Contract names of each axis of a graph input or output; None keeps a fixed size."""
    length = (
        None
        if layout.static
        else (contract.PAST_AXIS if name.startswith(contract.PAST_PREFIX) else contract.TOTAL_AXIS)
    )
    batch = contract.BATCH_AXIS
    if name in (contract.INPUT_IDS, contract.LOGITS):
        return [batch, contract.SEQ_AXIS] + ([None] if name == contract.LOGITS else [])
    if name == contract.ATTENTION_MASK:
        return [batch, contract.WINDOW_AXIS if layout.static else contract.TOTAL_AXIS]
    if name == contract.CACHE_POSITION:
        return [contract.SEQ_AXIS]
    if name == WINDOW_OFFSETS:
        return [None, None]
    if contract.is_shift_state(name):
        return [batch, None]
    if name.endswith("gate"):
        return [batch, None, length]
    return [batch, None, length, None]


def lower_to_onnx(
    program: ExportedProgram, example: tuple, layout: CacheLayout, path: Path, opset: int, choices: passes.Choices,
) -> dict[str, int]:  # fmt: skip
    """Write `path`: the ONNX graph with contract names and named axes, after the graph passes (exporters/graph/passes),
    its weights beside it (see `weights_file`); returns the passes' counts by name. `choices.attention` also picks
    the lowering of in-place attention (see `translations`), and the graph takes the optional `window_offsets` if
    `choices` says the program does."""
    # Quiet the exporter's notes that concern other libraries (torchvision ops, a pytree deprecation in torch).
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        onnx_program = torch.onnx.export(
            program,
            example,
            input_names=layout.input_names() + ([WINDOW_OFFSETS] if choices.window_offsets else []),
            output_names=layout.output_names(),
            opset_version=opset,
            dynamo=True,
            optimize=True,
            custom_translation_table=translations(choices.attention),
            verbose=False,
        )
    graph = onnx_program.model.graph
    for value in [*graph.inputs, *graph.outputs]:
        axes = _axis_names(layout, value.name)
        value.shape = ir.Shape([name or dim for name, dim in zip(axes, value.shape, strict=True)])
    counts = passes.run(onnx_program.model, choices)
    made, described = [value.name for value in graph.outputs], layout.output_names() + list(choices.shift_states)
    if made != described:  # the manifest lists the layout's outputs (exporters/checks/manifest.py's graph_io)
        raise ValueError(f"the graph's outputs {made} are not the layout's {described}")
    weights_file.save(onnx_program.model, path)
    return counts
