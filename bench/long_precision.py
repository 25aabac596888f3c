"""A long single run's precision: raw onnxruntime, one call, a left-padded batch of 6,000 and 3,000 tokens through a
dynamic artifact, against the same model's forward in float64.

The model is an official-format FoX of random weights whose forget-gate biases reach 4 (gates up to 0.98: heads
that remember thousands of tokens, where the gate sums grow largest), exported with the fused operator and with
GroupQueryAttention. Each artifact runs as any onnxruntime user runs it: an InferenceSession on model.onnx (with
the artifact's custom-op library registered where its manifest names one), every input fed, no runtime. The
figure is max |logits - float64 logits| over the real tokens, over max |float64 logits|. Writes
results/long_precision.json and its table in bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from report import record

from exporters.export import ExportOptions, export_artifact
from kvg_export import FoxConfig, FoxForCausalLM

BEGIN, END = "<!-- precision:begin -->", "<!-- precision:end -->"
ATTENTION = ("fused", "gqa")


def checkpoint(folder: Path, layers: int, hidden: int, heads: int, max_bias: float) -> FoxForCausalLM:
    torch.manual_seed(0)
    config = FoxConfig(vocab_size=1024, hidden_size=hidden, num_hidden_layers=layers, num_heads=heads,
                       intermediate_size=2 * hidden)  # fmt: skip
    model = FoxForCausalLM(config).eval()
    with torch.no_grad():
        for block in model.model.layers:
            block.attn.fgate_proj.bias.copy_(torch.linspace(0.0, max_bias, heads))
    model.save_pretrained(folder)
    return model


def feeds(manifest: dict, lengths: list[int], vocab: int) -> dict[str, np.ndarray]:
    """Every graph input of a dynamic artifact for one prefill of left-padded prompts, the pasts empty."""
    width, rows = max(lengths), len(lengths)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocab, size=(rows, width), dtype=np.int64)
    mask = np.zeros((rows, width), dtype=np.int64)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    ids = np.where(mask > 0, ids, 0)
    given = {"input_ids": ids, "attention_mask": mask}
    for entry in manifest["inputs"]:
        if entry["name"] not in given:
            shape = [rows if axis == "batch" else 0 if axis == "past" else axis for axis in entry["axes"]]
            given[entry["name"]] = np.zeros(shape, dtype=np.dtype(entry["dtype"]))
    return given


def run_raw(folder: Path, inputs: dict[str, np.ndarray], threads: int) -> np.ndarray:
    manifest = json.loads((folder / "kvg_config.json").read_text())
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if manifest.get("custom_ops"):
        options.register_custom_ops_library(str(folder / manifest["custom_ops"]["file"]))
    session = ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
    return session.run(["logits"], inputs)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[6000, 3000])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--max-gate-bias", type=float, default=4.0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    results = {"lengths": args.lengths, "max_gate_bias": args.max_gate_bias, "attention": {}}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "model"
        model = checkpoint(folder, args.layers, args.hidden, args.heads, args.max_gate_bias)
        manifest_inputs = None
        for attention in ATTENTION:
            out = Path(scratch) / attention
            export_artifact(ExportOptions(str(folder), out, attention=attention, log_pruning_tolerance=None),
                            log=lambda _: None)  # fmt: skip
            manifest = json.loads((out / "kvg_config.json").read_text())
            manifest_inputs = manifest_inputs or feeds(manifest, args.lengths, model.config.vocab_size)
            results["attention"][attention] = {"logits": run_raw(out, manifest_inputs, args.threads)}
        with torch.no_grad():
            ids, mask = (torch.from_numpy(manifest_inputs[n]) for n in ("input_ids", "attention_mask"))
            reference = model.double()(input_ids=ids, attention_mask=mask, use_cache=False).logits.numpy()
    real = manifest_inputs["attention_mask"] > 0
    scale = np.abs(reference[real]).max()
    rows = []
    for attention, measured in results["attention"].items():
        error = np.abs(measured.pop("logits")[real] - reference[real])
        by_position = error.max(-1)
        worst = int(np.flatnonzero(real.ravel())[by_position.argmax()] % real.shape[1])
        measured |= {"relative_error": float(error.max() / scale), "worst_slot": worst}
        rows.append(f"| {attention} | {error.max() / scale:.1e} | {worst} |")
    text = "\n".join([
        BEGIN,
        f"One onnxruntime call, left-padded prompts of {' and '.join(f'{n:,}' for n in args.lengths)} tokens, a random "
        f"official-format FoX ({args.layers} layers, hidden {args.hidden}, {args.heads} heads, forget-gate biases 0 to "
        f"{args.max_gate_bias:g}), logits against float64 eager, relative to the logits' largest magnitude:",
        "",
        "| attention | max relative error | worst slot |",
        "|---|---|---|",
        *rows,
        END,
    ])  # fmt: skip
    record("long_precision.json", results, BEGIN, END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
