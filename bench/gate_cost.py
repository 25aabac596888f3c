"""What FoX's forget gates cost a decode step: the artifact against a copy of it whose graph skips them.

The copy is for timing only. Its GroupQueryAttention gets no bias and each present gate is its past,
passed through, so every node that computes, stores or sums the gates falls away; what is left is the
graph a LLaMA of the same size needs, with this exporter's joins and fusions. Its logits are wrong (it
attends without decay). Timed in interleaved rounds beside onnxruntime-genai on the same-size LLaMA at
the same precision, it says how much of the gap to genai the gates account for.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path

import onnx_ir as ir
from onnxscript.optimizer import remove_unused_nodes
from run import Worker, interleaved_decode_speeds

from runtime.artifact import attention_of, read_manifest

ATTENTION_BIAS = 10  # GroupQueryAttention's input index of attention_bias


def _fused(folder: Path) -> bool:
    return attention_of(read_manifest(folder)) == "fused"


def without_forget_gates(folder: Path, out: Path) -> int:
    """Write the timing-only copy of the artifact in `folder` to `out`; returns its node count."""
    if _fused(folder):
        raise ValueError(f"{folder} attends through the fused FoX operator, whose gates no graph rewrite can skip")
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("model.onnx*"))
    model = ir.load(folder / "model.onnx")
    ir.external_data.load_to_model(model)  # the copy is re-read below, separately from the artifact's weights file
    graph = model.graph
    for node in graph:
        if node.op_type == "GroupQueryAttention" and len(node.inputs) > ATTENTION_BIAS:
            node.replace_input_with(ATTENTION_BIAS, None)
    pasts = {value.name: value for value in graph.inputs}
    for index, present in enumerate(list(graph.outputs)):
        if present.name.endswith(".gate"):
            passed = ir.node("Identity", [pasts[present.name.replace("present", "past_key_values", 1)]])
            graph.append(passed)
            name, present.name = present.name, f"{present.name}.skipped"
            passed.outputs[0].name, passed.outputs[0].dtype = name, present.dtype
            passed.outputs[0].shape = present.shape
            graph.outputs[index] = passed.outputs[0]
    remove_unused_nodes(model)
    # A removed If (the gate writes) leaves its branches reading what they read: read the graph afresh
    model = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    remove_unused_nodes(model)
    ir.save(model, out / "model.onnx", external_data="model.onnx.data")
    return len(model.graph)


def gate_cost(folder: str, genai_folder: str, genai_python: str, threads: int, rounds: int, new_tokens: int) -> dict:
    """Decode tokens/s of genai, the artifact and (a GroupQueryAttention artifact's) its copy without gates, in
    interleaved rounds after a warm-up, with each one's ratio to genai taken round by round. A fused artifact's
    gates are inside its attention op, which no graph rewrite can skip: it runs beside genai alone."""
    with tempfile.TemporaryDirectory() as scratch:
        workers = {
            "genai": Worker("genai", genai_folder, threads, genai_python),
            "artifact": Worker("runtime", folder, threads),
        }
        nodes = None
        if not _fused(Path(folder)):
            bare = Path(scratch) / "without-gates"
            nodes = without_forget_gates(Path(folder), bare)
            workers["without gates"] = Worker("runtime", str(bare), threads)
        speeds = interleaved_decode_speeds(workers, rounds, new_tokens)
    return {
        "nodes_without_gates": nodes,
        "decode_tokens_per_s": {name: statistics.median(runs) for name, runs in speeds.items()},
        "vs_genai": {
            name: statistics.median(s / g for s, g in zip(runs, speeds["genai"], strict=True))
            for name, runs in speeds.items()
            if name != "genai"
        },
    }
