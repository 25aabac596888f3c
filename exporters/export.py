"""One export, start to finish: load, trace, lower, check, validate, then publish the artifact atomically.

The artifact is built in a hidden folder beside the output path and renamed into place only after
validation passes, so a failed or interrupted export never leaves a half-written artifact, and `force`
replaces an old artifact only with a good new one.
"""

from __future__ import annotations

import gc
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path

import onnx
import onnxruntime as ort
import torch

from exporters.cache_check import CacheCheck, check_cache
from exporters.contract import cache_layout
from exporters.evaluate import EvalError, Evaluation, Thresholds, evaluate
from exporters.manifest import MANIFEST_NAME, build_manifest, check_graph_matches, source_digest
from exporters.onnx_export import DEFAULT_OPSET, DYNAMIC_MAX_POSITIONS, export_program, lower_to_onnx
from exporters.preflight import PreflightError, preflight
from exporters.quantize import Quantization, QuantizationError, quantize_graph
from exporters.validate import MIN_STATIC_LENGTH, ValidationReport, validate_export
from kvg_export.folders import publish, staging_folder
from kvg_export.fox.pruning import bound_kind, score_bounds
from kvg_export.presets import load_model, resolve_checkpoint
from runtime.device_cache import held_in_place
from runtime.pruning import check_tolerance

AS_CONFIG = "config"  # --log-pruning-tolerance's default: the checkpoint config's log_pruning_tolerance
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ATTENTION_KINDS = ("auto", "standard", "gqa", "onnx-attention")
IN_PLACE_KINDS = ("gqa", "onnx-attention")  # attention ops that write keys and values into the bound buffer
OPSETS = range(18, 25)
ONNX_ATTENTION_OPSET = 24  # the first with TensorScatter and Attention's nonpad_kv_seqlen
DEFAULT_MAX_CACHE_LEN = 1024
DEFAULT_MAX_BATCH = 16
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja")  # fmt: skip
REPORT_NAME = "validation.json"
# A quantized artifact must score held-out text nearly as eager fp32 does (relative perplexity difference,
# top-1 agreement). The trained presets measure int8 +0.02% and 99.1%, int4 +1.8% and 92% (bench/README.md).
QUALITY_THRESHOLDS = {8: Thresholds(0.005, 0.98), 4: Thresholds(0.05, 0.90)}
DEFAULT_QUALITY_WINDOWS = 64  # windows of 512 tokens: about 33k predicted tokens
UNLEARNED_SHARE = 4  # eager perplexity above vocabulary / this: the model has not learned the text (random weights)
_NO_CUDA = (
    "--provider cuda: CUDA is not available to onnxruntime here (it needs onnxruntime-gpu and an NVIDIA GPU); "
    "export on such a machine, or use --provider cpu"
)


class ExportError(Exception):
    """A problem with what was asked, reported to the user as it is (no traceback)."""


@dataclass
class QualityOptions:
    """How a quantized export is judged: held-out text scored by eager fp32 and by the artifact."""

    thresholds: Thresholds | None = None  # None: QUALITY_THRESHOLDS for the bit width
    windows: int | None = DEFAULT_QUALITY_WINDOWS  # None: the whole text
    text_paths: list[Path] | None = None  # None: the stdlib corpus's test split


@dataclass
class ExportOptions:
    model: str
    out: Path
    cache: str = "dynamic"
    dtype: str = "fp32"
    max_cache_len: int | None = None
    max_batch: int = DEFAULT_MAX_BATCH
    opset: int | None = None  # None: DEFAULT_OPSET, or ONNX_ATTENTION_OPSET for onnx-attention
    force: bool = False
    provider: str = "cpu"
    attention: str = "auto"  # auto, standard or gqa (see check_options)
    log_pruning_tolerance: float | str | None = AS_CONFIG  # a number, AS_CONFIG, or None: no pruning by default
    quantization: Quantization | None = None
    quality: QualityOptions = field(default_factory=QualityOptions)


@dataclass
class ExportResult:
    path: Path
    size_bytes: int
    report: ValidationReport
    cache_check: CacheCheck | None = None
    quality: Evaluation | None = None


