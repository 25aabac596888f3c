"""An optional graph input, `window_offsets`, by which forget-gate pruning shortens each head's window, and the
folded present keys and values that come with it.

Forget-gate pruning (runtime/cache/pruning.py) drops each head's oldest cached slots as far as that head allows, so
the heads' rows of a buffer start at different positions. `window_offsets` (int64 `[layers, kv_heads]`) says how
many slots into the attention window (the mask) each layer's kv head's rows start: head h of layer i attends
the window without its first `window_offsets[i, h]` slots, and writes the new tokens that many slots lower (see
`ForgettingAttention._attend_in_place`). Its default is zeros, every head at the window's start, so a consumer
that never feeds it runs the graph as the contract describes. Only in-place attention takes it. A consumer that
feeds it keeps each head's gate slots past its window at zero: the graph sums a head's gates over the longest
head's window (anything there would shift all of that head's scores alike, exact in arithmetic but not in
float32).

So that the attention reads each head's own slots alone, a layer whose heads' rows are staggered folds the heads
into rows (see `exporters/graph/translations.Folding`), and its present keys and values are then the folded buffers the
op writes, `[batch * kv_heads, 1, length, head_dim]`: the same memory as the past's `[batch, kv_heads, length,
head_dim]`, which a runtime binds as both, in the shape that layer's run gives (ROWS and ROW_HEADS name the two
axes). A layer whose heads start together, as they do at the default, gives the past's shape. A prompt's chunk
runs staggered too (the manifest's `cache.heads_apart_in_chunks`; an artifact exported before that runs a chunk
with each layer's heads together), for one batch row only, as GroupQueryAttention takes a chunk after a
prompt's first.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from runtime.contract import PRESENT_PREFIX, ROW_HEADS_AXIS, ROWS_AXIS, TOTAL_AXIS, past_of
from runtime.contract import WINDOW_OFFSETS as NAME

KEYS = (".key", ".value")  # the cache tensors whose heads fold into rows


def default_to_zeros(graph: ir.Graph) -> int:
    """Give the traced input its default, in place (1: the one input)."""
    offsets = next(value for value in graph.inputs if value.name == NAME)
    offsets.const_value = ir.tensor(np.zeros(offsets.shape.numpy(), dtype=np.int64), name=NAME)
    graph.register_initializer(offsets)
    return 1


def name_present_axes(graph: ir.Graph) -> int:
    """Declare each present key and value `[ROWS, ROW_HEADS, length, head_dim]` (its past's length and head_dim);
    returns how many."""
    pasts = {value.name: value for value in graph.inputs}
    named = [value for value in graph.outputs if value.name.startswith(PRESENT_PREFIX) and value.name.endswith(KEYS)]
    for value in named:
        past = pasts[past_of(value.name)]
        length = TOTAL_AXIS if isinstance(past.shape[2], ir.SymbolicDim) else past.shape[2]
        value.shape = ir.Shape([ROWS_AXIS, ROW_HEADS_AXIS, length, past.shape[3]])
    return len(named)
