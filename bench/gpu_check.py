"""`make gpu-check`: the CUDA path in one run, on a machine with an NVIDIA GPU.

fox-small is exported for CUDA with a static cache as fp32 (ONNX Attention over buffers TensorScatter writes),
fp16 and bf16 (GroupQueryAttention with the FoX bias); each export validates on CUDA against eager. Then, per
artifact:
- parity: the runtime on CUDA against eager CUDA torch's generate() on a left-padded batch, greedy, with the
  export's rule (exporters/checks/validate.py: tokens until a near-tie, logits within the dtype's tolerance);
- addresses: every in-place key, value and gate buffer keeps its device address across steps and calls;
- speed: decode tokens/s at batch 1 of the runtime and of eager CUDA torch, in interleaved rounds (medians),
  and the runtime's step time against the time to read the step's bytes (weights and the filled cache) at
  the GPU's copy bandwidth, measured here.
Writes results/gpu_check.json and results/gpu_check.md, and prints the table last. `--provider cpu` runs the
same on the CPU (without bf16, which onnxruntime's CPU provider cannot run): a dry run of the script itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from run import RESULTS, machine, spread
from worker import generate_runner, prompts

from exporters.checks.references import eager_generate
from exporters.checks.validate import greedy_disagreement
from exporters.pipeline.export import export_artifact
from exporters.pipeline.lowering import TORCH_DTYPES
from exporters.pipeline.options import DTYPES, ExportOptions
from kvg_export.presets import load_model
from runtime.artifact import SessionOptions, read_manifest
from runtime.cache.device_cache import DeviceCache
from runtime.decode.generator import GenerationConfig, Generator

PARITY_PROMPTS, PARITY_TOKENS = (5, 11, 8), 32
PROMPT, NEW_TOKENS, ROUNDS = 128, 128, 3
MAX_CACHE_LEN = 512


def copy_bandwidth(device: str) -> float:
    """Bytes per second a device-to-device copy of 1 GiB moves, read and written counted, best of 10."""
    source = torch.empty(1 << 28, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(11):
        sync(device)
        start = time.perf_counter()
        target.copy_(source)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() * source.element_size() / best


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_bytes(model, filled: float) -> float:
    """What a decode step at batch 1 must read: every weight once, and each layer's keys, values (model dtype)
    and gates (float32) over the filled positions."""
    config, size = model.config, model.dtype.itemsize
    weights = sum(p.numel() for p in model.parameters()) * size
    per_position = config.num_hidden_layers * (2 * config.kv_heads * config.head_dim * size + config.num_heads * 4)
    return weights + per_position * filled


def check_artifact(folder: Path, model, provider: str) -> dict:
    """Parity against eager on the same device, and the in-place buffers' addresses across steps."""
    generator = Generator.open(folder, SessionOptions(provider=provider))
    rng = np.random.default_rng(1)
    batch_prompts = [rng.integers(3, model.config.vocab_size, n).tolist() for n in PARITY_PROMPTS]
    want_tokens, want_logits = eager_generate(model, batch_prompts, PARITY_TOKENS)
    addresses, cache = [], DeviceCache(generator.model.artifact, len(batch_prompts))

    def record(_event):
        addresses.append({name: cache.held_in(name).data_ptr() for name in cache.in_place})

    config = GenerationConfig(max_new_tokens=PARITY_TOKENS, min_new_tokens=PARITY_TOKENS)
    got = generator.generate(batch_prompts, config, keep_logits=True, on_token=record, cache=cache)
    short = GenerationConfig(max_new_tokens=4, min_new_tokens=4)
    generator.generate(batch_prompts, short, on_token=record, cache=cache)
    dtype = generator.model.artifact.manifest["dtype"]
    failure = greedy_disagreement(got.tokens, want_tokens, got.step_logits, want_logits, dtype)
    return {
        "device": generator.model.artifact.device,
        "parity": failure or "agrees",
        "tokens_equal": got.tokens == want_tokens,
        "in_place_buffers": len(addresses[0]),
        "addresses_kept": all(seen == addresses[0] for seen in addresses),
    }