def check_options(options: ExportOptions) -> ExportOptions:
    """Refuse what cannot work before any work is done; fill in the static default length."""
    if options.cache not in ("dynamic", "static"):
        raise ExportError(f"--cache must be dynamic or static, not {options.cache!r}")
    if options.dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(DTYPES)}, not {options.dtype!r}")
    if options.opset is not None and options.opset not in OPSETS:
        raise ExportError(f"--opset {options.opset} is not supported; choose {OPSETS.start}..{OPSETS.stop - 1}")
    if options.max_batch < 1:
        raise ExportError(f"--max-batch must be at least 1, got {options.max_batch}")
    limited = options.cache == "dynamic" and options.max_cache_len is not None  # a limit the runtime enforces
    if limited and not 1 <= options.max_cache_len <= DYNAMIC_MAX_POSITIONS:
        raise ExportError(
            f"--max-cache-len of a dynamic cache must be 1..{DYNAMIC_MAX_POSITIONS:,} (the positions its graph is "
            f"traced for), got {options.max_cache_len}"
        )
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
    if options.quantization and options.provider != "cpu":
        raise ExportError(
            "a quantized export is judged on onnxruntime's CPU provider (its cache checks and held-out text); "
            "export it with --provider cpu"
        )
    options.attention = _attention(options)
    _check_pruning(options)
    options.opset = _opset(options)
    out = options.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not options.force:
        raise ExportError(f"{out} already exists and is not empty; pass --force to replace it")
    return options


def _attention(options: ExportOptions) -> str:
    """How the graph attends, by dtype and the provider it is exported for; see the --attention help.

    GroupQueryAttention (gqa) appends to the cache buffer in place and takes the FoX bias: onnxruntime runs
    it on the CPU in fp32 and fp16 and on CUDA in fp16 and bf16, with no fp32 CUDA kernel. fp32 for CUDA
    attends through the ONNX Attention op over a static buffer that TensorScatter writes in place
    (onnx-attention); a dynamic cache there takes the standard graph, which copies the cache each step."""
    attention, dtype, cuda = options.attention, options.dtype, options.provider == "cuda"
    if attention not in ATTENTION_KINDS:
        raise ExportError(f"--attention must be one of {', '.join(ATTENTION_KINDS)}, not {attention!r}")
    if attention == "auto":
        if dtype != "fp32" or not cuda:
            return "gqa"
        return "onnx-attention" if options.cache == "static" else "standard"
    if attention == "gqa" and dtype == "fp32" and cuda:
        raise ExportError(
            "--attention gqa has no fp32 kernel on CUDA (onnxruntime runs GroupQueryAttention there in fp16 and "
            "bf16 only); use --dtype fp16, or --attention onnx-attention with --cache static"
        )
    if attention == "onnx-attention" and options.cache != "static":
        raise ExportError(
            "--attention onnx-attention writes a buffer of fixed length (TensorScatter); use it with --cache static"
        )
    return attention


def _check_pruning(options: ExportOptions) -> None:
    """A tolerance asked for must be one the runtime can prune at, with a cache it can prune."""
    if options.log_pruning_tolerance in (None, AS_CONFIG):
        return
    try:
        check_tolerance(options.log_pruning_tolerance)
    except ValueError as error:
        raise ExportError(f"--log-pruning-tolerance: {error}") from None
    if not held_in_place(options.cache == "static", options.attention):
        raise ExportError(
            "forget-gate pruning drops slots from a cache held in place: use --cache static or --attention gqa, "
            "or --log-pruning-tolerance none"
        )


def _pruning(options: ExportOptions, model) -> dict | None:
    """The manifest's pruning record: the tolerance the runtime prunes at by default (None: it does not) and the
    score bounds it prunes with at any tolerance; None for a cache the runtime cannot prune."""
    if not held_in_place(options.cache == "static", options.attention):
        return None
    tolerance = options.log_pruning_tolerance
    if tolerance == AS_CONFIG:
        tolerance = model.config.log_pruning_tolerance
    try:
        if tolerance is not None:
            check_tolerance(tolerance)  # an explicit one was checked before the load; the config's is checked here
    except ValueError as error:
        raise ExportError(
            f"the checkpoint's config.json: {error}; fix it there, or override it with --log-pruning-tolerance"
        ) from None
    return {"log_pruning_tolerance": tolerance, "score_bounds": score_bounds(model), "bound": bound_kind(model.config)}


