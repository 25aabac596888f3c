"""The fused FoX operator against onnxruntime's GroupQueryAttention on their own, at a prompt chunk's and a decode
step's shapes, in GFLOPS of the attention's two matrix products (the keys each query sees, times 4 head_dim).

    python bench/fused_kernel.py [--heads 12] [--head-dim 64] [--threads 2] [--rounds 7]

Each op runs alone in a one-node session over the same inputs every call, bound once (the caches in place, as the
runtime binds them). GroupQueryAttention is handed its bias ready-made, so its figure leaves out the gate sums and
the bias the fused operator computes itself. Rounds are interleaved; each figure is the median round's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper
from report import record

from exporters.native.library import build
from runtime.contract import OP_DOMAIN, OP_INPUTS, OP_NAME, OP_OUTPUTS, OP_VERSION

BEGIN, END = "<!-- kernel:begin -->", "<!-- kernel:end -->"
CASES = {"prompt chunk 256 after 3,840": (256, 4096), "prompt chunk 256 after 15,872": (256, 16384),
         "decode step, 4,096 slots": (1, 4096), "decode step, 16,384 slots": (1, 16384)}  # fmt: skip


def _model(op: str, domain: str, names: list[str], inputs: dict[str, np.ndarray], outputs: list[str],
           **attributes) -> bytes:  # fmt: skip
    """A graph of `op` alone, its inputs `names` ("": left out), of which `inputs` are fed."""
    types = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.bool_): TensorProto.BOOL,
             np.dtype(np.int64): TensorProto.INT64, np.dtype(np.int32): TensorProto.INT32}  # fmt: skip
    node = helper.make_node(op, names, outputs, domain=domain, **attributes)
    graph = helper.make_graph(
        [node], op, [helper.make_tensor_value_info(n, types[a.dtype], a.shape) for n, a in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid(domain, 1 if domain == "com.microsoft" else OP_VERSION)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString()


def _bound(model: bytes, inputs: dict[str, np.ndarray], in_place: dict[str, str], threads: int, library=None):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if library is not None:
        options.register_custom_ops_library(str(library))
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in inputs.items()}
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    for output in session.get_outputs():
        source = next((past for past, present in in_place.items() if present == output.name), None)
        if source is None:
            binding.bind_output(output.name)
        else:
            binding.bind_ortvalue_output(output.name, values[source])
    return lambda: session.run_with_iobinding(binding)


def sessions(seq: int, window: int, heads: int, dim: int, threads: int, library) -> dict:
    rng = np.random.default_rng(0)
    start = window - seq
    q = rng.standard_normal((1, seq, heads * dim), dtype=np.float32)
    k = rng.standard_normal((1, seq, heads * dim), dtype=np.float32)
    v = rng.standard_normal((1, seq, heads * dim), dtype=np.float32)
    past_key = rng.standard_normal((1, heads, window, dim), dtype=np.float32)
    past_value = rng.standard_normal((1, heads, window, dim), dtype=np.float32)
    gates = -rng.random((1, heads, window), dtype=np.float32) * 0.01
    fused = {"query": q, "key": k, "value": v, "gate_logits": rng.normal(4.0, 1.0, (1, seq, heads)).astype(np.float32),
             "past_key": past_key, "past_value": past_value.copy(), "past_gate": gates.copy(),
             "attention_mask": np.ones((1, window), np.int64),
             "cache_position": np.arange(start, window, dtype=np.int64)}  # fmt: skip
    outputs = list(OP_OUTPUTS[: OP_OUTPUTS.index("present_gate") + 1])
    names = [name if name in fused else "" for name in OP_INPUTS[: OP_INPUTS.index("cache_position") + 1]]
    run_fused = _bound(
        _model(OP_NAME, OP_DOMAIN, names, fused, outputs, num_heads=heads, kv_num_heads=heads), fused,
        dict(zip(["past_key", "past_value", "past_gate"], outputs[1:], strict=True)), threads, library,
    )  # fmt: skip
    bias = np.zeros((1, heads, seq, window), dtype=np.float32)
    gqa = {"query": q, "key": k, "value": v, "past_key": past_key.copy(), "past_value": past_value.copy(),
           "seqlens_k": np.array([window - 1], np.int32), "total_sequence_length": np.array([window], np.int32),
           "attention_bias": bias}  # fmt: skip
    names = [*list(gqa)[:7], "", "", "", "attention_bias"]  # no rotary, no position ids
    model = _model("GroupQueryAttention", "com.microsoft", names, gqa, ["output", "present_key", "present_value"],
                   num_heads=heads, kv_num_heads=heads)  # fmt: skip
    run_gqa = _bound(model, gqa, {"past_key": "present_key", "past_value": "present_value"}, threads)
    return {"fused": run_fused, "gqa": run_gqa}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    library = build()
    results, rows = {}, []
    for case, (seq, window) in CASES.items():
        runs = sessions(seq, window, args.heads, args.head_dim, args.threads, library)
        calls = max(5, int(2e9 // (4 * seq * window * args.heads * args.head_dim)))  # 2 GFLOP or 5 calls a round
        times = {name: [] for name in runs}
        for _ in range(args.rounds + 1):  # the first round warms up
            for name, run in runs.items():
                begin = time.perf_counter()
                for _ in range(calls):
                    run()
                times[name].append((time.perf_counter() - begin) / calls)
        seen = seq * (window - seq) + seq * (seq + 1) / 2  # keys each query sees, summed
        flops = 4 * seen * args.heads * args.head_dim
        medians = {name: statistics.median(t[1:]) for name, t in times.items()}
        results[case] = {name: {"ms": 1e3 * m, "gflops": flops / m / 1e9} for name, m in medians.items()}
        cells = [f"{1e3 * medians[name]:.2f} ms, {flops / medians[name] / 1e9:.1f}" for name in ("fused", "gqa")]
        rows.append(f"| {case} | {' | '.join(cells)} | {medians['gqa'] / medians['fused']:.2f}x |")
    text = "\n".join([
        BEGIN,
        f"The fused operator and GroupQueryAttention alone, {args.heads} heads of {args.head_dim}, {args.threads} "
        "threads, one row (time a call, GFLOPS of the two products; GroupQueryAttention given its bias ready-made):",
        "",
        "| shape | fused | GroupQueryAttention | fused speed-up |",
        "|---|---|---|---|",
        *rows,
        END,
    ])  # fmt: skip
    record("fused_kernel.json", {"settings": vars(args), "cases": results}, BEGIN, END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
