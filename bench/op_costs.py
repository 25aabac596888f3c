"""What each node of the forget-gate path costs onnxruntime on its own, at a decode step's shapes.

    python bench/op_costs.py [--heads 8] [--window 193] [--buffer 512] [--rounds 20]

A decode step runs these ops on tiny tensors (one float per head and position), so their time is each
kernel's fixed work, which differs by kernel far more than node counts suggest. Each op runs alone in a
one-node session with the same inputs every call; each figure is its fastest of `--rounds` interleaved
rounds of 500 calls (the machine's noise only ever adds time), less the same for a Neg of one float per
head, the cost of a call itself. Used to choose between equivalent forms of the graph (see
exporters/lean_gates.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

CALLS = 500
FLOAT = TensorProto.FLOAT


def session(op: str, inputs: dict[str, np.ndarray], constants: dict[str, np.ndarray], order: str = "", **attributes):
    """A one-node session of `op` over `inputs` (fed) and `constants` (initializers), in that order or in the
    `order` their one-letter names spell."""
    node = helper.make_node(op, list(order) or [*inputs, *constants], ["out"], **attributes)
    graph = helper.make_graph(
        [node], op,
        [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
         for name, a in inputs.items()],
        [helper.make_tensor_value_info("out", FLOAT, None)],
        [numpy_helper.from_array(array, name) for name, array in constants.items()],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count()
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]), inputs


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
        "Slice of the window": session("Slice", {"x": gates}, {"s": ints(0), "e": ints(window), "a": ints(2)}),
        "Gather of the window, 2-D index": session("Gather", {"x": gates}, {"i": np.arange(window)[None]}, axis=2),
        "Unsqueeze": session("Unsqueeze", {"x": row.reshape(1, heads, window)}, {"a": ints(2)}),
        "CumSum, reverse exclusive": session("CumSum", {"x": row}, {"a": last}, exclusive=1, reverse=1),
        "Where, broadcast mask": session("Where", {"m": allowed, "x": row}, {"v": lowest}, "mxv"),
        "Add, broadcast mask": session("Add", {"x": row, "m": np.zeros_like(allowed, np.float32)}, {}),
    }


def fastest_calls_us(sessions: dict, rounds: int) -> dict[str, float]:
    """Each session's fastest round of CALLS calls, in µs a call; the rounds are interleaved, so every op
    meets the machine's quiet moments as often as the others."""
    best = dict.fromkeys(sessions, float("inf"))
    for _ in range(rounds):
        for name, (each, feeds) in sessions.items():
            for _ in range(20):
                each.run(None, feeds)
            began = time.perf_counter()
            for _ in range(CALLS):
                each.run(None, feeds)
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
