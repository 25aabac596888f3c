"""One export, start to finish: load, trace, lower, check, validate, then publish the artifact atomically.

The artifact is built in a hidden folder beside the output path and renamed into place only after
validation passes, so a failed or interrupted export never leaves a half-written artifact, and `force`
replaces an old artifact only with a good new one.

This process never imports torch. Loading, tracing and lowering, and eager's reference outputs, run in a
process of their own (exporters/pipeline/lowering.py, through exporters/pipeline/isolated.py) that ends before
onnxruntime checks, validates, quantizes and judges the graph here: the two halves' memory never adds up.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import onnx
import onnxruntime as ort

from exporters.checkpoint_tokenizer import CheckpointTokenizer, TokenizerError, read_tokenizer
from exporters.checks.cache_check import CacheCheck, check_cache
from exporters.checks.manifest import check_graph_matches, with_results
from exporters.checks.validate import ValidationReport, validate_onnx
from exporters.evaluation.evaluate import EagerRun, EvalError, Evaluation, Thresholds, evaluate
from exporters.native.library import companion_name, companions
from exporters.pipeline.isolated import IsolatedError, named, run_isolated
from exporters.pipeline.options import (
    ExportError,
    ExportOptions,
    check_options,
)
from exporters.pipeline.preflight import PreflightError, preflight
from exporters.pipeline.stages import stage
from exporters.progress import Progress
from exporters.quantization.settings import Quantization, QuantizationError
from kvg_export.fla_format import is_fla, official_config
from kvg_export.folders import publish, staging_folder
from kvg_export.presets import resolve_checkpoint
from runtime.contract import DEFAULT_OPSET, MANIFEST_NAME

# The checkpoint's files an artifact carries as they are: transformers reads them from the artifact folder too (a slow
# tokenizer's vocab.json and merges.txt as well, besides the tokenizer.json the runtime reads)
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")  # fmt: skip
REPORT_NAME = "validation.json"
# A quantized artifact must score held-out text nearly as eager fp32 does (relative perplexity difference,
# top-1 agreement). The trained presets measure int8 +0.02% and 99.1%, int4 +1.8% and 92% (bench/README.md).
QUALITY_THRESHOLDS = {8: Thresholds(0.005, 0.98), 4: Thresholds(0.05, 0.90)}
UNLEARNED_SHARE = 4  # eager perplexity above vocabulary / this: the model has not learned the text (random weights)
_NO_CUDA = (
    "--provider cuda: CUDA is not available to onnxruntime here (it needs onnxruntime-gpu and an NVIDIA GPU); "
    "export on such a machine, or use --provider cpu"
)


@dataclass
class ExportResult:
    path: Path
    size_bytes: int
    report: ValidationReport
    cache_check: CacheCheck | None = None
    quality: Evaluation | None = None


def _describe_pruning(pruning: dict | None) -> str:
    if pruning is None:
        return "none: this cache is not held in place (use --cache static or --attention fused or gqa to prune)"
    bounds = (
        f"score bounds from {pruning['bound']}, {min(map(min, pruning['score_bounds'])):.2f} to "
        f"{max(map(max, pruning['score_bounds'])):.2f}"
    )
    tolerance = pruning["log_pruning_tolerance"]
    if tolerance is None:
        return f"off by default ({bounds}; the runtime may prune at a tolerance it is given)"
    return f"the runtime drops cached keys weighing under e^{tolerance:g} in any later query ({bounds})"


def _cuda_usable() -> bool:
    """Whether onnxruntime can start its CUDA provider here: onnxruntime-gpu lists it on any machine and
    falls back to the CPU when the GPU or its libraries are missing, so a one-node session is asked."""
    identity = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Identity", ["x"], ["y"])], "probe",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
        ),
        opset_imports=[onnx.helper.make_opsetid("", DEFAULT_OPSET)], ir_version=10,
    )  # fmt: skip
    ort.set_default_logger_severity(4)  # the failure to start CUDA is what is asked, not an error to log
    try:
        session = ort.InferenceSession(identity.SerializeToString(), providers=_providers("cuda"))
    finally:
        ort.set_default_logger_severity(2)
    return "CUDAExecutionProvider" in session.get_providers()


def _providers(provider: str) -> list[str]:
    """Validation compares with eager in full precision: no TF32 in fp32 matmuls on CUDA."""
    if provider == "cuda":
        return [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def export_artifact(options: ExportOptions, log: Callable[[str], None] = print) -> ExportResult:
    """Export `options.model` to an artifact folder at `options.out`; raise ExportError on bad input or parity."""
    options = check_options(options)
    if options.provider == "cuda" and not _cuda_usable():
        raise ExportError(_NO_CUDA)
    try:
        checkpoint = resolve_checkpoint(options.model, build=False) or _isolated_or_here(
            options, "kvg_export.presets:resolve_checkpoint", options.model
        )  # building a preset's weights takes torch
        tokenizer = read_tokenizer(checkpoint)
        quantized = options.quantization is not None
        preflight(checkpoint, options.out, options.dtype, quantized, options.quality.text_paths)
    except (ValueError, FileNotFoundError, PreflightError, TokenizerError) as error:
        raise ExportError(str(error)) from None
    try:
        staging = staging_folder(options.out)
    except OSError as error:
        raise ExportError(f"cannot write to {options.out.parent}: {error.strerror or error}") from None
    try:
        result = _build(options, checkpoint, tokenizer, staging, log)
        publish(staging, options.out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    result.path = options.out
    return result


# transformers imports scikit-learn wherever it is installed (the lm-eval extra brings it), for assisted generation
# alone, which an export never runs: left out, the torch half's peak is 0.1 GB lower
ABSENT_WHEN_ISOLATED = ("sklearn",)


def _isolated_or_here(options: ExportOptions, target: str, *args, **kwargs):
    """`module:function`(*args) in a process of its own (exporters.pipeline.isolated); without
    options.separate_process, here."""
    if options.separate_process:
        return run_isolated(target, *args, absent=ABSENT_WHEN_ISOLATED, **kwargs)
    return named(target)(*args, **kwargs)


def _float_graph(
    options: ExportOptions, checkpoint: Path, tokenizer: CheckpointTokenizer | None, model_path: Path,
    log: Callable[[str], None],
) -> tuple[dict, ValidationReport, EagerRun | None]:  # fmt: skip
    """The float graph at `model_path`, made by the torch half in a process of its own, then checked and
    validated here; returns its manifest (with the validation's summary), the validation and eager's scores on
    held-out text (quantized only)."""
    try:
        lowered = _isolated_or_here(
            options, "exporters.pipeline.lowering:lower", options, checkpoint, tokenizer, model_path, log=log
        )
    except IsolatedError as error:
        raise ExportError(f"loading, tracing and lowering the model failed: {error}") from None
    manifest = lowered.manifest
    stage(
        log, "check", lambda _: _check(model_path, manifest, options.opset),
        lambda _: "onnx.checker (full), graph inputs and outputs against the manifest",
    )  # fmt: skip
    try:
        quiet = ort.SessionOptions()
        quiet.log_severity_level = 3  # the validation's separate past and present make TensorScatter warn it copies
        if options.library is not None:
            quiet.register_custom_ops_library(str(options.library))
        session = ort.InferenceSession(str(model_path), quiet, providers=_providers(options.provider))
    except Exception as error:  # onnxruntime raises its own exception types for graphs it cannot run
        raise ExportError(f"onnxruntime cannot run the exported graph (opset {options.opset}): {error}") from None
    if options.provider == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        raise ExportError(_NO_CUDA)
    references = lowered.references
    report = stage(
        log, "validate", lambda progress: validate_onnx(references, session, progress),
        lambda r: f"onnxruntime vs eager's record: prefill + {r.decode_steps} greedy steps, batch {r.batch}"
        + (" (also with longer buffers, as the runtime runs it)" if "onnx-longer" in references.starts else "")
        + ("; then with each layer's heads staggered, as pruning runs it" if references.staggered else ""),
    )  # fmt: skip
    log(report.table())
    if not report.passed:
        raise ExportError(f"validation failed: {report.failure}; nothing was written to {options.out}")
    log(f"pruning   {_describe_pruning(manifest['pruning'])}")
    return with_results(manifest, validation=report.summary()), report, lowered.eager


def _build(
    options: ExportOptions, checkpoint: Path, tokenizer: CheckpointTokenizer | None, staging: Path,
    log: Callable[[str], None],
) -> ExportResult:  # fmt: skip
    quantization = options.quantization
    # A quantized export validates its float graph first, in a folder of its own, then quantizes it.
    float_folder = staging / "float" if quantization else staging
    float_folder.mkdir(exist_ok=True)
    manifest, report, eager = _float_graph(options, checkpoint, tokenizer, float_folder / "model.onnx", log)
    for name in COPIED_FILES:
        if (checkpoint / name).is_file():
            shutil.copy2(checkpoint / name, staging / name)
    if tokenizer is not None:  # the runtime's, which a slow tokenizer's files are built into
        tokenizer.bpe().save(str(staging / manifest["files"]["tokenizer"]))
    if options.library is not None:  # the fused attention operator travels with its graph, for each CPU level
        shutil.copy2(options.library, staging / options.library.name)
        for tag, companion in companions(options.library).items():
            shutil.copy2(companion, staging / companion_name(tag))
    config = json.loads((checkpoint / "config.json").read_text())
    if is_fla(config):  # the artifact is the official FoX the checkpoint maps onto, as transformers loads it
        (staging / "config.json").write_text(json.dumps(official_config(config), indent=2) + "\n")
    result = ExportResult(staging, 0, report)
    reports = {"parity": report.to_json()}
    if quantization:
        record = stage(
            log, "quantize", lambda progress: _quantize(float_folder, staging, quantization, progress),
            lambda record: f"{quantization.name} MatMulNBits ({quantization.method}, block {quantization.block_size}, "
            f"accuracy level {quantization.accuracy_level}): {len(record['quantized_nodes'])} nodes quantized, "
            f"{len(record['float_nodes'])} kept in float",
        )  # fmt: skip
        shutil.rmtree(float_folder)
        manifest = with_results(manifest, quantization=record)
        _check(staging / "model.onnx", manifest, options.opset)
        _write_manifest(staging, manifest)  # the runtime opens the staged artifact to judge it
        result.cache_check, result.quality = _judge_quantized(
            options, staging, eager, manifest["model"]["vocab_size"], log
        )
        manifest = with_results(manifest, quality=_quality_summary(result.quality))
        reports |= {"quantization": record, "cache_check": result.cache_check.to_json(),
                    "quality": result.quality.to_json()}  # fmt: skip
    _write_manifest(staging, manifest)
    (staging / REPORT_NAME).write_text(json.dumps(reports if quantization else report.to_json(), indent=2) + "\n")
    result.size_bytes = sum(p.stat().st_size for p in staging.iterdir())
    return result


def _write_manifest(staging: Path, manifest: dict) -> None:
    """The manifest, as the runtime reads it."""
    (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def _check(model_path: Path, manifest: dict, opset: int) -> None:
    try:
        onnx.checker.check_model(str(model_path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        raise ExportError(
            f"the exported graph fails onnx.checker at opset {opset}: {error}; "
            f"opset {DEFAULT_OPSET} is the safe default"
        ) from None
    try:
        check_graph_matches(model_path, manifest)
    except ValueError as error:
        raise ExportError(str(error)) from None


def _quantize(float_folder: Path, staging: Path, quantization: Quantization, progress: Progress) -> dict:
    # Imported here: what quantizing imports (onnx_ir, and sympy with it) would otherwise be held in this process
    # all the while the torch half runs, which is the export's peak
    from exporters.quantization.quantize import quantize_graph

    try:
        return quantize_graph(float_folder / "model.onnx", staging / "model.onnx", quantization, progress)
    except QuantizationError as error:
        raise ExportError(str(error)) from None


def _judge_quantized(
    options: ExportOptions, staging: Path, eager: EagerRun, vocab: int, log: Callable[[str], None]
) -> tuple[CacheCheck, Evaluation]:
    """The cache checks, then held-out text through the artifact against eager fp32's scores (made by the torch
    half); raise ExportError on a miss."""
    cache = stage(
        log, "cache", lambda _: check_cache(staging, min(2, options.max_batch)),
        lambda c: f"runtime (cache bound in place) vs session.run: prefill + {c.decode_steps} steps, "
        f"{c.presents_checked} present tensors' shapes, logits max |Δ| {c.max_logits_diff:.2e}",
    )  # fmt: skip
    if not cache.passed:
        raise ExportError(f"cache check failed: {cache.failure}; nothing was written to {options.out}")
    quality = options.quality
    thresholds = quality.thresholds or QUALITY_THRESHOLDS[options.quantization.bits]
    try:
        evaluation = stage(
            log, "quality", lambda progress: evaluate(options.model, staging, text_paths=quality.text_paths,
                                                      max_segments=quality.segments, thresholds=thresholds, eager=eager,
                                                      progress=progress),
            lambda e: f"the artifact vs eager fp32 on {e.segments} segments of held-out text "
            f"({e.predicted_tokens:,} tokens predicted)",
        )  # fmt: skip
    except EvalError as error:
        raise ExportError(f"a quantized export is judged on held-out text: {error}") from None
    evaluation.artifact.name = str(options.out)  # where it is published, not the staging folder it was judged in
    log(evaluation.table())
    if evaluation.failures:
        untrained = evaluation.eager.perplexity > vocab / UNLEARNED_SHARE
        raise ExportError(
            f"the {options.quantization.name} artifact misses its quality thresholds: "
            f"{'; '.join(evaluation.failures)}. Nothing was written to {options.out}; "
            + (
                f"eager fp32's own perplexity on this text is {evaluation.eager.perplexity:,.0f} for a vocabulary of "
                f"{vocab:,}: the model has not learned it, so its top-1 ranking is noise. Judge it on text it was "
                "trained on (--quality-text), or on perplexity alone (--min-agreement 0)"
                if untrained
                else "try a smaller --block-size, another --quant-method, more of the model in float (--keep-float) "
                "or int8"
            )
        )
    return cache, evaluation


def _quality_summary(evaluation: Evaluation) -> dict:
    return {
        "eager_perplexity": evaluation.eager.perplexity,
        "artifact_perplexity": evaluation.artifact.perplexity,
        "relative_perplexity_diff": evaluation.relative_perplexity_diff,
        "top1_agreement": evaluation.top1_agreement,
        "predicted_tokens": evaluation.predicted_tokens,
        "thresholds": asdict(evaluation.thresholds),
    }
