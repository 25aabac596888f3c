"""What an export checks before it loads the model: everything that needs no traced graph, so that a request that
cannot succeed fails in seconds with the fix, not after minutes of tracing, lowering and validating (a 760M
model's export takes a few minutes before its quantization even starts).

Option combinations and the output path are `export.check_options`'s; here: the checkpoint, what a quantized
export's judgement needs (a tokenizer that fits the model, text to score), and the disk space the artifact takes.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

from exporters.evaluation.evaluate import EvalError, check_text_paths, check_tokenizer

ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
SAFETENSORS_HEADER = struct.Struct("<Q")
MARGIN = 1.1  # the graph, the manifest and the tokenizer besides the weights


class PreflightError(Exception):
    """A check before any work failed; its message names the fix."""


def preflight(checkpoint: Path, out: Path, dtype: str, quantized: bool, text_paths: list[Path] | None) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    if quantized:
        try:
            check_tokenizer(checkpoint, config["vocab_size"])
            check_text_paths(text_paths)
        except EvalError as error:
            raise PreflightError(f"a quantized export is judged on held-out text: {error}") from None
    check_space(out, artifact_bytes(checkpoint, dtype, quantized))


def parameters(checkpoint: Path) -> int | None:
    """The checkpoint's parameter count, from its safetensors headers alone (None: it has none)."""
    files = sorted(checkpoint.glob("*.safetensors"))
    count = 0
    for path in files:
        with path.open("rb") as file:
            (length,) = SAFETENSORS_HEADER.unpack(file.read(SAFETENSORS_HEADER.size))
            header = json.loads(file.read(length))
        for name, tensor in header.items():
            if name != "__metadata__":
                count += math.prod(tensor["shape"])
    return count if files else None


def artifact_bytes(checkpoint: Path, dtype: str, quantized: bool) -> int:
    """About what the export writes: its weights in `dtype` (a quantized export first writes the float graph it
    validates, then the quantized one beside it, at most as large)."""
    count = parameters(checkpoint)
    weights = (
        count * ELEMENT_BYTES[dtype]
        if count is not None
        else sum(path.stat().st_size for path in checkpoint.iterdir() if path.suffix in (".bin", ".pt", ".pth"))
    )
    return int(weights * (2 if quantized else 1) * MARGIN)


def check_space(out: Path, needed: int) -> None:
    folder = out.parent.resolve()
    while not folder.exists():  # the export creates the missing folders: the space is that of the first that is
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise PreflightError(
            f"the artifact needs about {needed / 2**30:.2f} GiB and {folder} has {free / 2**30:.2f} GiB free: free "
            "some space, or export elsewhere (--out)"
        )