def _describe_pruning(pruning: dict | None) -> str:
    if pruning is None:
        return "none: this cache is not held in place (use --cache static or --attention gqa to prune)"
    bounds = (
        f"score bounds from {pruning['bound']}, {min(map(min, pruning['score_bounds'])):.2f} to "
        f"{max(map(max, pruning['score_bounds'])):.2f}"
    )
    tolerance = pruning["log_pruning_tolerance"]
    if tolerance is None:
        return f"off by default ({bounds}; the runtime may prune at a tolerance it is given)"
    return f"the runtime drops cached keys weighing under e^{tolerance:g} in any later query ({bounds})"


def _opset(options: ExportOptions) -> int:
    if options.attention != "onnx-attention":
        return options.opset or DEFAULT_OPSET
    if options.opset not in (None, ONNX_ATTENTION_OPSET):
        raise ExportError(
            f"--attention onnx-attention needs opset {ONNX_ATTENTION_OPSET} (TensorScatter, Attention with "
            f"nonpad_kv_seqlen), not {options.opset}; leave --opset out"
        )
    return ONNX_ATTENTION_OPSET


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
        checkpoint = resolve_checkpoint(options.model)
        quantized = options.quantization is not None
        preflight(checkpoint, options.out, options.dtype, quantized, options.quality.text_paths)
    except (ValueError, FileNotFoundError, PreflightError) as error:
        raise ExportError(str(error)) from None
    try:
        staging = staging_folder(options.out)
    except OSError as error:
        raise ExportError(f"cannot write to {options.out.parent}: {error.strerror or error}") from None
    try:
        result = _build(options, checkpoint, staging, log)
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


def _float_graph(
    options: ExportOptions, checkpoint: Path, model_path: Path, log: Callable[[str], None]
) -> tuple[dict, ValidationReport]:
    """Load, trace, lower, check and validate the float graph at `model_path`; returns its manifest and the
    validation. The torch model and the validating session live only here, so a quantized export goes on
    without them (but for the torch weights that onnxscript 0.7's rewrite rules keep reachable until the next
    export: they hold the last node each rule looked at, and through it the lowered graph)."""
    model = _stage(
        log, "load", lambda: load_model(checkpoint, dtype=DTYPES[options.dtype]),
        lambda m: f"{options.model}: {sum(p.numel() for p in m.parameters()):,} parameters, {options.dtype}",
    )  # fmt: skip
    layout = cache_layout(model.config, static=options.cache == "static")
    in_place = options.attention in IN_PLACE_KINDS
    pruning = _pruning(options, model)
    offsets = in_place and pruning is not None and pruning["log_pruning_tolerance"] is not None  # each layer's own
    program, example = _stage(
        log, "trace",
        lambda: export_program(model, layout, options.max_cache_len, options.max_batch, in_place, offsets),
        lambda _: f"torch.export, {options.cache} cache, {options.attention} attention"
        + (", layer windows for forget-gate pruning" if offsets else ""),
    )  # fmt: skip
    keep_apart = options.quantization.keeps if options.quantization else lambda module: False
    _stage(
        log, "lower", lambda: lower_to_onnx(program, example, layout, model_path, options.opset, keep_apart,
                                        options.attention, offsets),
        lambda fused: f"ONNX opset {options.opset}, {fused[0]} fewer MatMuls (projections joined), "
        f"{fused[1]} residual adds joined with their norms, forget-gate rewrites {-fused[2]:+d} nodes"
        + (f", {fused[3]} gate writes in place in a long enough buffer" if fused[3] else "")
        + ", weights memory-mappable in model.onnx.data",
    )  # fmt: skip
    files = {name: name for name in COPIED_FILES if (checkpoint / name).is_file()}
    manifest = build_manifest(
        model.config, layout, dtype=str(model.dtype).removeprefix("torch."), opset=options.opset,
        max_cache_len=options.max_cache_len, max_batch=options.max_batch, attention=options.attention,
        source=str(options.model),
        source_sha256=source_digest(checkpoint), exporter_version=version("kvg-export"),
        files={"model": "model.onnx", "tokenizer": files.get("tokenizer.json")}, window_offsets=offsets,
    )  # fmt: skip
    _stage(
        log, "check", lambda: _check(model_path, manifest, options.opset),
        lambda _: "onnx.checker (full), graph inputs and outputs against the manifest",
    )  # fmt: skip
    try:
        quiet = ort.SessionOptions()
        quiet.log_severity_level = 3  # the validation's separate past and present make TensorScatter warn it copies
        session = ort.InferenceSession(str(model_path), quiet, providers=_providers(options.provider))
    except Exception as error:  # onnxruntime raises its own exception types for graphs it cannot run
        raise ExportError(f"onnxruntime cannot run the exported graph (opset {options.opset}): {error}") from None
    if options.provider == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        raise ExportError(_NO_CUDA)
    batch, longer_buffers = min(2, options.max_batch), in_place and not layout.static  # only gqa is dynamic
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
    manifest["pruning"] = pruning
    log(f"pruning   {_describe_pruning(manifest['pruning'])}")
    return manifest, report