def speed(folder: Path, model, provider: str, bandwidth: float) -> dict:
    """Decode tokens/s of the runtime and eager at batch 1, interleaved rounds after a warm-up of each."""
    generator = Generator.open(folder, SessionOptions(provider=provider))
    prompt = prompts(model.config.vocab_size, 1, PROMPT)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    eager = generate_runner(model, {})
    generator.generate(prompt, GenerationConfig(max_new_tokens=8))
    eager(1, PROMPT, 8)
    runtime_rates, eager_rates = [], []
    for _ in range(ROUNDS):
        runtime_rates.append(generator.generate(prompt, config).decode_tokens_per_s)
        eager_rates.append(eager(1, PROMPT, NEW_TOKENS)["decode_tokens_per_s"])
    step_s = 1 / statistics.median(runtime_rates)
    floor_s = step_bytes(model, PROMPT + NEW_TOKENS / 2) / bandwidth
    return {
        "runtime_tokens_per_s": spread(runtime_rates),
        "eager_tokens_per_s": spread(eager_rates),
        "step_ms": 1e3 * step_s,
        "read_floor_ms": 1e3 * floor_s,
        "step_over_floor": step_s / floor_s,
    }


def table(report: dict) -> str:
    lines = [
        f"{report['preset']} on {report['device_name']}, static cache of {MAX_CACHE_LEN}; parity: a left-padded "
        f"batch of 3, {PARITY_TOKENS} greedy tokens; speed: batch 1, {PROMPT}-token prompt, {NEW_TOKENS} new "
        f"tokens, median of {ROUNDS} interleaved rounds; copy bandwidth {report['bandwidth_gb_s']:.0f} GB/s",
        "",
        "| dtype | attention | export parity (Δ, tolerance) | runtime vs eager on the device | buffers keep "
        "addresses | runtime tok/s | eager tok/s | ratio | step ms | read floor ms | step / floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["artifacts"]:
        if "skipped" in row:
            lines.append(f"| {row['dtype']} | | {row['skipped']} | | | | | | | | |")
            continue
        runtime, eager = row["runtime_tokens_per_s"]["median"], row["eager_tokens_per_s"]["median"]
        lines.append(
            f"| {row['dtype']} | {row['attention']} | {row['export_logits_diff']:.1e} ({row['tolerance']:.0e}) | "
            f"{row['parity']} | {'yes' if row['addresses_kept'] else 'NO'} ({row['in_place_buffers']}) | "
            f"{runtime:.0f} | {eager:.0f} | {runtime / eager:.2f}x | {row['step_ms']:.2f} | "
            f"{row['read_floor_ms']:.3f} | {row['step_over_floor']:.1f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="fox-small")
    parser.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=list(DTYPES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    device = "cuda" if args.provider == "cuda" else "cpu"
    usable = torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()
    if device == "cuda" and not usable:
        print("gpu-check: needs CUDA torch and onnxruntime-gpu with a GPU (see docs/cuda.md)", file=sys.stderr)
        return 2
    report = {
        "preset": args.preset, "provider": args.provider, "machine": machine(),
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "CPU",
        "bandwidth_gb_s": copy_bandwidth(device) / 1e9, "artifacts": [],
    }  # fmt: skip
    failed = False
    with tempfile.TemporaryDirectory() as scratch:
        for dtype in args.dtypes:
            if dtype == "bf16" and device == "cpu":
                report["artifacts"].append({"dtype": dtype, "skipped": "CUDA only"})
                continue
            out = Path(scratch) / dtype
            options = ExportOptions(args.preset, out, "static", dtype, MAX_CACHE_LEN, provider=args.provider)
            result = export_artifact(options, log=print)
            manifest = read_manifest(out)
            model = load_model(args.preset, dtype=TORCH_DTYPES[dtype]).to(device)
            row = {"dtype": dtype, "attention": manifest["attention"],
                   "export_logits_diff": result.report.summary()["max_onnx_logits_diff"],
                   "tolerance": result.report.tolerance}  # fmt: skip
            row |= check_artifact(out, model, args.provider)
            row |= speed(out, model, args.provider, report["bandwidth_gb_s"] * 1e9)
            failed |= row["parity"] != "agrees" or not row["addresses_kept"] or row["device"] != device
            report["artifacts"].append(row)
            del model
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "gpu_check.md").write_text(table(report) + "\n")
    print("\n" + table(report))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
