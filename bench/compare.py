"""Before and after: the decode speed of artifact folders side by side, in one interleaved run.

    python bench/compare.py BEFORE AFTER [...] [--genai fox-small:int4] [--rounds 15]
    python bench/compare.py ARTIFACT ARTIFACT --checkouts OLD_CHECKOUT . [--prompt 16384 --text IDS.npy]

For an exporter change, export one preset before and after it into two folders and compare them here; for a
runtime change, run one artifact by two checkouts of the project (`--checkouts`, one for each folder: a worktree of
the starting commit, and this one). Each artifact (and, with `--genai`, onnxruntime-genai on the same-size LLaMA at
that precision) runs in its own worker process, as in `make bench`: batch 1, a `--prompt`-token prompt (random ids,
or the first of `--text`'s), `--new-tokens` greedy tokens, rounds interleaved after a warm-up, each run started once
the previous worker has gone quiet. Prints each one's median decode tokens/s and time to first token and their
ratios to the first's, taken round by round (min to max over the rounds), and the node count onnxruntime's
optimizer leaves in each graph.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import onnx
import onnxruntime as ort
import peers
from run import Worker, interleaved_runs

from runtime.artifact import is_artifact, session_options


def graph_options(folder: str | Path) -> ort.SessionOptions:
    """SessionOptions that open a folder's model.onnx: an artifact's with its custom-op library registered, as the
    runtime opens it; onnxruntime-genai's (no manifest) as they are."""
    return session_options(folder) if is_artifact(folder) else ort.SessionOptions()


def optimized_nodes(folder: str) -> int:
    """Nodes in the graph onnxruntime runs on the CPU, after its optimizer."""
    with tempfile.TemporaryDirectory() as scratch:
        options = graph_options(folder)
        options.optimized_model_filepath = str(Path(scratch) / "optimized.onnx")
        options.log_severity_level = 3  # its warning on saving a graph with machine-specific fusions
        ort.InferenceSession(str(Path(folder) / "model.onnx"), options, providers=["CPUExecutionProvider"])
        return len(onnx.load(options.optimized_model_filepath, load_external_data=False).graph.node)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", help="artifact folders; ratios are to the first")
    parser.add_argument("--genai", metavar="MODEL:PRECISION", help="add onnxruntime-genai, e.g. fox-small:int4")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--text", help="a .npy of token ids whose first --prompt make the prompt (default: random)")
    parser.add_argument("--checkouts", nargs="+", type=Path, help="the checkout that runs each folder (default: this)")
    args = parser.parse_args(argv)
    threads = os.cpu_count()
    checkouts = args.checkouts or [None] * len(args.folders)
    if len(checkouts) != len(args.folders):
        parser.error(f"--checkouts names {len(checkouts)} checkouts for {len(args.folders)} folders: one each")
    pairs = list(zip(args.folders, checkouts, strict=True))
    names = [folder if checkout is None else f"{folder} @ {checkout}" for folder, checkout in pairs]
    if len(set(names)) != len(names):
        parser.error("each folder and checkout must differ from the others'")
    workers = {name: Worker("runtime", folder, threads, checkout=checkout)
               for name, (folder, checkout) in zip(names, pairs, strict=True)}  # fmt: skip
    nodes = {name: str(optimized_nodes(folder)) for name, (folder, _) in zip(names, pairs, strict=True)}
    if args.genai:
        model, precision = args.genai.split(":")
        genai = str(peers.genai_model(model, precision, threads))
        workers[f"genai {args.genai}"] = Worker("genai", genai, threads, str(peers.genai_python()))
        nodes[f"genai {args.genai}"] = str(optimized_nodes(genai))
    request = {"batch": 1, "prompt": args.prompt, "new_tokens": args.new_tokens, "text": args.text}
    try:
        answers = interleaved_runs(workers, request, 1, args.rounds)
    finally:
        for worker in workers.values():
            worker.close()
    print(f"median of {args.rounds} interleaved rounds, batch 1, a {args.prompt}-token prompt, {threads} threads")
    speeds = {name: [answer["decode_tokens_per_s"] for answer in runs] for name, runs in answers.items()}
    print(ratio_table(("system", "decode tok/s", "vs first"), speeds, nodes))
    first_ms = {name: [answer["ttft_s"] * 1e3 for answer in runs] for name, runs in answers.items()}
    print(ratio_table(("system", "first token ms", "vs first"), first_ms, nodes))
    return 0


def ratio_table(columns: tuple[str, str, str], runs: dict[str, list[float]], nodes: dict[str, int | str]) -> str:
    """A markdown table of each entry's node count, median run and ratio to the first entry's runs, taken
    round by round (median, min to max); `columns` names the entries, the runs and the ratios."""
    first = next(iter(runs.values()))
    lines = [f"| {columns[0]} | nodes run | {columns[1]} | {columns[2]} (min to max) |", "|---|---:|---:|---:|"]
    for name, each in runs.items():
        ratios = [run / base for run, base in zip(each, first, strict=True)]
        lines.append(f"| {name} | {nodes[name]} | {statistics.median(each):.1f} | "
                     f"{statistics.median(ratios):.3f} ({min(ratios):.2f} to {max(ratios):.2f}) |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
