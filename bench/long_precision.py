"""A long single run's precision: raw onnxruntime, one call, a left-padded batch of 6,000 and 3,000 tokens through a
dynamic artifact, against the same model's forward in float64.

The model is an official-format FoX of random weights whose forget-gate biases reach 4 (gates up to 0.98: heads
that remember thousands of tokens, where the gate sums grow largest), exported with the fused operator and with
GroupQueryAttention. The reference is the FoX formula in float64 throughout, written here from its weights (eager
PyTorch on a double model is not: it takes its norms, gate sums and scores in float32 by design). Each artifact
runs as any onnxruntime user runs it: an InferenceSession on model.onnx (with the artifact's custom-op library
registered where its manifest names one), every input fed, no runtime. The figure is max |logits - float64
logits| over the real tokens, over max |float64 logits|. Writes results/long_precision.json and its table in
bench/README.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from report import record

from exporters.pipeline.export import export_artifact
from exporters.pipeline.options import ExportOptions
from kvg_export import FoxConfig, FoxForCausalLM
from runtime.artifact import read_manifest, session_options

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


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def float64_logits(model: FoxForCausalLM, ids: list[int]) -> np.ndarray:
    """`[len(ids), vocab]`: plain FoX (no Pro options) over one unpadded row, every step in float64."""
    config, weights = model.config, {n: t.detach().double() for n, t in model.state_dict().items()}
    heads, dim, eps = config.num_heads, config.head_dim, config.norm_eps
    x = weights["model.embeddings.weight"][ids]
    seq = len(ids)
    later = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)
    for layer in range(config.num_hidden_layers):
        w = {n.removeprefix(f"model.layers.{layer}."): t for n, t in weights.items()}
        h = rms(x, w["attn_norm.weight"], eps)
        q, k, v = (torch.nn.functional.linear(h, w[f"attn.{n}_proj.weight"]).view(seq, heads, dim).transpose(0, 1)
                   for n in "qkv")  # fmt: skip
        gates = torch.nn.functional.logsigmoid(h @ w["attn.fgate_proj.weight"].T + w["attn.fgate_proj.bias"]).T
        sums = gates.cumsum(-1)  # [heads, seq]
        scores = q @ k.transpose(1, 2) / dim**0.5 + sums[:, :, None] - sums[:, None, :]
        attended = torch.softmax(scores.masked_fill(later, float("-inf")), -1) @ v
        x = x + attended.transpose(0, 1).reshape(seq, heads * dim) @ w["attn.o_proj.weight"].T
        gate, up = (rms(x, w["mlp_norm.weight"], eps) @ w["mlp.gate_proj.weight"].T).chunk(2, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ w["mlp.down_proj.weight"].T
    return (rms(x, weights["model.norm.weight"], eps) @ weights["lm_head.weight"].T).numpy()


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
    options = session_options(folder)
    options.intra_op_num_threads = threads
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
            manifest = read_manifest(out)
            manifest_inputs = manifest_inputs or feeds(manifest, args.lengths, model.config.vocab_size)
            results["attention"][attention] = {"logits": run_raw(out, manifest_inputs, args.threads)}
    real = manifest_inputs["attention_mask"] > 0
    reference = np.zeros(results["attention"]["fused"]["logits"].shape)
    with torch.no_grad():
        for row, kept in enumerate(real):
            reference[row, kept] = float64_logits(model, manifest_inputs["input_ids"][row, kept].tolist())
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
        f"{args.max_gate_bias:g}), logits against the formula in float64, relative to the logits' largest magnitude:",
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
