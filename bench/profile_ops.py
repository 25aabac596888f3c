"""`make profile`: where a decode step's time goes, per operator type, from onnxruntime's own profiler.

For each artifact (by default the default export of fox-small and fox-mini, attending through the fused
FoX operator, in fp32 and quantized to int4; `--attention gqa` for GroupQueryAttention), the runtime
generates twice with the profiler on (batch 1, a 128-token prompt, `--new-tokens` new ones); the second
generation's decode runs are kept, each node event of the trace is assigned to the session run it falls in,
and each operator type's time and node count per decode step are summed. The graph onnxruntime optimized
and ran is saved too, and its nodes counted. The profiler times every node, which slows a step, so read the
shares rather than the absolute times. Then, at the precisions onnxruntime-genai has (fp32, int4), the
artifact is timed without the profiler against onnxruntime-genai on the same-size LLaMA in interleaved
rounds, a GroupQueryAttention artifact also against a copy of itself without FoX's forget gates
(bench/gate_cost.py): what the gates cost a step (`--no-peers` leaves that out). Writes
results/profile.json and the tables between the profile markers of bench/README.md.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import onnx
import peers
from gate_cost import gate_cost
from report import replace_section
from run import HERE, RESULTS, artifact, machine, precision
from worker import prompts

from runtime.artifact import SessionOptions
from runtime.decode.generator import GenerationConfig, Generator

BEGIN, END = "<!-- profile:begin -->", "<!-- profile:end -->"
TOP_OPS = 14  # op types listed one by one; the rest are summed as "other"


def decode_profile(trace: list[dict], runs_per_generation: int) -> dict:
    """Per op type: nodes and microseconds per decode step of the last generation in the trace."""
    runs = sorted((e["ts"], e["dur"]) for e in trace if e.get("cat") == "Session" and e["name"] == "model_run")
    decode = runs[-runs_per_generation + 1 :]  # the last generation's runs but its prefill
    starts = [start for start, _ in decode]
    time_us, nodes = defaultdict(float), Counter()
    for event in trace:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        index = bisect.bisect_right(starts, event["ts"]) - 1
        if index >= 0 and event["ts"] < decode[index][0] + decode[index][1]:
            time_us[event["args"]["op_name"]] += event["dur"]
            nodes[event["args"]["op_name"]] += 1
    steps = len(decode)
    step_us = sum(duration for _, duration in decode) / steps
    return {
        "decode_steps": steps,
        "step_us": step_us,
        "in_kernels_us": sum(time_us.values()) / steps,
        "ops": {
            op: {"nodes": nodes[op] / steps, "us": time_us[op] / steps}
            for op in sorted(time_us, key=time_us.get, reverse=True)
        },
    }


def profile(folder: str, new_tokens: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        options = SessionOptions(
            provider="cpu", intra_op_threads=threads, optimized_model_path=Path(scratch) / "optimized.onnx",
            profile_prefix=str(Path(scratch) / "trace"),
        )  # fmt: skip
        generator = Generator.open(folder, options)
        config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        for _ in range(2):  # the first generation warms up
            generator.generate(prompts(generator.model.artifact.vocab_size, 1, 128), config)
        trace = json.loads(Path(generator.model.artifact.session.end_profiling()).read_text())
        optimized = Counter(node.op_type for node in onnx.load(options.optimized_model_path).graph.node)
    exported = Counter(node.op_type for node in onnx.load(str(Path(folder) / "model.onnx")).graph.node)
    return {
        "artifact": Path(folder).name,
        "exported_nodes": sum(exported.values()),
        "optimized_nodes": sum(optimized.values()),
        "optimized_ops": dict(optimized.most_common()),
        **decode_profile(trace, new_tokens),
    }


def gate_line(cost: dict) -> str:
    speed, ratio = cost["decode_tokens_per_s"], cost["vs_genai"]
    line = (
        f"Without the profiler, median of {cost['rounds']} interleaved rounds: {speed['artifact']:.0f} tokens/s, "
        f"{ratio['artifact']:.2f}x onnxruntime-genai's {speed['genai']:.0f} on the same-size LLaMA"
    )
    if "without gates" not in speed:
        return f"{line}."
    return (
        f"{line}; the same graph without its forget gates ({cost['nodes_without_gates']} nodes; timing only) "
        f"{speed['without gates']:.0f}, {ratio['without gates']:.2f}x."
    )


def table(result: dict) -> str:
    step, ops = result["step_us"], result["ops"]
    lines = [
        f"**{result['artifact']}**: {result['exported_nodes']} nodes exported, {result['optimized_nodes']} after "
        f"onnxruntime's optimizer; a decode step runs {sum(o['nodes'] for o in ops.values()):.0f} nodes in "
        f"{step:.0f} µs, {result['in_kernels_us'] / step:.0%} of it inside kernels "
        f"(mean of {result['decode_steps']} steps, profiler on).",
        "",
        "| op type | nodes per step | µs per step | share of step |",
        "|---|---:|---:|---:|",
    ]
    listed = list(ops.items())[:TOP_OPS]
    rest = list(ops.values())[TOP_OPS:]
    if rest:
        listed.append(("other", {"nodes": sum(o["nodes"] for o in rest), "us": sum(o["us"] for o in rest)}))
    for op, figures in listed:
        lines.append(f"| {op} | {figures['nodes']:.0f} | {figures['us']:.1f} | {figures['us'] / step:.1%} |")
    if "gate_cost" in result:
        lines += ["", gate_line(result["gate_cost"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["fox-small", "fox-mini"])
    parser.add_argument(
        "--quantize", nargs="+", default=["fp32", "int4"], help="fp32, int8, int4, int4-sym or int4-hqq"
    )
    parser.add_argument("--attention", choices=("fused", "gqa"), default="fused", help="the artifacts' attention")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds timing the forget gates' cost")
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="leave out the forget gates' cost")
    args = parser.parse_args(argv)
    threads = os.cpu_count()
    results = []
    for model, weights in [(model, weights) for model in args.models for weights in args.quantize]:
        folder = artifact(model, "dynamic", None, args.attention, None if weights == "fp32" else weights)
        results.append(profile(folder, args.new_tokens, threads))
        print(f"profiled {Path(folder).name}", flush=True)
        genai_precision = precision(weights)
        if args.peers and genai_precision in peers.GENAI_PRECISIONS and "hqq" not in weights:
            genai = peers.genai_model(model, genai_precision, threads)
            cost = gate_cost(folder, str(genai), str(peers.genai_python()), threads, args.rounds, 128)
            results[-1]["gate_cost"] = cost | {"rounds": args.rounds}
            print(gate_line(results[-1]["gate_cost"]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    report = {"machine": machine(), "settings": {**vars(args), "threads": threads}, "profiles": results}
    (RESULTS / "profile.json").write_text(json.dumps(report, indent=2) + "\n")
    text = "\n".join(
        [
            BEGIN,
            f"Run {report['machine']['date']} ({threads} threads), batch 1, prompt 128, {args.new_tokens} new tokens.",
            "",
            "\n\n".join(table(result) for result in results),
            END,
        ]
    )
    replace_section(HERE / "README.md", BEGIN, END, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
