"""What each node of the forget-gate path costs onnxruntime on its own, at a decode step's shapes.

    python bench/op_costs.py [--heads 8] [--window 193] [--buffer 512] [--rounds 20]

A decode step runs these ops on tiny tensors (one float per head and position), so their time is each
kernel's fixed work, which differs by kernel far more than node counts suggest. Each op runs alone in a
one-node session with the same inputs every call; each figure is its fastest of `--rounds` interleaved
rounds of 500 calls (the machine's noise only ever adds time), less the same for a Neg of one float per
head, the cost of a call itself. Used to choose between equivalent forms of the graph (see
exporters/graph/passes/lean_gates.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from exporters.graph.passes.in_place_scatter import scatter_in_place

CALLS = 500
HEAD_SIZE = 64  # fox-small's (hidden 512 over 8 heads)
FLOAT = TensorProto.FLOAT


def one_node_model(op: str, inputs: dict[str, np.ndarray], constants: dict[str, np.ndarray], order: str,
                   outputs: list[str], **attributes) -> bytes:  # fmt: skip
    """A graph of `op` alone over `inputs` (fed) and `constants` (initializers), in that order or in the
    `order` their one-letter names spell (`_`: an input left out)."""
    names = [name.strip("_") for name in order] or [*inputs, *constants]
    domain = "com.microsoft" if op == "GroupQueryAttention" else ""
    node = helper.make_node(op, names, outputs, domain=domain, **attributes)
    graph = helper.make_graph(
        [node], op,
        [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
         for name, a in inputs.items()],
        [helper.make_tensor_value_info(name, FLOAT, None) for name in outputs],
        [numpy_helper.from_array(array, name) for name, array in constants.items()],
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9).SerializeToString()


def open_session(model: bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count()
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def bound_call(each: ort.InferenceSession, inputs: dict[str, np.ndarray], outputs: dict[str, str | None]):
    """One call of the session through IOBinding, as the runtime calls: every input bound once (the arrays
    themselves), each output to the input buffer `outputs` names for it, written in place, or for None to
    a tensor onnxruntime allocates."""
    binding = each.io_binding()
    values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in inputs.items()}
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    for name, buffer in outputs.items():
        if buffer is None:
            binding.bind_output(name)
        else:
            binding.bind_ortvalue_output(name, values[buffer])
    return lambda kept=values: each.run_with_iobinding(binding)  # kept: the arrays bound live as long as the call


def session(op: str, inputs: dict[str, np.ndarray], constants: dict[str, np.ndarray], order: str = "", **attributes):
    """One call of a one-node session of `op`, its output allocated by onnxruntime."""
    model = one_node_model(op, inputs, constants, order, ["out"], **attributes)
    return bound_call(open_session(model), inputs, {"out": None})


def attention(heads: int, window: int, buffer: int, bias: np.ndarray | None):
    """One decode call of GroupQueryAttention as the runtime makes it: the new key and value written into
    cache buffers bound as both past and present, `window` positions attended, with or without `bias`."""
    rng = np.random.default_rng(1)
    fed = {name: rng.standard_normal((1, 1, heads * HEAD_SIZE)).astype(np.float32) for name in "qkv"}
    fed |= {name: rng.standard_normal((1, heads, buffer, HEAD_SIZE)).astype(np.float32) for name in "pP"}
    fed |= {"s": np.array([window - 1], np.int32), "t": np.array([window], np.int32)}
    fed |= {} if bias is None else {"b": bias}
    order = "qkvpPst" + ("" if bias is None else "___b")
    model = one_node_model("GroupQueryAttention", fed, {}, order, ["out", "key", "value"], num_heads=heads,
                           kv_num_heads=heads)  # fmt: skip
    return bound_call(open_session(model), fed, {"out": None, "key": "p", "value": "P"})


def gate_write(gates: np.ndarray, new: np.ndarray, slot: int, in_place: bool):
    """One layer's gate write as a decode step makes it, into a buffer bound as both past and present: the Pad
    (by nothing) and ScatterElements torch.onnx lowers it to, or the If that `scatter_in_place` makes of them
    (with the test of its pads, which a graph computes once for every layer)."""
    fed = {
        "past": gates.copy(),
        "new": new,
        "slot": np.full(new.shape, slot),
        "pads": np.zeros(2 * gates.ndim, np.int64),
    }
    values = [ir.Value(name=n, shape=ir.Shape(a.shape), type=ir.TensorType(ir.DataType.from_numpy(a.dtype)))
              for n, a in fed.items()]  # fmt: skip
    pad = ir.node("Pad", [values[0], values[3]], name="pad")
    scatter = ir.node("ScatterElements", [pad.outputs[0], values[2], values[1]], {"axis": -1}, name="scatter")
    scatter.outputs[0].name, scatter.outputs[0].dtype = "present", ir.DataType.FLOAT
    graph = ir.Graph(values, [scatter.outputs[0]], nodes=[pad, scatter], opset_imports={"": 18}, name="gate_write")
    if in_place:
        scatter_in_place(graph)
    model = ir.serde.serialize_model(ir.Model(graph, ir_version=9)).SerializeToString()
    return bound_call(open_session(model), fed, {"present": "past"})


def cases(heads: int, window: int, buffer: int) -> dict:
    rng = np.random.default_rng(0)
    row = rng.standard_normal((1, heads, 1, window)).astype(np.float32)
    gates = -rng.random((1, heads, buffer)).astype(np.float32)
    new = rng.standard_normal((1, heads, 1)).astype(np.float32)
    allowed = np.ones((1, 1, 1, window), bool)
    lowest = np.array(np.finfo(np.float32).min, np.float32)
    last, ints = np.array(-1), lambda *values: np.array(values, np.int64)
    return {
        "Neg (one float a head)": session("Neg", {"x": new}, {}),
        "Softplus": session("Softplus", {"x": new}, {}),
        "Transpose [1, 1, heads]": session("Transpose", {"x": new.reshape(1, 1, heads)}, {}, perm=[0, 2, 1]),
        "Pad (by 0) of the gate buffer": session("Pad", {"x": gates}, {"pads": ints(0, 0, 0, 0, 0, 0)}),
        "ScatterElements of one position": session(
            "ScatterElements", {"x": gates, "u": new}, {"i": np.full((1, heads, 1), window - 1)}, "xiu", axis=-1
        ),
        "gate write, bound buffer: Pad + ScatterElements": gate_write(gates, new, window - 1, in_place=False),
        "gate write, bound buffer: If (scatter_in_place)": gate_write(gates, new, window - 1, in_place=True),
        "Slice of the window": session("Slice", {"x": gates}, {"s": ints(0), "e": ints(window), "a": ints(2)}),
        "Gather of the window, 2-D index": session("Gather", {"x": gates}, {"i": np.arange(window)[None]}, axis=2),
        "Unsqueeze": session("Unsqueeze", {"x": row.reshape(1, heads, window)}, {"a": ints(2)}),
        "CumSum, reverse exclusive": session("CumSum", {"x": row}, {"a": last}, exclusive=1, reverse=1),
        "Where, broadcast mask": session("Where", {"m": allowed, "x": row}, {"v": lowest}, "mxv"),
        "Add, broadcast mask": session("Add", {"x": row, "m": np.zeros_like(allowed, np.float32)}, {}),
        "GroupQueryAttention, in place, no bias": attention(heads, window, buffer, None),
        "GroupQueryAttention, in place, with the bias": attention(heads, window, buffer, row),
    }


def fastest_calls_us(calls: dict, rounds: int) -> dict[str, float]:
    """Each case's fastest round of CALLS calls, in µs a call; the rounds are interleaved, so every op
    meets the machine's quiet moments as often as the others."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, call in calls.items():
            for _ in range(20):
                call()
            began = time.perf_counter()
            for _ in range(CALLS):
                call()
            best[name] = min(best[name], (time.perf_counter() - began) / CALLS * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--window", type=int, default=193, help="filled positions attended (prompt 128 + 65)")
    parser.add_argument("--buffer", type=int, default=512, help="slots of the in-place gate buffer")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    timed = fastest_calls_us(cases(args.heads, args.window, args.buffer), args.rounds)
    call = timed["Neg (one float a head)"]
    print(f"onnxruntime {ort.__version__}, {os.cpu_count()} threads, {args.heads} heads, window {args.window}, "
          f"buffer {args.buffer}; a call itself: {call:.1f} µs")  # fmt: skip
    print("| op | µs above a call |\n|---|---:|")
    for name, us in timed.items():
        print(f"| {name} | {us - call:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
