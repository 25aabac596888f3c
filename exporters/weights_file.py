"""Where an artifact keeps its weights: beside the graph, in `model.onnx.data`, at any model size.

Each tensor over a mebibyte starts at a multiple of 64 KiB (Windows' allocation granularity, and a multiple of
every page size), so onnxruntime memory-maps the weights on the CPU instead of reading the file into buffers of
its own: what it uses as stored (the embedding table) stays the file's pages, shared by every process that serves
the artifact, and what it repacks (MatMul weights) is packed from the mapped pages, which it then lets go. The
writer holds a bounded number of bytes at once, so saving a large graph adds little to the exporter's peak.
"""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir

DATA_SUFFIX = ".data"
ALIGNMENT = 1 << 16
IN_FLIGHT_BYTES = 1 << 26


def save(model: ir.Model, path: Path) -> None:
    """Write the graph to `path` and every initializer to `path` + DATA_SUFFIX, aligned for memory-mapping."""
    ir.save(
        model, path, external_data=path.name + DATA_SUFFIX, alignment=ALIGNMENT, max_workers=1,
        max_in_flight_bytes=IN_FLIGHT_BYTES,
    )  # fmt: skip