def _build(options: ExportOptions, checkpoint: Path, staging: Path, log: Callable[[str], None]) -> ExportResult:
    quantization = options.quantization
    # A quantized export validates its float graph first, in a folder of its own, then quantizes it.
    float_folder = staging / "float" if quantization else staging
    float_folder.mkdir(exist_ok=True)
    manifest, report = _float_graph(options, checkpoint, float_folder / "model.onnx", log)
    gc.collect()  # the torch model's and the exporter's reference cycles: quantizing and judging need the memory
    for name in COPIED_FILES:
        if (checkpoint / name).is_file():
            shutil.copy2(checkpoint / name, staging / name)
    result = ExportResult(staging, 0, report)
    reports = {"parity": report.to_json()}
    if quantization:
        manifest["quantization"] = _stage(
            log, "quantize", lambda: _quantize(float_folder, staging, quantization),
            lambda record: f"{quantization.name} MatMulNBits ({quantization.method}, block {quantization.block_size}, "
            f"accuracy level {quantization.accuracy_level}): {len(record['quantized_nodes'])} nodes quantized, "
            f"{len(record['float_nodes'])} kept in float",
        )  # fmt: skip
        shutil.rmtree(float_folder)
        _check(staging / "model.onnx", manifest, options.opset)
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")  # the runtime opens it to judge
        result.cache_check, result.quality = _judge_quantized(options, staging, manifest["model"]["vocab_size"], log)
        manifest["validation"] |= {"quality": _quality_summary(result.quality)}
        reports |= {"quantization": manifest["quantization"], "cache_check": result.cache_check.to_json(),
                    "quality": result.quality.to_json()}  # fmt: skip
    (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    (staging / REPORT_NAME).write_text(json.dumps(reports if quantization else report.to_json(), indent=2) + "\n")
    result.size_bytes = sum(p.stat().st_size for p in staging.iterdir())
    return result


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


def _quantize(float_folder: Path, staging: Path, quantization: Quantization) -> dict:
    try:
        return quantize_graph(float_folder / "model.onnx", staging / "model.onnx", quantization)
    except QuantizationError as error:
        raise ExportError(str(error)) from None


def _judge_quantized(
    options: ExportOptions, staging: Path, vocab: int, log: Callable[[str], None]
) -> tuple[CacheCheck, Evaluation]:
    """The cache checks, then held-out text through eager fp32 and the artifact; raise ExportError on a miss."""
    cache = _stage(
        log, "cache", lambda: check_cache(staging, min(2, options.max_batch)),
        lambda c: f"runtime (cache bound in place) vs session.run: prefill + {c.decode_steps} steps, "
        f"{c.presents_checked} present tensors' shapes, logits max |Δ| {c.max_logits_diff:.2e}",
    )  # fmt: skip
    if not cache.passed:
        raise ExportError(f"cache check failed: {cache.failure}; nothing was written to {options.out}")
    quality = options.quality
    thresholds = quality.thresholds or QUALITY_THRESHOLDS[options.quantization.bits]
    try:
        evaluation = _stage(
            log, "quality", lambda: evaluate(options.model, staging, text_paths=quality.text_paths,
                                             max_windows=quality.windows, thresholds=thresholds),
            lambda e: f"eager fp32 vs the artifact on {e.windows} windows of held-out text "
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
