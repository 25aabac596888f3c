"""A decode step's graph alone, without the loop around it: artifacts (and onnxruntime-genai's model) side by side.

    python bench/graph_time.py FOLDER [...] [--genai fox-small:int4] [--without-gates] [--filled 192] [--buffer 256]

bench/compare.py times whole generations, the Python loop included; this times onnxruntime's
`run_with_iobinding` of one decode step, again and again, at one filled length: one new token after
`--filled` positions, every cache buffer `--buffer` slots long and bound as both past and present, as the
runtime and onnxruntime-genai bind them. Each graph runs alone in a process of its own, the processes taking
turns over `--rounds` rounds (two sessions in one process slowed whichever ran second: on this 2-core
machine their thread pools spin against each other); each figure is the median over the rounds of a round's
median block, with the ratio to the first graph taken round by round. `--without-gates` adds each folder's
copy without forget gates (bench/gate_cost.py; timing only, its logits are wrong).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import peers
from compare import graph_options, optimized_nodes, ratio_table
from gate_cost import without_forget_gates
from op_costs import bound_call

CALLS, BLOCKS = 40, 5  # a process times BLOCKS blocks of CALLS steps after one block of warm-up


def bound_step(model: Path, filled: int, buffer: int, threads: int) -> tuple[Callable[[], None], dict]:
    """One decode step of the graph in `model`, ready to run, and its cache buffers by input name (numpy
    arrays the step writes in place). Past axes: the batch is 1, the sequence axis (2) `buffer` unless the
    graph fixes it (a static artifact), any other named axis the head size from genai_config.json."""
    options = graph_options(model.parent)
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    config = model.parent / "genai_config.json"
    head_size = json.loads(config.read_text())["model"]["decoder"]["head_size"] if config.is_file() else None
    rng = np.random.default_rng(0)
    buffers, outputs = {}, {"logits": None}
    for spec in session.get_inputs():
        if spec.name.startswith("past_key_values."):
            shape = [size if isinstance(size, int) else 1 if axis == 0 else buffer if axis == 2 else head_size
                     for axis, size in enumerate(spec.shape)]  # fmt: skip
            data = rng.standard_normal(shape).astype(np.float32)
            buffers[spec.name] = -0.01 * np.abs(data) if spec.name.endswith(".gate") else data  # log gates are < 0
            outputs[spec.name.replace("past_key_values.", "present.", 1)] = spec.name
    inputs = {**buffers, "input_ids": np.array([[5]], np.int64), "attention_mask": np.ones((1, filled + 1), np.int64)}
    if "cache_position" in {spec.name for spec in session.get_inputs()}:
        inputs["cache_position"] = np.array([filled], np.int64)
    return bound_call(session, inputs, outputs), buffers


def step_us(model: Path, filled: int, buffer: int, threads: int) -> float:
    """The median over BLOCKS blocks of a step's mean time in the block, in µs."""
    step, _ = bound_step(model, filled, buffer, threads)
    blocks = []
    for _ in range(BLOCKS + 1):
        began = time.perf_counter()
        for _ in range(CALLS):
            step()
        blocks.append((time.perf_counter() - began) / CALLS * 1e6)
    return statistics.median(blocks[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="*", help="artifact folders; time ratios are to the first")
    parser.add_argument("--genai", metavar="MODEL:PRECISION", help="add onnxruntime-genai's model, e.g. fox-small:int4")
    parser.add_argument("--without-gates", action="store_true", help="add each folder's copy without forget gates")
    parser.add_argument("--filled", type=int, default=192, help="positions already cached (prompt 128 + 64)")
    parser.add_argument("--buffer", type=int, default=256, help="slots of each cache buffer")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # a worker process: time this model alone
    args = parser.parse_args(argv)
    if args.one:
        print(step_us(args.one, args.filled, args.buffer, args.threads))
        return 0
    if not args.folders:
        parser.error("give at least one artifact folder")
    with tempfile.TemporaryDirectory() as scratch:
        graphs = {folder: Path(folder) / "model.onnx" for folder in args.folders}
        if args.without_gates:
            for folder in args.folders:
                bare = Path(scratch) / f"{len(graphs)}"
                try:
                    without_forget_gates(Path(folder), bare)
                except ValueError as error:  # a fused artifact
                    parser.error(f"--without-gates: {error}")
                graphs[f"{folder} without gates"] = bare / "model.onnx"
        if args.genai:
            model, precision = args.genai.split(":")
            graphs[f"genai {args.genai}"] = peers.genai_model(model, precision, args.threads) / "model.onnx"
        settings = ["--filled", str(args.filled), "--buffer", str(args.buffer), "--threads", str(args.threads)]
        times: dict[str, list[float]] = {name: [] for name in graphs}
        for _ in range(args.rounds):
            for name, graph in graphs.items():
                worker = [sys.executable, __file__, "--one", str(graph), *settings]
                times[name].append(float(subprocess.run(worker, check=True, capture_output=True, text=True).stdout))
        nodes = {name: optimized_nodes(str(graph.parent)) for name, graph in graphs.items()}
    print(f"median of {args.rounds} rounds, batch 1, {args.threads} threads, one token after {args.filled} "
          f"positions in buffers of {args.buffer}")  # fmt: skip
    print(ratio_table(("graph", "µs a step", "time vs first"), times, nodes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
