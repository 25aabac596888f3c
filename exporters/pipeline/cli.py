"""`kvg-export MODEL --out DIR`: export a FoX model to a validated ONNX artifact folder."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import version
from pathlib import Path

from exporters.evaluation.evaluate import Thresholds
from exporters.pipeline import export
from exporters.pipeline.export import export_artifact
from exporters.pipeline.options import (
    ATTENTION_KINDS,
    DEFAULT_MAX_BATCH,
    DEFAULT_QUALITY_SEGMENTS,
    DTYPES,
    ONNX_ATTENTION_OPSET,
    ExportError,
    ExportOptions,
    QualityOptions,
)
from exporters.quantization import settings as quantization
from exporters.quantization.settings import Quantization, QuantizationError
from runtime.cache.pruning import parse_tolerance
from runtime.contract import DEFAULT_OPSET

QUANTIZATION_FLAGS = ("block_size", "quant_method", "accuracy_level", "keep_float", "symmetric")


def _roles(text: str) -> tuple[str, ...]:
    return () if text == "none" else tuple(role.strip() for role in text.split(",") if role.strip())


def _add_quantization(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "quantization", "weight-only, to onnxruntime's MatMulNBits; judged on held-out text against eager fp32"
    )
    group.add_argument(
        "--quantize", choices=tuple(quantization.BITS), help="quantize the weights of the graph's MatMuls"
    )
    group.add_argument(
        "--block-size", type=int, choices=quantization.BLOCK_SIZES, help="weights per scale (default 32)"
    )
    group.add_argument("--quant-method", choices=quantization.METHODS,
                       help="rtn (onnxruntime's round-to-nearest, default), hqq (int4; its float zero "
                       "points run 10x slower on the CPU provider) or k_quant")  # fmt: skip
    group.add_argument("--accuracy-level", type=int, choices=range(5),
                       help="MatMulNBits compute: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 (default 4)")  # fmt: skip
    roles, kept = ", ".join(quantization.FLOAT_ROLES), ",".join(quantization.DEFAULT_KEEP_FLOAT)
    group.add_argument("--keep-float", type=_roles,
                       help=f"roles left in float, comma-separated, or none: {roles} (default {kept})")  # fmt: skip
    group.add_argument("--symmetric", action="store_true", default=None, help="zero points fixed at the middle")
    group.add_argument("--quality-segments", type=int, default=DEFAULT_QUALITY_SEGMENTS,
                       help="held-out 512-token segments to judge on (0: all; default %(default)s)")  # fmt: skip
    group.add_argument("--quality-text", type=Path, action="append",
                       help="judge on these files or folders, not the stdlib test split (repeatable)")  # fmt: skip
    limits = ", ".join(f"int{b}: {t.max_relative_perplexity_diff:.1%} and {t.min_top1_agreement:.0%}"
                       for b, t in export.QUALITY_THRESHOLDS.items())  # fmt: skip
    help_text = f"relative, against eager fp32 ({limits})".replace("%", "%%")  # argparse formats help with %
    group.add_argument("--max-perplexity-diff", type=float, help=help_text)
    group.add_argument("--min-agreement", type=float, help="smallest top-1 agreement with eager fp32")


def _quantization(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Quantization | None:
    given = [flag for flag in QUANTIZATION_FLAGS if getattr(args, flag) is not None]
    if args.quantize is None:
        if given:
            parser.error(f"--{given[0].replace('_', '-')} applies to a quantized export: add --quantize int8|int4")
        return None
    settings = {"block_size": args.block_size, "method": args.quant_method, "accuracy_level": args.accuracy_level,
                "keep_float": args.keep_float, "symmetric": args.symmetric}  # fmt: skip
    return Quantization(quantization.BITS[args.quantize], **{k: v for k, v in settings.items() if v is not None})


def _quality(args: argparse.Namespace) -> QualityOptions:
    thresholds = None
    if args.max_perplexity_diff is not None or args.min_agreement is not None:
        default = export.QUALITY_THRESHOLDS[quantization.BITS[args.quantize or "int8"]]
        thresholds = Thresholds(
            default.max_relative_perplexity_diff if args.max_perplexity_diff is None else args.max_perplexity_diff,
            default.min_top1_agreement if args.min_agreement is None else args.min_agreement,
        )
    return QualityOptions(thresholds, args.quality_segments or None, args.quality_text)


def parse_args(argv: list[str] | None) -> ExportOptions:
    parser = argparse.ArgumentParser(prog="kvg-export", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('kvg-export')}")
    parser.add_argument("model", help="a preset name (see models/) or a local checkpoint folder")
    parser.add_argument("--out", type=Path, required=True, help="the artifact folder to create")
    parser.add_argument("--cache", choices=("dynamic", "static"), default="dynamic")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    limit = "with --cache dynamic, the most positions (prompt plus new tokens) the runtime accepts (default: none)"
    parser.add_argument("--max-cache-len", type=int, help=f"static cache length (default 1024); {limit}")
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH)
    opsets = f"default {DEFAULT_OPSET}; {ONNX_ATTENTION_OPSET} for onnx-attention"
    parser.add_argument("--opset", type=int, help=f"ONNX opset ({opsets})")
    parser.add_argument(
        "--provider", choices=("cpu", "cuda"), default="cpu", help="onnxruntime provider to validate on"
    )
    parser.add_argument(
        "--attention",
        choices=ATTENTION_KINDS,
        default="auto",
        help="gqa: onnxruntime's GroupQueryAttention, appending to the cache buffer in place (CPU: fp32, fp16; "
        "CUDA: fp16, bf16); onnx-attention: ONNX Attention over a static buffer written in place by TensorScatter "
        "(opset 24; CPU and CUDA); standard: ONNX MatMul and Softmax, any provider, copying the cache; "
        "auto (default): gqa, except fp32 for --provider cuda: onnx-attention with a static cache, else standard",
    )
    parser.add_argument(
        "--log-pruning-tolerance", type=parse_tolerance, default=argparse.SUPPRESS, metavar="X|none",
        help="let the runtime drop cached keys whose weight in any later query is provably below e^X (the official "
        "examples use -10); default: the checkpoint config's log_pruning_tolerance; none: keep every key",
    )  # fmt: skip
    parser.add_argument(
        "--force", action="store_true", help="replace an existing artifact (only once the new one is good)"
    )
    _add_quantization(parser)
    args = parser.parse_args(argv)
    general = {k: v for k, v in vars(args).items() if k in ExportOptions.__dataclass_fields__}
    return ExportOptions(**general, quantization=_quantization(args, parser), quality=_quality(args))


def main(argv: list[str] | None = None) -> int:
    try:
        options = parse_args(argv)
        result = export_artifact(options, log=lambda line: print(line, flush=True))
    except (ExportError, QuantizationError) as error:
        print(f"kvg-export: error: {error}", file=sys.stderr)
        return 2
    summary = result.report.summary()
    print(
        f"\nartifact  {result.path} ({result.size_bytes / 1e6:.1f} MB)\n"
        f"parity    {summary['measure']}: logits {summary['max_onnx_logits_diff']:.2e} (onnxruntime), "
        f"{summary['max_program_logits_diff']:.2e} (ExportedProgram), cache {summary['max_present_diff']:.2e}, "
        f"tolerance {summary['tolerance']:.0e}, greedy tokens {'agree' if summary['greedy_tokens_agree'] else 'differ'}"
        + (" (the float graph, before quantization)" if result.quality else "")
    )
    if result.quality:
        quality, limits = result.quality, result.quality.thresholds
        print(
            f"quality   {options.quantization.name}: perplexity {quality.artifact.perplexity:.4f} against eager fp32's "
            f"{quality.eager.perplexity:.4f} ({quality.relative_perplexity_diff:+.2%}, limit "
            f"{limits.max_relative_perplexity_diff:.1%}), top-1 agreement {quality.top1_agreement:.2%} (limit "
            f"{limits.min_top1_agreement:.0%}) on {quality.predicted_tokens:,} held-out tokens; cache check passed"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
