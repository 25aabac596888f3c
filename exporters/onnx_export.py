"""torch.export of the exportable wrapper, then lowering to ONNX with the contract's names and axes.

Tracing uses non-degenerate example sizes (batch 2, past 3, seq 4) and named `Dim`s with `min=0` for
the past length: size-0/1 examples or automatic dims would specialise the graph.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import torch
from torch.export import Dim, ExportedProgram

from exporters.contract import CacheLayout
from exporters.wrappers import ExportableFox
from kvg_export import FoxForCausalLM

EXAMPLE_BATCH, EXAMPLE_PAST, EXAMPLE_SEQ = 2, 3, 4
DEFAULT_OPSET = 20


def _cache_tensor(model: FoxForCausalLM, field: str, batch: int, length: int) -> torch.Tensor:
    config = model.config
    kv_heads, head_dim = config.kv_heads, config.head_dim
    if field == "gate":
        return torch.randn(batch, config.num_heads, length)
    if field in ("key", "value"):
        return torch.randn(batch, kv_heads, length, head_dim, dtype=model.dtype)
    return torch.randn(batch, kv_heads * head_dim, dtype=model.dtype)


def example_inputs(model: FoxForCausalLM, layout: CacheLayout, max_cache_len: int | None = None) -> tuple:
    """Inputs in the wrapper's order; a static cache is `max_cache_len` long, a dynamic one EXAMPLE_PAST."""
    batch, seq = EXAMPLE_BATCH, EXAMPLE_SEQ
    length = max_cache_len if layout.static else EXAMPLE_PAST
    input_ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    if layout.static:
        mask = torch.ones(batch, length, dtype=torch.long)
        head = (input_ids, mask, torch.arange(EXAMPLE_PAST, EXAMPLE_PAST + seq))
    else:
        head = (input_ids, torch.ones(batch, length + seq, dtype=torch.long))
    past = [_cache_tensor(model, f, batch, length) for _ in range(layout.num_layers) for f in layout.fields]
    return (*head, *past)


def dynamic_shapes(layout: CacheLayout, max_batch: int, max_seq: int) -> tuple:
    batch = Dim("batch", min=1, max=max_batch)
    seq = Dim("seq", min=1, max=max_seq)
    """Shapes in the wrapper's signature: input_ids, attention_mask, then one tuple for its `*rest`."""
    if layout.static:
        mask, rest = {0: batch}, [{0: seq}]
        per_field = {f: {0: batch} for f in layout.fields}
    else:
        past = Dim("past", min=0, max=max_seq)
        mask, rest = {0: batch, 1: Dim("total", min=1, max=2 * max_seq)}, []
        per_field = {f: ({0: batch} if f.endswith("shift") else {0: batch, 2: past}) for f in layout.fields}
    rest += [per_field[f] for _ in range(layout.num_layers) for f in layout.fields]
    return ({0: batch, 1: seq}, mask, tuple(rest))


def export_program(
    model: FoxForCausalLM, layout: CacheLayout, max_cache_len: int | None = None, max_batch: int = 256
) -> tuple[ExportedProgram, tuple]:
    """The ExportedProgram of one forward step, and the example inputs it was traced with."""
    if layout.static and not max_cache_len:
        raise ValueError("a static export needs max_cache_len")
    example = example_inputs(model, layout, max_cache_len)
    max_seq = max_cache_len if layout.static else 1 << 16
    shapes = dynamic_shapes(layout, max_batch, max_seq)
    with torch.no_grad():
        program = torch.export.export(ExportableFox(model, layout), example, dynamic_shapes=shapes, strict=False)
    return program, example


def _axis_names(layout: CacheLayout, name: str) -> list[str | None]:
    """Contract names of each axis of a graph input or output; None keeps a fixed size."""
    length = None if layout.static else ("past" if name.startswith("past") else "total")
    if name in ("input_ids", "logits"):
        return ["batch", "seq"] + ([None] if name == "logits" else [])
    if name == "attention_mask":
        return ["batch", None if layout.static else "total"]
    if name == "cache_position":
        return ["seq"]
    if name.endswith("shift"):
        return ["batch", None]
    if name.endswith("gate"):
        return ["batch", None, length]
    return ["batch", None, length, None]


def name_axes(model_proto: onnx.ModelProto, layout: CacheLayout) -> None:
    """Give every dynamic axis of the graph's inputs and outputs its contract name (batch, seq, past, total)."""
    for value in [*model_proto.graph.input, *model_proto.graph.output]:
        dims = value.type.tensor_type.shape.dim
        for dim, axis in zip(dims, _axis_names(layout, value.name), strict=True):
            if axis is not None:
                dim.dim_param = axis


def lower_to_onnx(program: ExportedProgram, example: tuple, layout: CacheLayout, path: Path, opset: int) -> None:
    """Write `path` (model.onnx, weights as external data beside it when large)."""
    onnx_program = torch.onnx.export(
        program,
        example,
        input_names=layout.input_names(),
        output_names=layout.output_names(),
        opset_version=opset,
        dynamo=True,
        optimize=True,
        verbose=False,
    )
    onnx_program.save(str(path), external_data=True)
    graph_only = onnx.load(str(path), load_external_data=False)  # weights stay where they were written
    name_axes(graph_only, layout)
    onnx.save(graph_only, str(path))
