"""The keys each head of a trained preset still needs, against the position, under forget-gate pruning's bound.

Eager PyTorch reads `--tokens` tokens of held-out text (the stdlib corpus's test split, longest documents first)
and records every layer's log forget gates. At each position t a head needs key j while the decay c_t - c_j is at
least log_pruning_tolerance - 2U - log L (runtime/cache/pruning.py), with U the head's score bound from the weights
(kvg_export/fox/pruning.py) and L the text's length; the decay falls with j, so what a head needs is its last
keys, and a layer's window is its neediest head's (what the runtime's cache keeps of that layer). Writes
kept_keys.json and kept_keys.png under --out, and, when --out is the default, the table in bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib
import numpy as np
import torch
from report import publish
from run import RESULTS, machine
from tokenizers import Tokenizer

from kvg_export.corpus import read_split, token_stream
from kvg_export.fox.pruning import score_bounds
from kvg_export.presets import load_model, resolve_checkpoint
from runtime.cache.pruning import Pruning, needed_slots

matplotlib.use("Agg")
import matplotlib.pyplot as plt

BEGIN, END = "<!-- kept:begin -->", "<!-- kept:end -->"
EVERY = 128  # positions between two counts


def log_gates(model, ids: np.ndarray) -> list[np.ndarray]:
    """Each layer's log forget gates over the text, float64 `[heads, tokens]`, fed in the chunks a prompt is."""
    gates: dict[int, list[torch.Tensor]] = {}
    hooks = [
        block.attn.register_forward_hook(
            lambda module, args, out, i=i, store=gates: store.setdefault(i, []).append(module.log_forget_gate(args[0]))
        )
        for i, block in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        model(input_ids=torch.from_numpy(ids)[None], use_cache=True)
    for hook in hooks:
        hook.remove()
    return [torch.cat(gates[i], dim=-1)[0].double().numpy() for i in range(len(gates))]


def kept_keys(gates: np.ndarray, thresholds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """`[heads, len(positions)]`: how many of its last keys each head needs at each position, as the runtime
    counts them (runtime.cache.pruning's needed_slots over the text up to that position, one row)."""
    return np.stack([needed_slots([gates[None, :, : t + 1]], thresholds[None])[0] for t in positions], axis=-1)


def measure(preset: str, tokens: int, tolerance: float) -> dict:
    checkpoint = resolve_checkpoint(preset)
    model = load_model(checkpoint).eval()
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    stream = token_stream(tokenizer, read_split("test"), model.config.eos_token_id, longest_first=True)[:tokens]
    bounds = np.asarray(score_bounds(model))
    thresholds = Pruning(tolerance, bounds).thresholds(len(stream))
    positions = np.arange(EVERY - 1, len(stream), EVERY)
    kept = [kept_keys(gates, t, positions) for gates, t in zip(log_gates(model, stream), thresholds, strict=True)]
    return {
        "preset": preset,
        "positions": (positions + 1).tolist(),  # positions filled
        "score_bounds": bounds.tolist(),
        "kept": [layer.tolist() for layer in kept],  # [layer][head][position]
    }


def table(results: dict) -> str:
    """Per preset and layer, the keys each head needs at a few positions, and what the cache keeps."""
    lines = [
        "| preset | positions | keys each head needs, layer by layer | cache keeps | share |",
        "|---|---:|---|---:|---:|",
    ]
    for run in results["runs"]:
        picks = [index for index, p in enumerate(run["positions"]) if p in (1024, 4096, 8192, 16384, 32768)]
        for index in picks:
            position = run["positions"][index]
            heads = [[layer[h][index] for h in range(len(layer))] for layer in run["kept"]]
            kept = sum(max(layer) * len(layer) for layer in heads)  # a layer keeps its neediest head's window
            needed = " / ".join(", ".join(map(str, layer)) for layer in heads)
            share = kept / (position * sum(map(len, heads)))
            lines.append(f"| {run['preset']} | {position:,} | {needed} | {kept:,} | {share:.1%} |")
    return "\n".join(lines)


def plot(results: dict, path) -> None:
    figure, axes = plt.subplots(1, len(results["runs"]), figsize=(7 * len(results["runs"]), 4.5), squeeze=False)
    for axis, run in zip(axes[0], results["runs"], strict=True):
        x = run["positions"]
        for layer, heads in enumerate(run["kept"]):
            for kept in heads:
                axis.plot(x, kept, color=f"C{layer}", linewidth=0.8, alpha=0.7)
            axis.plot(x, np.max(heads, axis=0), color=f"C{layer}", linewidth=2.2, label=f"layer {layer} (window)")
        axis.plot(x, x, color="gray", linestyle=":", label="every position")
        axis.set_yscale("log")
        axis.set_xlabel("positions filled")
        axis.set_ylabel("keys a head needs (thin), a layer keeps (thick)")
        axis.set_title(f"{run['preset']}, log tolerance {results['settings']['tolerance']:g}")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["fox-py", "fox-pro-py"])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--tolerance", type=float, default=-10.0, help="the log pruning tolerance")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    results = {"machine": machine(), "settings": {"tokens": args.tokens, "tolerance": args.tolerance}}
    results["runs"] = [measure(preset, args.tokens, args.tolerance) for preset in args.presets]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kept_keys.json").write_text(json.dumps(results) + "\n")
    plot(results, args.out / "kept_keys.png")
    text = "\n".join([
        BEGIN,
        f"Run {results['machine']['date']}: {args.tokens:,} tokens of held-out text (the stdlib corpus's test "
        f"split, longest documents first), log pruning tolerance {args.tolerance:g}, L the text's length. A "
        "layer's cache keeps its neediest head's window (share: of every head's every position).",
        "",
        table(results),
        "",
        "![kept keys](results/kept_keys.png)",
        END,
    ])  # fmt: skip
    publish(args.out, BEGIN, END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
