"""One export, start to finish: load, trace, lower, check, validate, then publish the artifact atomically.

The artifact is built in a hidden folder beside the output path and renamed into place only after
validation passes, so a failed or interrupted export never leaves a half-written artifact, and `force`
replaces an old artifact only with a good new one.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import onnx
import onnxruntime as ort
import torch

from exporters.contract import cache_layout
from exporters.manifest import MANIFEST_NAME, build_manifest, check_graph_matches, source_digest
from exporters.onnx_export import DEFAULT_OPSET, export_program, lower_to_onnx
from exporters.validate import MIN_STATIC_LENGTH, ValidationReport, validate_export
from kvg_export.folders import publish, staging_folder
from kvg_export.presets import load_model, resolve_checkpoint

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ATTENTION_KINDS = ("auto", "standard", "gqa")
OPSETS = range(18, 24)
DEFAULT_MAX_CACHE_LEN = 1024
DEFAULT_MAX_BATCH = 16
EXTERNAL_DATA_BYTES = 1 << 30  # weights above this go to model.onnx.data; protobuf's limit is 2 GB
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json")  # fmt: skip
REPORT_NAME = "validation.json"


class ExportError(Exception):
    """A problem with what was asked, reported to the user as it is (no traceback)."""


@dataclass
class ExportOptions:
    model: str
    out: Path
    cache: str = "dynamic"
    dtype: str = "fp32"
    max_cache_len: int | None = None
    max_batch: int = DEFAULT_MAX_BATCH
    opset: int = DEFAULT_OPSET
    force: bool = False
    provider: str = "cpu"
    attention: str = "auto"  # auto, standard or gqa (see check_options)


@dataclass
class ExportResult:
    path: Path
    size_bytes: int
    report: ValidationReport


def check_options(options: ExportOptions) -> ExportOptions:
    """Refuse what cannot work before any work is done; fill in the static default length."""
    if options.cache not in ("dynamic", "static"):
        raise ExportError(f"--cache must be dynamic or static, not {options.cache!r}")
    if options.dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(DTYPES)}, not {options.dtype!r}")
    if options.opset not in OPSETS:
        raise ExportError(f"--opset {options.opset} is not supported; choose {OPSETS.start}..{OPSETS.stop - 1}")
    if options.max_batch < 1:
        raise ExportError(f"--max-batch must be at least 1, got {options.max_batch}")
    if options.cache == "dynamic" and options.max_cache_len is not None:
        raise ExportError("--max-cache-len applies to --cache static only; a dynamic cache grows as needed")
    if options.cache == "static":
        options.max_cache_len = options.max_cache_len or DEFAULT_MAX_CACHE_LEN
        if options.max_cache_len < MIN_STATIC_LENGTH:
            raise ExportError(
                f"--max-cache-len must be at least {MIN_STATIC_LENGTH} (the validation's prompt and steps)"
            )
    if options.provider not in ("cpu", "cuda"):
        raise ExportError(f"--provider must be cpu or cuda, not {options.provider!r}")
    if options.dtype == "bf16" and options.provider == "cpu":
        raise ExportError(
            "bf16 graphs cannot be validated on onnxruntime's CPU provider (it has no bf16 MatMul); "
            "export bf16 on a CUDA machine with --provider cuda, or use --dtype fp16"
        )
    options.attention = _attention(options)
    out = options.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not options.force:
        raise ExportError(f"{out} already exists and is not empty; pass --force to replace it")
    return options


def _attention(options: ExportOptions) -> str:
    """How the graph attends. "gqa", onnxruntime's GroupQueryAttention reading the cache buffer in place,
    is the fast path on the CPU provider, where it is validated; "standard" ONNX ops run everywhere.
    `auto` picks gqa for fp32 exports validated on the CPU."""
    if options.attention not in ATTENTION_KINDS:
        raise ExportError(f"--attention must be one of {', '.join(ATTENTION_KINDS)}, not {options.attention!r}")
    if options.attention == "auto":
        return "gqa" if options.dtype == "fp32" and options.provider == "cpu" else "standard"
    if options.attention == "gqa" and options.provider != "cpu":
        raise ExportError(
            "--attention gqa needs --provider cpu: its attention bias is validated on onnxruntime's CPU provider "
            "only; use --attention standard"
        )
    return options.attention


def _providers(provider: str) -> list[str]:
    """Validation compares with eager in full precision: no TF32 in fp32 matmuls on CUDA."""
    if provider == "cuda":
        return [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def export_artifact(options: ExportOptions, log: Callable[[str], None] = print) -> ExportResult:
    """Export `options.model` to an artifact folder at `options.out`; raise ExportError on bad input or parity."""
    options = check_options(options)
    try:
        staging = staging_folder(options.out)
    except OSError as error:
        raise ExportError(f"cannot write to {options.out.parent}: {error.strerror or error}") from None
    try:
        result = _build(options, staging, log)
        publish(staging, options.out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    result.path = options.out
    return result


def _stage(log: Callable[[str], None], name: str, work: Callable, describe: Callable[..., str]):
    """Run one stage and log one line: its name, its wall time and `describe(result)`."""
    start = time.perf_counter()
    value = work()
    log(f"{name:<9} {time.perf_counter() - start:6.1f} s  {describe(value)}")
    return value


def _build(options: ExportOptions, staging: Path, log: Callable[[str], None]) -> ExportResult:
    try:
        checkpoint = resolve_checkpoint(options.model)
    except (ValueError, FileNotFoundError) as error:
        raise ExportError(str(error)) from None
    model = _stage(
        log, "load", lambda: load_model(checkpoint, dtype=DTYPES[options.dtype]),
        lambda m: f"{options.model}: {sum(p.numel() for p in m.parameters()):,} parameters, {options.dtype}",
    )  # fmt: skip
    layout = cache_layout(model.config, static=options.cache == "static")
    in_place = options.attention == "gqa"
    program, example = _stage(
        log, "trace", lambda: export_program(model, layout, options.max_cache_len, options.max_batch, in_place),
        lambda _: f"torch.export, {options.cache} cache, {options.attention} attention",
    )  # fmt: skip
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model_path = staging / "model.onnx"
    external = weight_bytes > EXTERNAL_DATA_BYTES
    _stage(
        log, "lower", lambda: lower_to_onnx(program, example, layout, model_path, options.opset, external),
        lambda joined: f"ONNX opset {options.opset}, {joined} fewer MatMuls (projections joined)"
        + (", weights as external data" if external else ""),
    )  # fmt: skip
    files = {name: name for name in COPIED_FILES if (checkpoint / name).is_file()}
    manifest = build_manifest(
        model.config, layout, dtype=str(model.dtype).removeprefix("torch."), opset=options.opset,
        max_cache_len=options.max_cache_len, max_batch=options.max_batch, attention=options.attention,
        source=str(options.model),
        source_sha256=source_digest(checkpoint), exporter_version=version("kvg-export"),
        files={"model": "model.onnx", "tokenizer": files.get("tokenizer.json")},
    )  # fmt: skip

    def check() -> None:
        try:
            onnx.checker.check_model(str(model_path), full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
            raise ExportError(
                f"the exported graph fails onnx.checker at opset {options.opset}: {error}; "
                f"opset {DEFAULT_OPSET} is the safe default"
            ) from None
        try:
            check_graph_matches(model_path, manifest)
        except ValueError as error:
            raise ExportError(str(error)) from None

    _stage(log, "check", check, lambda _: "onnx.checker (full), graph inputs and outputs against the manifest")
    try:
        session = ort.InferenceSession(str(model_path), providers=_providers(options.provider))
    except Exception as error:  # onnxruntime raises its own exception types for graphs it cannot run
        raise ExportError(f"onnxruntime cannot run the exported graph (opset {options.opset}): {error}") from None
    if options.provider == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        raise ExportError("--provider cuda: CUDA is not available to onnxruntime here; use --provider cpu")
    batch, longer_buffers = min(2, options.max_batch), in_place and not layout.static
    report = _stage(
        log, "validate",
        lambda: validate_export(model, layout, program, session, options.max_cache_len, batch, longer_buffers),
        lambda r: f"eager vs ExportedProgram vs onnxruntime: prefill + {r.decode_steps} greedy steps, batch {batch}"
        + (" (onnxruntime also with longer buffers, as the runtime runs it)" if longer_buffers else ""),
    )  # fmt: skip
    log(report.table())
    if not report.passed:
        raise ExportError(f"validation failed: {report.failure}; nothing was written to {options.out}")
    manifest["validation"] = report.summary()
    for name in files:
        shutil.copy2(checkpoint / name, staging / name)
    (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    (staging / REPORT_NAME).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    size = sum(p.stat().st_size for p in staging.iterdir())
    return ExportResult(staging, size, report)
