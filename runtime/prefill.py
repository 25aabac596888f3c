"""Feeding a prompt: the chunks a prefill runs in, and a chunk's inputs bound.

A chunk's attention terms grow with its length times the slots it attends, so a long prompt is fed in chunks
sized to keep them within PREFILL_WORKING_SET; the Generator and the engine both cut and bind chunks so.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from runtime.artifact import Artifact
from runtime.contract import ATTENTION_MASK, CACHE_POSITION, INPUT_IDS, LOGITS, LOGITS_TO_KEEP

PREFILL_WORKING_SET = 256 << 20  # bytes of a prefill run's attention terms (see chunk_size)
KEEP_LAST = ort.OrtValue.ortvalue_from_numpy(np.ones(1, dtype=np.int64))  # logits_to_keep: the last position's


def bind_chunk(
    binding: ort.IOBinding, artifact: Artifact, ids: np.ndarray, mask: np.ndarray, filled: int, device: str,
    last_only: bool,
) -> None:  # fmt: skip
    """Bind a prompt chunk's inputs (ids `[batch, new]` after `filled` slots, `mask` `[batch, filled + new]`, the
    window of slots attended)
    and its logits output, in place of the last run's; `last_only`: its last position's logits alone, where the
    graph can spare the others (exporters/passes/last_logits.py). The cache is the caller's to bind."""
    binding.clear_binding_inputs()
    binding.clear_binding_outputs()
    binding.bind_cpu_input(INPUT_IDS, np.ascontiguousarray(ids))
    binding.bind_cpu_input(ATTENTION_MASK, np.ascontiguousarray(mask))
    if artifact.static:
        binding.bind_cpu_input(CACHE_POSITION, np.arange(filled, filled + ids.shape[1], dtype=np.int64))
    if last_only and artifact.keeps_logits:
        binding.bind_ortvalue_input(LOGITS_TO_KEEP, KEEP_LAST)
    binding.bind_output(LOGITS, device)


def chunk_size(artifact: Artifact, rows: int, buffer: int, most: int, window: int | None = None) -> int:
    """How many tokens a prefill run takes: at most `most`, and few enough that its attention terms stay within
    PREFILL_WORKING_SET however long the prompt, so a long prompt's peak memory is the weights, the cache and that.

    The terms are float32 `[rows, heads, chunk, slots]` tensors: the scores, which GroupQueryAttention allocates
    over the whole cache buffer (`buffer` slots), and the bias with its masked copy, over the slots a run attends
    (`window`: the buffer where the caller cannot bound it, or where the graph pads the mask to the buffer, as for
    ONNX Attention). A prompt into an empty cache of many more slots thus takes longer chunks than one that
    fills it. The fused operator keeps no such terms (it scores a block of keys at a time): a run holds the
    attention pattern alone, a byte per query and slot attended."""
    if window is None or artifact.attention == "onnx-attention":
        window = buffer
    if artifact.attention == "fused":
        query_bytes = rows * min(window, buffer)
    else:
        query_bytes = 4 * rows * artifact.manifest["model"]["num_heads"] * (buffer + 2 * min(window, buffer))
    return max(1, min(most, PREFILL_WORKING_SET // query_bytes))


def chunk_spans(width: int, size: int) -> list[tuple[int, int]]:
    """The [begin, end) spans of `width` tokens in chunks of `size`."""
    return [(begin, min(begin + size, width)) for begin in range(0, width, size)]
