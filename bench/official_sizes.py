"""`make bench-sizes`: the official FoX sizes end to end. Each preset is exported in fp32 and in int4 (wall time and
the exporter's peak RSS, against the fp32 weights' bytes), then the runtime runs both artifacts beside
onnxruntime-genai on a LLaMA of the same dims at the same precision, in interleaved rounds: decode tokens/s, time
to first token and each worker's peak RSS, at batch 1 and 8 (genai's peer runs batch 1 only). The int4 exports
use genai's recipe (symmetric, block 32, accuracy level 4); random weights are judged on perplexity alone.
Writes results/sizes.json and the table in bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import peers
from report import fmt_spread, record, table_row
from run import ARTIFACTS, Worker, interleaved_runs, machine, ratio, summary

from exporters.pipeline.preflight import parameters
from kvg_export.presets import resolve_checkpoint

BEGIN, END = "<!-- sizes:begin -->", "<!-- sizes:end -->"
SAMPLE_S = 0.05
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
EXPORTS = {"fp32": [], "int4": ["--quantize", "int4", "--symmetric", "--min-agreement", "0"]}


def _tree_rss(root: int) -> int:
    """Resident bytes of process `root` and every process below it, summed (Linux's /proc)."""
    parents = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):  # a process that ended while it was read
                parents[int(entry.name)] = int(Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[1])
    tree, frontier = set(), [root]
    while frontier:
        pid = frontier.pop()
        tree.add(pid)
        frontier += [child for child, parent in parents.items() if parent == pid]
    total = 0
    for pid in tree:
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return total * PAGE_BYTES


def export(model: str, precision: str, quality_segments: int) -> dict:
    """Export afresh in a process of its own: its wall time and its peak RSS, the exporter's and its torch half's
    processes summed (sampled every SAMPLE_S; the kernel's count for the largest one alone is the floor)."""
    out = ARTIFACTS / f"{model}-sizes-{precision}"
    judged = ["--quality-segments", str(quality_segments)] if EXPORTS[precision] else []
    command = [str(Path(sys.executable).parent / "kvg-export"), model, "--out", str(out), "--force",
               *EXPORTS[precision], *judged]  # fmt: skip
    print(f"exporting {out.name} ...", flush=True)
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    peak = 0
    while (ended := os.wait4(process.pid, os.WNOHANG))[0] == 0:
        peak = max(peak, _tree_rss(process.pid))
        time.sleep(SAMPLE_S)
    _, status, usage = ended
    if status:
        raise RuntimeError(f"{' '.join(command)} failed (status {status}); its error is above")
    return {
        "folder": str(out), "export_s": time.perf_counter() - start,
        "export_peak_rss_bytes": max(peak, usage.ru_maxrss * 1024),
        "fp32_weight_bytes": 4 * parameters(resolve_checkpoint(model)),
    }  # fmt: skip


def compare(model: str, artifacts: dict[str, dict], batches: list[int], runs: int, threads: int) -> list[dict]:
    """The runtime on each artifact and genai at its precision, interleaved; one row per system and batch."""
    targets = {f"runtime-{p}": (made["folder"], sys.executable) for p, made in artifacts.items()}
    targets |= {f"genai-{p}": (str(peers.genai_model(model, p, threads)), str(peers.genai_python())) for p in artifacts}
    workers = {name: Worker(name, target, threads, python) for name, (target, python) in targets.items()}
    rows = []
    try:
        for batch in sorted(batches):
            running = {name: worker for name, worker in workers.items() if batch == 1 or name.startswith("runtime")}
            answers = interleaved_runs(running, {"batch": batch, "prompt": 128, "new_tokens": 128}, 1, runs)
            for name in running:
                row = {"model": model, "batch": batch, "system": name, **summary(answers[name])}
                genai = name.replace("runtime", "genai")
                if name.startswith("runtime") and genai in answers:
                    row["decode_vs_genai"] = ratio(answers[name], answers[genai])
                    row["rss_vs_genai"] = answers[name][-1]["peak_rss_mb"] / answers[genai][-1]["peak_rss_mb"]
                rows.append(row)
    finally:
        for worker in workers.values():
            worker.close()
    return rows


def table(results: dict) -> str:
    lines = [
        BEGIN,
        f"Run {results['machine']['date']} ({results['machine']['cores']} cores), prompt 128, 128 new tokens, median "
        f"(min to max) of {results['settings']['runs']} interleaved runs after a warm-up.",
        "",
        "| model | precision | export | export peak RSS (x fp32 weights) | system | batch | decode tok/s | vs genai "
        "| first token ms | peak RSS MB | vs genai |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        precision = row["system"].split("-")[1]
        made = results["exports"][row["model"]][precision]
        ours = row["system"].startswith("runtime")
        peak = made["export_peak_rss_bytes"]
        export = f"{made['export_s']:.0f} s" if ours else ""
        peak_text = f"{peak / 1e9:.2f} GB ({peak / made['fp32_weight_bytes']:.1f}x)" if ours else ""
        spread = row["decode_tokens_per_s"]
        vs = f"{row['decode_vs_genai']['median']:.2f}x" if "decode_vs_genai" in row else ""
        rss_vs = f"{row['rss_vs_genai']:.2f}x" if "rss_vs_genai" in row else ""
        lines.append(table_row(
            row["model"], precision, export, peak_text, row["system"], row["batch"], fmt_spread(spread), vs,
            f"{row['ttft_s']['median'] * 1e3:.0f}", f"{row['peak_rss_mb']:.0f}", rss_vs,
        ))  # fmt: skip
    return "\n".join([*lines, END])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["fox-base"], help="presets (fox-pro-760m: opt-in, minutes)")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quality-segments", type=int, default=8, help="held-out segments an int4 export is judged on")
    args = parser.parse_args(argv)
    threads = os.cpu_count()
    exports = {model: {p: export(model, p, args.quality_segments) for p in EXPORTS} for model in args.models}
    rows = [row for model in args.models for row in compare(model, exports[model], args.batches, args.runs, threads)]
    results = {"machine": machine(), "settings": vars(args), "exports": exports, "rows": rows}
    record("sizes.json", results, BEGIN, END, table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
