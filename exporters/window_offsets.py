"""An optional graph input, `window_offsets`, by which forget-gate pruning shortens each layer's window.

Forget-gate pruning (runtime/pruning.py) drops each layer's oldest cached slots as far as that layer's heads
allow, so the layers' buffers start at different positions. `window_offsets` (int64 `[layers]`) says how many
slots into the attention window (the mask) each layer's buffers start: layer i attends the window without its
first `window_offsets[i]` slots, and writes the new tokens that many slots lower (see
`ForgettingAttention._own_window`). Its default is zeros, every layer at the window's start, so a consumer that
never feeds it runs the graph as the contract describes. Only in-place attention takes it.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from runtime.pruning import WINDOW_OFFSETS as NAME


def default_to_zeros(graph: ir.Graph, layers: int) -> None:
    """Give the traced input its default, in place."""
    offsets = next(value for value in graph.inputs if value.name == NAME)
    offsets.const_value = ir.tensor(np.zeros(layers, dtype=np.int64), name=NAME)
    graph.register_initializer(offsets)
