"""Cache buffers of every element type the contract uses, bf16 included: numpy has no bf16, so a bf16 buffer
is held on the host as its raw 16 bits (uint16) and handed to onnxruntime with the ONNX type named."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import onnxruntime as ort

BFLOAT16 = 16  # onnx.TensorProto.BFLOAT16 (the runtime does not import onnx)
HOST_TYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int64": np.int64}


def element_type(dtype: str):
    """What OrtValue and IOBinding take for a contract dtype: a numpy type, or bf16's ONNX type number."""
    return BFLOAT16 if dtype == "bfloat16" else HOST_TYPES[dtype]


def item_size(dtype: str) -> int:
    return np.dtype(HOST_TYPES[dtype]).itemsize


def from_host(array: np.ndarray, dtype: str, device: str) -> ort.OrtValue:
    """A new buffer on `device` holding `array` (for bf16, its raw bits)."""
    if dtype != "bfloat16":
        return ort.OrtValue.ortvalue_from_numpy(array, device, 0)
    value = ort.OrtValue.ortvalue_from_shape_and_type(array.shape, BFLOAT16, device, 0)
    value.update_inplace(ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array, BFLOAT16))
    return value


def zeros(shape: list[int], dtype: str, device: str, touched: bool = False) -> ort.OrtValue:
    """`touched`: on the CPU, every page written now rather than at its first use. numpy asks the kernel for 2 MB
    pages for large arrays, each zeroed when first touched, and one write into a head's slots touches its whole page:
    a prompt's first chunk into a fresh row of a 4,608-slot fox-small artifact took 200-240 ms instead of 22-28."""
    host = np.full(shape, 0, HOST_TYPES[dtype]) if touched and device == "cpu" else np.zeros(shape, HOST_TYPES[dtype])
    return from_host(host, dtype, device)


def zeros_of(spec: dict, sizes: dict[str, int], device: str, touched: bool = False) -> ort.OrtValue:
    """A zeroed buffer for a cache tensor the manifest describes (`spec`: its dtype and axes), its named axes sized by
    `sizes` (a number in the axes is a size already)."""
    return zeros([sizes.get(axis, axis) for axis in spec["axes"]], spec["dtype"], device, touched)


def to_host(value: ort.OrtValue, dtype: str) -> np.ndarray:
    """The buffer's contents on the host: on the CPU a float buffer is viewed in place, otherwise copied (see
    `write_back`)."""
    if dtype != "bfloat16":
        return value.numpy()
    host = np.empty(value.shape(), np.uint16)
    ort.OrtValue.ortvalue_from_numpy_with_onnx_type(host, BFLOAT16).update_inplace(value)
    return host


def overwrite(value: ort.OrtValue, host: np.ndarray, dtype: str) -> None:
    """Copy `host` (as `to_host` gives it) into `value`, which stays where it is: its bindings hold."""
    raw = dtype == "bfloat16"
    value.update_inplace(ort.OrtValue.ortvalue_from_numpy_with_onnx_type(host, BFLOAT16) if raw else host)


def write_back(value: ort.OrtValue, host: np.ndarray, dtype: str, device: str) -> None:
    """Put `host`, changed after `to_host`, back into `value`, unless it is a view of it already."""
    if dtype == "bfloat16" or device != "cpu":
        overwrite(value, host, dtype)


@contextmanager
def on_host(value: ort.OrtValue, dtype: str, device: str) -> Iterator[np.ndarray]:
    """The buffer's contents to change on the host, put back at the end (off the CPU, or in bf16, a copy each
    way: change all that is to change in one visit)."""
    host = to_host(value, dtype)
    yield host
    write_back(value, host, dtype, device)


def move_slots(
    host: np.ndarray, selected, begin: int, end: int, to: int, heads=slice(None), clear: bool = False
) -> None:
    """Move slots [begin, end) of the rows `selected` (an index of the leading axis) and `heads` (of the second) of a
    buffer on the host (see `on_host`) to start at slot `to`; the slots are the third axis (keys, values `[batch,
    heads, slots, dim]`, gates `[batch, heads, slots]`). `clear`: zero the slots after the moved ones, up to `end`,
    that the move left behind."""
    slot_bytes, moved_end = host.strides[2], to + end - begin
    for row in np.atleast_1d(np.arange(host.shape[0])[selected]):
        for head in np.atleast_1d(np.arange(host.shape[1])[heads]):
            start = host[row, head].ctypes.data  # one (row, head)'s slots are contiguous: memmove them, overlap
            # or not, where numpy would copy overlapping slices through a temporary (about 3x slower on a long window)
            ctypes.memmove(start + to * slot_bytes, start + begin * slot_bytes, (end - begin) * slot_bytes)
            if clear and moved_end < end:
                ctypes.memset(start + moved_end * slot_bytes, 0, (end - moved_end) * slot_bytes)


def bind_rows(
    bind, name: str, value: ort.OrtValue, dtype: str, device: str, first: int, count: int, folded: bool = False
) -> None:  # fmt: skip
    """Bind rows [first, first + count) of `value` (batch its leading axis) as input or output `name` of a
    binding (`bind`: its bind_input or bind_output), by address: a view, nothing copied. `folded`: as the
    same memory with its heads folded into the rows, `[count * heads, 1, ...]`
    (exporters/graph/passes/window_offsets.py)."""
    shape = value.shape()
    row_bytes = int(np.prod(shape[1:])) * item_size(dtype)
    bound = [count * shape[1], 1, *shape[2:]] if folded else [count, *shape[1:]]
    bind(name, device, 0, element_type(dtype), bound, value.data_ptr() + first * row_bytes)
