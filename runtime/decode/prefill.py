"""Feeding a prompt (gpt-fast's `prefill`): the chunks a prefill runs in, a chunk's inputs bound, and a batch of
prompts fed into a generation's cache.

A chunk's attention terms grow with its length times the slots it attends, so a long prompt is fed in chunks
sized to keep them within PREFILL_WORKING_SET; the Generator and the engine both cut and bind chunks so.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import onnxruntime as ort

from runtime.artifact import Artifact
from runtime.cache.device_cache import DeviceCache
from runtime.contract import ATTENTION_MASK, CACHE_POSITION, INPUT_IDS, LOGITS, LOGITS_TO_KEEP
from runtime.errors import RequestError

PREFILL_WORKING_SET = 256 << 20  # bytes of a prefill run's attention terms (see chunk_size)
KEEP_LAST = ort.OrtValue.ortvalue_from_numpy(np.ones(1, dtype=np.int64))  # logits_to_keep: the last position's


def bind_chunk(
    binding: ort.IOBinding, artifact: Artifact, ids: np.ndarray, mask: np.ndarray, filled: int, device: str,
    last_only: bool,
) -> None:  # fmt: skip
    """Bind a prompt chunk's inputs (ids `[batch, new]` after `filled` slots, `mask` `[batch, filled + new]`, the
    window of slots attended)
    and its logits output, in place of the last run's; `last_only`: its last position's logits alone, where the
    graph can spare the others (exporters/graph/passes/last_logits.py). The cache is the caller's to bind."""
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


class SessionClock:
    """Runs a session on a binding and adds up the seconds spent inside it."""

    def __init__(self, session: ort.InferenceSession):
        self.session, self.seconds = session, 0.0

    def __call__(self, binding: ort.IOBinding) -> None:
        began = time.perf_counter()
        self.session.run_with_iobinding(binding)
        self.seconds += time.perf_counter() - began


def left_padded(prompts: list[list[int]], pad: int, new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompts left-padded into ids `[batch, width]`, and their mask over the prompt and `new_tokens` more
    positions: every new position is attended until its row stops (the caller then masks the rest of it)."""
    width = max(map(len, prompts))
    ids = np.full((len(prompts), width), pad, dtype=np.int64)
    mask = np.ones((len(prompts), width + new_tokens), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, : width - len(prompt)] = prompt, 0
    return ids, mask


def chunking(artifact: Artifact, cache: DeviceCache, width: int, most: int) -> tuple[int, bool]:
    """How prompts `width` long are fed into `cache` while it is empty: the tokens a run takes (at most `most`, see
    `chunk_size`), and whether row by row. GroupQueryAttention takes a later chunk of a prompt for one row only, so
    a gqa artifact feeds a batch row by row (into each row's part of the buffers) when its prompts span several
    chunks; the rows share one window of slots, so such a prefill drops none (pruning starts with the decode) and
    must fit in them."""
    buffer = cache.buffer_length(width)
    size = chunk_size(artifact, cache.batch, buffer, most, window=width)
    over = cache.capacity is not None and width > cache.capacity  # a pruned request's prompt, longer than its slots
    by_row = cache.batch > 1 and (width > size or over) and artifact.attention == "gqa"
    if by_row and over:
        raise RequestError(
            f"a batch of prompts longer than one prefill chunk is prefilled row by row and pruned only after, so its "
            f"{width} positions must fit in the artifact's {cache.capacity} slots; send the prompts one by one, or "
            "re-export with a larger --max-cache-len",
            "prompt",
        )
    return (chunk_size(artifact, 1, buffer, most, window=width) if by_row else size), by_row


def prefill(
    artifact: Artifact, cache: DeviceCache, ids: np.ndarray, most: int, run: Callable[[ort.IOBinding], None],
    every_position: bool = False,
) -> np.ndarray:  # fmt: skip
    """Feed the prompts `ids` `[batch, width]` into the `cache` (started, empty) in chunks of at most `most` tokens,
    or row by row (see `chunking`), so that a run's attention terms and logits never grow with the prompt; returns
    the logits of every position `[batch, width, vocab]`, or of the last `[batch, vocab]`. Decode steps may follow."""
    batch, width = ids.shape
    step, by_row = chunking(artifact, cache, width, most)
    binding = artifact.session.io_binding()
    logits = []
    for row in range(batch) if by_row else [None]:
        part = slice(None) if row is None else slice(row, row + 1)
        pieces, filled, chunk, chunks = [], 0, 0, -(-width // step)  # by row, every chunk is whole
        while filled < width:
            new, slot, window = cache.prepare_chunk(row, (filled, min(filled + step, width)))
            bind_chunk(binding, artifact, ids[part, filled : filled + new], window, slot, cache.device,
                       not every_position)  # fmt: skip
            if row is None:
                cache.bind(binding)
            else:
                cache.bind_row(binding, row, chunk, chunks)
            run(binding)
            outputs = binding.get_outputs()
            if row is None:
                cache.advance(outputs)
            filled, chunk = filled + new, chunk + 1
            if every_position or filled == width:
                pieces.append(outputs[0].numpy())
        logits.append(np.concatenate(pieces, axis=1) if every_position else pieces[-1][:, -1])
    return np.concatenate(logits, axis=0)
