"""bf16 cache buffers, which numpy has no type for, reach onnxruntime as the values torch means by them."""

import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from runtime.cache import buffers


def cast_to_float(shape):
    """A CPU session reading a bf16 tensor and returning it as float32 (Cast runs in bf16 on the CPU)."""
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)], "cast",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    onnx.checker.check_model(model)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def read(session, value: ort.OrtValue) -> np.ndarray:
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", value)
    binding.bind_output("y")
    session.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0]


def test_a_bf16_buffer_holds_torchs_bf16_values_and_takes_changes_made_on_the_host():
    values = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    bits = values.view(torch.int16).numpy().view(np.uint16)
    value = buffers.from_host(bits, "bfloat16", "cpu")
    session = cast_to_float([2, 3, 5])
    assert value.data_type() == "tensor(bfloat16)"
    np.testing.assert_array_equal(read(session, value), values.float().numpy())
    host = buffers.to_host(value, "bfloat16")
    host[:, :, 1:3] = host[:, :, 0:2]  # as a row move does
    buffers.write_back(value, host, "bfloat16", "cpu")
    moved = values.clone()
    moved[:, :, 1:3] = values[:, :, 0:2]
    np.testing.assert_array_equal(read(session, value), moved.float().numpy())
    np.testing.assert_array_equal(read(session, buffers.zeros([2, 3, 5], "bfloat16", "cpu")), np.zeros((2, 3, 5)))


def test_binding_a_bf16_buffer_by_address_reads_the_rows_asked_for():
    """How the serving engine binds rows [first, first + count) of a cache buffer."""
    values = torch.arange(30, dtype=torch.float32).view(3, 10).to(torch.bfloat16)
    value = buffers.from_host(values.view(torch.int16).numpy().view(np.uint16), "bfloat16", "cpu")
    session = cast_to_float([2, 10])
    binding = session.io_binding()
    row_bytes = 10 * buffers.item_size("bfloat16")
    binding.bind_input("x", "cpu", 0, buffers.element_type("bfloat16"), [2, 10], value.data_ptr() + row_bytes)
    binding.bind_output("y")
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], values[1:].float().numpy())


def test_moving_slots_equals_copying_them_out_first_overlapping_or_not():
    """Compaction moves a window's kept slots down over themselves: the result must be a copy taken before (and,
    asked, zeros where the slots were and are no longer)."""
    rng = np.random.default_rng(0)
    for shape in ([3, 2, 12, 4], [3, 2, 12]):
        for dtype in ("float32", "bfloat16"):
            for rows, heads in ((slice(None), slice(None)), (1, 0), ([0, 2], slice(1, 2))):
                for begin, end, to in ((5, 11, 0), (2, 9, 1), (0, 4, 6), (3, 7, 3)):
                    data = rng.integers(0, 1000, shape).astype(buffers.HOST_TYPES[dtype])
                    value = buffers.from_host(data.copy(), dtype, "cpu")
                    clear = bool(rng.integers(2))
                    with buffers.on_host(value, dtype, "cpu") as host:
                        buffers.move_slots(host, rows, begin, end, to, heads, clear)
                    expected = data.copy()
                    for row in np.atleast_1d(np.arange(shape[0])[rows]):
                        for head in np.atleast_1d(np.arange(shape[1])[heads]):
                            if clear:  # what the move leaves behind up to `end`
                                expected[row, head, to + end - begin : end] = 0
                            expected[row, head, to : to + end - begin] = data[row, head, begin:end]
                    np.testing.assert_array_equal(buffers.to_host(value, dtype), expected)


RESIDENCE_PROBE = """
import os
from runtime.cache import buffers

def resident_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

size = 64 << 20
before = resident_bytes()
untouched = buffers.zeros([size // 4], "float32", "cpu")
grown = resident_bytes() - before
touched = buffers.zeros([size // 4], "float32", "cpu", touched=True)
print(size, grown, resident_bytes() - before - grown)
for value in (touched, untouched):
    assert not buffers.to_host(value, "float32").any()
"""


def test_a_touched_buffer_is_resident_and_zero_from_the_start_and_an_untouched_one_is_not_resident():
    """What RowCache relies on: its rows' pages are faulted in when it is made, not at a request's first write. In a
    process of its own: here, memory an earlier test freed (resident already) may serve the untouched buffer."""
    done = subprocess.run([sys.executable, "-c", RESIDENCE_PROBE], capture_output=True, text=True, check=True)
    size, untouched, touched = map(int, done.stdout.split())
    assert touched > 0.9 * size
    assert untouched < 0.1 * size
