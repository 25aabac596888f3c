"""`kvg-export MODEL --out DIR`: export a FoX model to a validated ONNX artifact folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from exporters.export import ATTENTION_KINDS, DEFAULT_MAX_BATCH, DTYPES, ExportError, ExportOptions, export_artifact
from exporters.onnx_export import DEFAULT_OPSET


def parse_args(argv: list[str] | None) -> ExportOptions:
    parser = argparse.ArgumentParser(prog="kvg-export", description=__doc__)
    parser.add_argument("model", help="a preset name (see models/) or a local checkpoint folder")
    parser.add_argument("--out", type=Path, required=True, help="the artifact folder to create")
    parser.add_argument("--cache", choices=("dynamic", "static"), default="dynamic")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument("--max-cache-len", type=int, help="static cache length (default 1024)")
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH)
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET)
    parser.add_argument(
        "--provider", choices=("cpu", "cuda"), default="cpu", help="onnxruntime provider to validate on"
    )
    parser.add_argument(
        "--attention",
        choices=ATTENTION_KINDS,
        default="auto",
        help="gqa: onnxruntime's GroupQueryAttention, appending to the cache buffer in place (CPU provider); "
        "standard: ONNX MatMul and Softmax, any provider; auto: gqa for fp32 on cpu (default)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace an existing artifact (only once the new one is good)"
    )
    args = parser.parse_args(argv)
    return ExportOptions(**{k: v for k, v in vars(args).items()})


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    try:
        result = export_artifact(options, log=lambda line: print(line, flush=True))
    except ExportError as error:
        print(f"kvg-export: error: {error}", file=sys.stderr)
        return 2
    summary = result.report.summary()
    print(
        f"\nartifact  {result.path} ({result.size_bytes / 1e6:.1f} MB)\n"
        f"parity    logits max |Δ| {summary['max_onnx_logits_diff']:.2e} (onnxruntime), "
        f"{summary['max_program_logits_diff']:.2e} (ExportedProgram), cache max |Δ| {summary['max_present_diff']:.2e}, "
        f"tolerance {summary['tolerance']:.0e}, greedy tokens {'agree' if summary['greedy_tokens_agree'] else 'differ'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
