"""`optimum-cli export onnx --model <FoX checkpoint or preset> --task text-generation-with-past OUT` runs kvg-export.

optimum-cli imports every module of the `optimum.commands.register` namespace; pyproject's package-dir installs
this folder as part of it. optimum-onnx 0.1.0 cannot export FoX's cache itself (its model patcher keeps two
cache tensors per layer, so the gate would be dropped) and its `onnx` command has no hook per model type, so
this module wraps the command's `run`: a FoX model goes to this project's exporter, which writes an artifact of
the project's contract (names, manifest, validation); any other model goes on to optimum's own export.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from optimum.commands.export.onnx import ONNXExportCommand

REGISTER_COMMANDS = []  # no command of its own: `export onnx` is wrapped below
FOX_MODEL_TYPE = "forgetting_transformer-project_fox"
TASKS = ("auto", "text-generation-with-past")
UNSUPPORTED = {"optimize": "--optimize", "monolith": "--monolith", "no_post_process": "--no-post-process"}


def is_fox(model: str) -> bool:
    """A FoX checkpoint folder, or the name of one of this project's presets."""
    config = Path(model) / "config.json"
    if config.is_file():
        return json.loads(config.read_text()).get("model_type") == FOX_MODEL_TYPE
    from kvg_export.presets import MODELS_DIR

    return (MODELS_DIR / model / "config.json").is_file()


def export_fox(args) -> int:
    """kvg-export with optimum-cli's arguments; its errors are printed as kvg-export prints them."""
    from exporters.pipeline.export import export_artifact
    from exporters.pipeline.options import ExportError, ExportOptions

    if args.task not in TASKS:
        return _refuse(
            f"--task {args.task}: a FoX artifact always carries its gated cache; use --task text-generation-with-past"
        )
    given = [flag for name, flag in UNSUPPORTED.items() if getattr(args, name, None)]
    if given:
        return _refuse(f"{', '.join(given)} do not apply to FoX exports (kvg-export fuses and validates its own graph)")
    options = ExportOptions(
        args.model, Path(args.output), dtype=args.dtype or "fp32", opset=args.opset,
        provider="cuda" if str(args.device).startswith("cuda") else "cpu",
    )  # fmt: skip
    try:
        result = export_artifact(options, log=lambda line: print(line, flush=True))
    except ExportError as error:
        return _refuse(str(error))
    print(f"\nartifact  {result.path} ({result.size_bytes / 1e6:.1f} MB), validated against eager PyTorch")
    return 0


def _refuse(message: str) -> int:
    print(f"optimum-cli export onnx (kvg-export): error: {message}", file=sys.stderr)
    return 2


def _run(self) -> None:
    if not is_fox(self.args.model):
        return _optimum_run(self)
    code = export_fox(self.args)
    if code:
        sys.exit(code)


_optimum_run, ONNXExportCommand.run = ONNXExportCommand.run, _run
