"""`kvg-train PRESET`: train a trained preset (`fox-py`, `fox-pro-py`) from nothing, or resume its run."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

from kvg_export.presets import MODELS_DIR, preset_folder, preset_names
from kvg_export.training.loop import publish_to_preset, train
from kvg_export.training.recipe import has_recipe


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvg-train", description=__doc__)
    parser.add_argument("preset", help="a preset whose preset.json has a training recipe (e.g. fox-py)")
    parser.add_argument("--run-dir", type=Path, help="checkpoint, report and model folder (default runs/PRESET)")
    parser.add_argument("--fresh", action="store_true", help="discard the run's checkpoint and start over")
    parser.add_argument("--pause-after", type=int, help="stop after this many steps (checkpointed); resume later")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--no-compile", action="store_true", help="run the training step eagerly (slower)")
    parser.add_argument(
        "--publish", action="store_true", help=f"when done, replace the preset's weights in {MODELS_DIR} with the run's"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    preset = preset_folder(args.preset)
    if preset is None or not has_recipe(preset):
        trained = [name for name in preset_names() if has_recipe(MODELS_DIR / name)]
        what = "an unknown preset" if preset is None else "a random-weight preset, with no training recipe"
        print(f"kvg-train: error: {args.preset!r} is {what}; trained presets: {', '.join(trained)}", file=sys.stderr)
        return 2
    run_dir = args.run_dir or Path("runs") / preset.name
    if args.pause_after is not None and args.pause_after < 1:
        print("kvg-train: error: --pause-after must be at least 1", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.fresh:
        shutil.rmtree(run_dir / "checkpoint", ignore_errors=True)
    try:
        model = train(preset, run_dir, compile_loss=not args.no_compile, pause_after=args.pause_after)
    except ValueError as error:
        print(f"kvg-train: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if model is not None and args.publish:
        publish_to_preset(model, preset)
        print(f"kvg-train: {preset} now holds the weights of {model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
