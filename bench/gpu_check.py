"""CUDA check in one go (`make gpu-check`): export fox-small in both cache kinds, validated on CUDA, then
decode tokens/s of the runtime on CUDA against CPU, printed as a table. Run on a machine with a GPU."""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from exporters.export import ExportOptions, export_artifact
from runtime.artifact import SessionOptions
from runtime.generator import GenerationConfig, Generator

PRESET, PROMPT, NEW_TOKENS, RUNS = "fox-small", 128, 128, 3


def decode_rate(folder: Path, provider: str, batch: int) -> float:
    generator = Generator.open(folder, SessionOptions(provider=provider))
    prompts = np.random.default_rng(0).integers(3, generator.artifact.vocab_size, (batch, PROMPT)).tolist()
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    generator.generate(prompts, GenerationConfig(max_new_tokens=4))  # warm-up
    return statistics.median(generator.generate(prompts, config).decode_tokens_per_s for _ in range(RUNS))


def main() -> int:
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for cache in ("dynamic", "static"):
            out = Path(scratch) / cache
            length = 1024 if cache == "static" else None
            result = export_artifact(ExportOptions(PRESET, out, cache, "fp32", length, provider="cuda"), log=print)
            for batch in (1, 8):
                cuda, cpu = decode_rate(out, "cuda", batch), decode_rate(out, "cpu", batch)
                rows.append((cache, batch, cuda, cpu, result.report.summary()["max_onnx_logits_diff"]))
    print(f"\n{PRESET}, fp32, prompt {PROMPT}, {NEW_TOKENS} new tokens, median of {RUNS}")
    print(f"{'cache':<8} {'batch':>5} {'CUDA tok/s':>11} {'CPU tok/s':>10} {'speed-up':>9} {'logits Δ (CUDA)':>16}")
    for cache, batch, cuda, cpu, diff in rows:
        print(f"{cache:<8} {batch:>5} {cuda:>11.1f} {cpu:>10.1f} {cuda / cpu:>8.1f}x {diff:>16.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
