"""What `kvg-export` is asked, checked before any work: the export's options, the attention a graph gets by dtype and
provider, and the pruning and opset they allow. The pipeline (export.py) and the torch half (lowering.py) both read
them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from exporters.checks.validate import MIN_STATIC_LENGTH, References
from exporters.evaluation.evaluate import EagerRun, Thresholds
from exporters.native.library import NativeUnavailable, available, find
from exporters.quantization.settings import Quantization
from runtime.cache.pruning import check_tolerance
from runtime.contract import DEFAULT_OPSET, DYNAMIC_MAX_POSITIONS, held_in_place

AS_CONFIG = "config"  # --log-pruning-tolerance's default: the checkpoint config's log_pruning_tolerance
DTYPES = ("fp32", "fp16", "bf16")
ATTENTION_KINDS = ("auto", "standard", "fused", "gqa", "onnx-attention")
IN_PLACE_KINDS = ("fused", "gqa", "onnx-attention")  # attention ops that write keys and values into the bound buffer
OPSETS = range(18, 25)
ONNX_ATTENTION_OPSET = 24  # the first with TensorScatter and Attention's nonpad_kv_seqlen
DEFAULT_MAX_CACHE_LEN = 1024
DEFAULT_MAX_BATCH = 16
DEFAULT_QUALITY_SEGMENTS = 64  # segments of 512 tokens: about 33k predicted tokens


class ExportError(Exception):
    """A problem with what was asked, reported to the user as it is (no traceback)."""


@dataclass
class QualityOptions:
    """How a quantized export is judged: held-out text scored by eager fp32 and by the artifact."""

    thresholds: Thresholds | None = None  # None: QUALITY_THRESHOLDS for the bit width
    segments: int | None = DEFAULT_QUALITY_SEGMENTS  # None: the whole text
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
    # The torch half (load, trace, lower; exporters/pipeline/lowering.py) in a process of its own, so that its memory is
    # returned before onnxruntime's is taken. False runs it here: quicker for many small exports in one process
    # (the tests), which then keeps torch and what libraries hold of the model.
    separate_process: bool = True
    provider: str = "cpu"
    attention: str = "auto"  # auto, standard, fused, gqa or onnx-attention (see check_options)
    library: Path | None = None  # the fused attention operator's library, for a fused export (set by check_options)
    log_pruning_tolerance: float | str | None = AS_CONFIG  # a number, AS_CONFIG, or None: no pruning by default
    quantization: Quantization | None = None
    quality: QualityOptions = field(default_factory=QualityOptions)


@dataclass
class Lowered:
    """What the torch half (exporters/pipeline/lowering.py) hands back: the manifest (but for what is learned of the
    graph afterwards, exporters/checks/manifest.py's with_results), eager's record of the validation run, and eager
    fp32's
    scores on held-out text for a quantized export."""

    manifest: dict
    references: References
    eager: EagerRun | None


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

    The fused operator (exporters/native/fox_attention.cc) runs fp32 on the CPU, where its library can be built.
    GroupQueryAttention (gqa) appends to the cache buffer in place and takes the FoX bias: onnxruntime runs
    it on the CPU in fp32 and fp16 and on CUDA in fp16 and bf16, with no fp32 CUDA kernel. fp32 for CUDA
    attends through the ONNX Attention op over a static buffer that TensorScatter writes in place
    (onnx-attention); a dynamic cache there takes the standard graph, which copies the cache each step."""
    attention, dtype, cuda = options.attention, options.dtype, options.provider == "cuda"
    if attention not in ATTENTION_KINDS:
        raise ExportError(f"--attention must be one of {', '.join(ATTENTION_KINDS)}, not {attention!r}")
    if attention == "fused":
        if dtype != "fp32" or cuda:
            raise ExportError(
                "--attention fused runs fp32 on onnxruntime's CPU provider; use --attention gqa for fp16, or "
                "leave --attention out for CUDA"
            )
        try:
            options.library = find()
        except NativeUnavailable as error:
            raise ExportError(f"--attention fused: {error}; or export with --attention gqa") from None
        return attention
    if attention == "auto":
        if not cuda:
            options.library = available() if dtype == "fp32" else None  # which said why on stderr if not
            return "gqa" if options.library is None else "fused"
        if dtype != "fp32":
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
            "forget-gate pruning drops slots from a cache held in place: use --cache static or --attention fused "
            "or gqa, "
            "or --log-pruning-tolerance none"
        )


def _opset(options: ExportOptions) -> int:
    if options.attention != "onnx-attention":
        return options.opset or DEFAULT_OPSET
    if options.opset not in (None, ONNX_ATTENTION_OPSET):
        raise ExportError(
            f"--attention onnx-attention needs opset {ONNX_ATTENTION_OPSET} (TensorScatter, Attention with "
            f"nonpad_kv_seqlen), not {options.opset}; leave --opset out"
        )
    return ONNX_ATTENTION_OPSET
