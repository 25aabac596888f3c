"""An export's torch half: load the checkpoint, trace it, lower it to ONNX, and record what the graph is judged
against (eager's validation run; for a quantized export, eager fp32's scores on held-out text).

export.py runs `lower` in a process of its own (exporters.pipeline.isolated), so that torch, the model and what the
lowering leaves behind are gone before onnxruntime validates and quantizes: the export's peak memory is then
the larger of the two halves, not their sum.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import torch

from exporters.checkpoint_tokenizer import FAST_FILE, CheckpointTokenizer
from exporters.checks.manifest import build_manifest, source_digest
from exporters.checks.references import record
from exporters.checks.validate import DECODE_STEPS
from exporters.evaluation.evaluate import DEFAULT_CONTEXT, EagerRun, EvalError, run_eager
from exporters.graph import passes
from exporters.graph.onnx_export import export_program, lower_to_onnx
from exporters.native.library import manifest_entry
from exporters.pipeline.options import AS_CONFIG, IN_PLACE_KINDS, ExportError, ExportOptions, Lowered
from exporters.pipeline.preflight import parameters
from exporters.pipeline.stages import stage
from exporters.progress import Progress
from kvg_export.fox.pruning import bound_kind, score_bounds
from kvg_export.presets import load_model
from runtime.cache.pruning import check_tolerance
from runtime.contract import cache_layout, held_in_place

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def lower(
    options: ExportOptions, checkpoint: Path, tokenizer: CheckpointTokenizer | None, model_path: Path,
    log: Callable[[str], None],
) -> Lowered:  # fmt: skip
    """Write the float graph to `model_path` and record eager's outputs on the validation's inputs; `tokenizer`: what
    the manifest says of the checkpoint's (exporters/checkpoint_tokenizer.py)."""
    count = parameters(checkpoint)
    model = stage(
        log, "load", lambda _: load_model(checkpoint, dtype=TORCH_DTYPES[options.dtype]),
        lambda m: f"{options.model}: {sum(p.numel() for p in m.parameters()):,} parameters, {options.dtype}",
        expected=f"reading {count:,} parameters" if count else "reading the checkpoint",
    )  # fmt: skip
    layers = f"{model.config.num_hidden_layers} layers"
    layout = cache_layout(model.config, static=options.cache == "static", attention=options.attention)
    in_place = options.attention in IN_PLACE_KINDS
    form = "fused" if options.attention == "fused" else in_place  # the model's in_place_attention
    pruning = _pruning(options, model)
    offsets = in_place and pruning is not None and pruning["log_pruning_tolerance"] is not None  # each layer's own
    eager = None
    if options.quantization:  # scored first, while the lowering's leftovers do not yet share the memory
        eager = stage(log, "text", lambda progress: _score_text(options, model, checkpoint, progress),
                      lambda run: f"eager fp32 on {len(run.segments)} segments of held-out text")  # fmt: skip
    program, example = stage(
        log, "trace",
        lambda _: export_program(model, layout, options.max_cache_len, options.max_batch, form, offsets),
        lambda _: f"torch.export, {options.cache} cache, {options.attention} attention"
        + (", layer windows for forget-gate pruning" if offsets else ""),
        expected=f"torch.export of {layers}",
    )  # fmt: skip
    # Recorded before the lowering, for the same reason as the text above (fox-base: 1.15 against 1.19 GB peak)
    batch, longer_buffers = min(2, options.max_batch), in_place and not layout.static  # only gqa is dynamic
    references = stage(
        log, "eager",
        lambda progress: record(model, layout, program, options.max_cache_len, batch, longer_buffers, progress),
        lambda r: f"eager and the ExportedProgram: prefill + {DECODE_STEPS} greedy steps, batch {batch}, "
        f"recorded for onnxruntime (ExportedProgram logits Δ {max(s.program_logits for s in r.steps):.2e})",
    )  # fmt: skip
    keep_unjoined = options.quantization.keeps if options.quantization else lambda module: False
    choices = passes.Choices(options.attention, offsets, keep_unjoined, tuple(layout.shift_state_names()))
    stage(
        log, "lower", lambda _: lower_to_onnx(program, example, layout, model_path, options.opset, choices),
        lambda counts: f"ONNX opset {options.opset}, {passes.summary(counts)}, weights memory-mappable in "
        "model.onnx.data",
        expected=f"torch.onnx.export of {layers}, the graph passes, then the weights written",
    )  # fmt: skip
    manifest = build_manifest(
        model.config, layout, dtype=str(model.dtype).removeprefix("torch."), opset=options.opset,
        max_cache_len=options.max_cache_len, max_batch=options.max_batch, attention=options.attention,
        source=str(options.model),
        source_sha256=source_digest(checkpoint), exporter_version=version("kvg-export"),
        files={"model": "model.onnx", "tokenizer": FAST_FILE if tokenizer else None}, window_offsets=offsets,
        text=tokenizer.rules if tokenizer else None, tokenizer_special_ids=tokenizer.special_ids if tokenizer else {},
        pruning=pruning, custom_ops=manifest_entry(options.library) if options.library else None,
    )  # fmt: skip
    return Lowered(manifest, references, eager)


def _score_text(options: ExportOptions, model, checkpoint: Path, progress: Progress) -> EagerRun:
    """Eager fp32's half of the quantized artifact's judgement, on the segments evaluate() cuts for that artifact."""
    if options.dtype != "fp32":
        model = load_model(checkpoint)
    context = DEFAULT_CONTEXT if options.cache == "dynamic" else min(DEFAULT_CONTEXT, options.max_cache_len)
    quality = options.quality
    try:
        return run_eager(model, checkpoint, text_paths=quality.text_paths, context=context,
                         max_segments=quality.segments, for_artifact=True, progress=progress)  # fmt: skip
    except EvalError as error:
        raise ExportError(f"a quantized export is judged on held-out text: {error}") from None


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
