"""`kvg-eval MODEL [--artifact DIR]`: perplexity and next-token top-1 agreement on held-out text, eager
PyTorch against an exported artifact run by the torch-free runtime, overall and by segment position. The
text's files are joined with the end-of-text token and cut into segments of --context tokens. Exits 1 when
the artifact misses the thresholds (overall or in any band), 2 on bad input."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from exporters.evaluation.evaluate import (
    BAND_GROWTH,
    DEFAULT_CONTEXT,
    EvalError,
    Thresholds,
    default_bands,
    evaluate,
    write_json,
)
from exporters.evaluation.plot import plot_perplexity_by_position
from exporters.progress import Progress
from kvg_export.corpus import SPLITS
from runtime.artifact import SessionOptions


def _bands(text: str) -> list[tuple[int, int]]:
    try:
        bands = [tuple(int(n) for n in part.split("-")) for part in text.split(",")]
        if all(len(band) == 2 for band in bands):
            return bands
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: give bands as first-last[,first-last...], e.g. 0-255")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvg-eval", description=__doc__)
    parser.add_argument("model", help="a preset name or a local checkpoint folder (the eager reference)")
    parser.add_argument("--artifact", type=Path, help="an artifact folder exported from MODEL")
    parser.add_argument("--split", choices=tuple(SPLITS), default="test", help="corpus split to score (default test)")
    parser.add_argument("--text", type=Path, action="append", help="score these files or folders instead (repeatable)")
    parser.add_argument("--context", type=int, default=DEFAULT_CONTEXT,
                        help="tokens per segment (default %(default)s), cut from the text's files joined with "
                        f"the end-of-text token: in path order up to {DEFAULT_CONTEXT}, longest file first above, "
                        "so that long segments hold long files")  # fmt: skip
    parser.add_argument("--max-segments", type=int, help="score only the first N segments")
    parser.add_argument("--provider", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0: its default)")
    parser.add_argument("--max-perplexity-diff", type=float, default=Thresholds.max_relative_perplexity_diff,
                        help="largest relative perplexity difference accepted (default %(default)s)")  # fmt: skip
    parser.add_argument("--min-agreement", type=float, default=Thresholds.min_top1_agreement,
                        help="smallest top-1 agreement accepted (default %(default)s)")  # fmt: skip
    defaults = ",".join(f"{first}-{last}" for first, last in default_bands(BAND_GROWTH**3 * DEFAULT_CONTEXT))
    parser.add_argument("--bands", type=_bands, help="also score and judge segment positions separately, e.g. "
                        "0-255,1024-2047 (first-last, inclusive). Default for segments over "
                        f"{DEFAULT_CONTEXT} tokens: {defaults},... (log-spaced), the last cut at the segment's "
                        "end; none for shorter segments")  # fmt: skip
    parser.add_argument("--plot", type=Path, help="also draw perplexity against segment position (log-spaced "
                        "bins, both systems) into this PNG")  # fmt: skip
    parser.add_argument("--json", type=Path, help="where to write the report (default evals/MODEL[--ARTIFACT].json)")
    return parser.parse_args(argv)


def _default_json(model: str, artifact: Path | None) -> Path:
    name = Path(model).name + (f"--{artifact.resolve().name}" if artifact else "")
    return Path("evals") / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}.json"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.max_segments is not None and args.max_segments < 1:
        print("kvg-eval: error: --max-segments must be at least 1", file=sys.stderr)
        return 2
    try:
        with Progress(lambda line: print(line, file=sys.stderr, flush=True), "kvg-eval") as progress:
            evaluation = evaluate(
                args.model, args.artifact, split=args.split, text_paths=args.text, context=args.context,
                max_segments=args.max_segments, session_options=SessionOptions(args.provider, args.threads),
                thresholds=Thresholds(args.max_perplexity_diff, args.min_agreement), bands=args.bands,
                progress=progress,
            )  # fmt: skip
    except EvalError as error:
        print(f"kvg-eval: error: {error}", file=sys.stderr)
        return 2
    text = evaluation.text
    where = f"the Python {text['python']} stdlib {text['split']} split" if "split" in text else "the given files"
    print(
        f"kvg-eval: {args.model} on {where} ({text['files']} files, {text['order']}, {text['tokens']:,} tokens): "
        f"{evaluation.segments} segments of up to {evaluation.segment_tokens} tokens, "
        f"{evaluation.predicted_tokens:,} tokens predicted"
    )
    print(evaluation.table())
    path = args.json or _default_json(args.model, args.artifact)
    write_json(evaluation, path)
    print(f"kvg-eval: report written to {path}")
    if args.plot:
        plot_perplexity_by_position(evaluation, args.plot)
        print(f"kvg-eval: perplexity by position drawn in {args.plot}")
    return 1 if evaluation.failures else 0


if __name__ == "__main__":
    sys.exit(main())
