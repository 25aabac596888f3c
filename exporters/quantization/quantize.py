"""Weight-only quantization of an exported graph with onnxruntime's own quantizer: each MatMul over a constant
weight becomes `com.microsoft.MatMulNBits` (int8 or int4 weights in blocks along the input axis, each block
with its own scale and zero point), and the embedding's Gather optionally `GatherBlockQuantized`.

Activations, keys, values and gates keep their dtype. Which projections stay in float is chosen by role
(`FLOAT_ROLES`), matched against the node names the exporter gives (the modules' state-dict names).

It streams, one weight at a time: given the whole graph, the quantizer holds every float weight in memory, and
copies of them, several times the float model's bytes. The float graph is opened lazily instead (its weights
stay in model.onnx.data, mapped only while one is read), and each weight's node is quantized alone, in a graph
of its own. onnxruntime's quantizers work node by node, so what comes back is what the whole graph would have
got, bit for bit. Memory holds the quantized weights and one float weight (with the quantizer's copies of it);
the weights kept in float go from file to file when the graph is written.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx_ir as ir

from exporters import weights_file
from exporters.progress import Progress, untracked
from exporters.quantization.settings import NEURAL_COMPRESSOR_METHODS, Quantization, QuantizationError


@dataclass
class WeightNodes:
    """The graph's weight-reading nodes, split by whether they are quantized."""

    quantized: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    # A MatMul or Gather that reads another initializer (window_offsets, an integer input with a default):
    # the quantizer would take it for a weight
    not_weights: list[str] = field(default_factory=list)


FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
READS = {"MatMul": 1, "Gather": 0}  # the input each op reads its weight from


def _weight_nodes(graph: ir.Graph, quantization: Quantization) -> WeightNodes:
    nodes = WeightNodes()
    for node in graph:
        read = READS.get(node.op_type)
        weight = None if read is None else node.inputs[read]
        if weight is None or not weight.is_initializer():
            continue
        if weight.const_value.dtype not in FLOATS or weight.is_graph_input():
            nodes.not_weights.append(node.name)
        else:
            (nodes.kept if quantization.keeps(node.name) else nodes.quantized).append(node.name)
    return nodes


def _quantizer_module():
    """onnxruntime's quantizer module, imported with the root logger kept as it was: the module calls
    logging.basicConfig(level=INFO) when imported, which would print every library's notes from then on."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    from onnxruntime.quantization import matmul_nbits_quantizer

    root.setLevel(level)
    root.handlers[:] = handlers
    for name in ("onnxruntime.quantization", "neural_compressor"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return matmul_nbits_quantizer


def _algorithm(quantization: Quantization, ops: tuple[str, ...]):
    nbits = _quantizer_module()
    q = quantization
    if q.method == "rtn":  # onnxruntime's native round-to-nearest (its "default" algorithm)
        return nbits.DefaultWeightOnlyQuantConfig(
            block_size=q.block_size, is_symmetric=q.symmetric, accuracy_level=q.accuracy_level, bits=q.bits,
            op_types_to_quantize=ops,
        )  # fmt: skip
    if q.method == "hqq":
        return nbits.HQQWeightOnlyQuantConfig(block_size=q.block_size, bits=q.bits, op_types_to_quantize=ops)
    return nbits.KQuantWeightOnlyQuantConfig(op_types_to_quantize=ops)


def _one_node_model(model: ir.Model, node: ir.Node) -> onnx.ModelProto:
    """`node` alone in a graph, its weight read into memory as the only initializer (written in place: each copy
    of a proto would be one more of the weight), its other inputs the graph's inputs. The weight's file is
    unmapped again, so the float graph holds no weight in memory."""
    weight = node.inputs[READS[node.op_type]]
    opsets = [
        onnx.OperatorSetIdProto(domain=domain, version=version) for domain, version in model.opset_imports.items()
    ]
    one_node = onnx.ModelProto(ir_version=model.ir_version, opset_import=opsets)
    one_node.graph.node.append(ir.to_proto(node))
    one_node.graph.input.extend(
        ir.to_proto(value) for value in node.inputs if value is not None and value is not weight
    )
    one_node.graph.output.extend(ir.to_proto(value) for value in node.outputs)
    ir.serde.serialize_tensor_into(
        one_node.graph.initializer.add(), ir.Tensor(weight.const_value.numpy(), name=weight.name)
    )
    weight.const_value.release()
    return one_node


def _quantize(one_node: onnx.ModelProto, quantization: Quantization, ops: tuple[str, ...]) -> onnx.ModelProto:
    """onnxruntime's quantization of a one-node graph."""
    quantizer = _quantizer_module().MatMulNBitsQuantizer(
        one_node, bits=quantization.bits, block_size=quantization.block_size, is_symmetric=quantization.symmetric,
        accuracy_level=quantization.accuracy_level, algo_config=_algorithm(quantization, ops),
    )  # fmt: skip
    if quantization.method in NEURAL_COMPRESSOR_METHODS:
        # Its per-node settings (bits, block, scheme) are built by this method, which knows only 4 bits: give it
        # the node's own instead.
        per_node = {"bits": quantization.bits, "group_size": quantization.block_size,
                    "scheme": "sym" if quantization.symmetric else "asym"}  # fmt: skip
        quantizer._generate_q4_node_config = lambda: {node.name: per_node for node in one_node.graph.node}
    with warnings.catch_warnings():
        # hqq hands torch a read-only numpy view of each weight, which it only reads; rtn's Gather path divides
        # by a zero scale for an all-zero block (the padding row) before choosing its own value there.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        warnings.filterwarnings("ignore", message="invalid value encountered in divide", category=RuntimeWarning)
        with contextlib.redirect_stdout(io.StringIO()):  # neural-compressor's methods draw a progress bar there
            quantizer.process()
    return quantizer.model.model


def _put_in_place(model: ir.Model, node: ir.Node, quantized: onnx.ModelProto) -> None:
    """Put the quantized graph's nodes where `node` was, reading its inputs and writing its outputs under their
    names, and their new initializers into the graph; the float weight goes once no node reads it."""
    graph, weight = model.graph, node.inputs[READS[node.op_type]]
    # Read from a copy of its own: a tensor read from `quantized` keeps all of its memory, float weight included.
    part = ir.from_proto(onnx.ModelProto.FromString(quantized.SerializeToString()))
    inputs = {value.name: value for value in node.inputs if value is not None}
    for value in part.graph.inputs:
        value.replace_all_uses_with(inputs[value.name])
    for name, value in list(part.graph.initializers.items()):
        if name in graph.initializers:  # a weight left in float, or quantized already for another node reading it
            value.replace_all_uses_with(graph.initializers[name])
        else:
            del part.graph.initializers[name]
            graph.register_initializer(value)
    outputs, nodes = list(part.graph.outputs), list(part.graph)
    part.graph.outputs.clear()
    part.graph.remove(nodes)
    ir.convenience.replace_nodes_and_values(graph, node, [node], nodes, node.outputs, outputs)
    if not weight.uses():
        del graph.initializers[weight.name]
    model.opset_imports.update(part.opset_imports)  # com.microsoft, and opset 21 for int4 Gathers
    model.ir_version = part.ir_version


def _set_accuracy_level(graph: ir.Graph, level: int) -> None:
    """Give every MatMulNBits the same compute precision (not every algorithm's writer sets it)."""
    for node in graph:
        if node.op_type == "MatMulNBits":
            node.attributes.pop("accuracy_level", None)
            if level:
                node.attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", level)


def quantize_graph(source: Path, target: Path, quantization: Quantization, progress: Progress | None = None) -> dict:
    """Write the quantized form of the graph at `source` (its weights external, as the exporter writes them) to
    `target`, one weight at a time (each one a unit of `progress`); returns the manifest's record."""
    model = ir.load(source)
    nodes = _weight_nodes(model.graph, quantization)
    if not any(name for name in nodes.quantized):
        raise QuantizationError("no weight is left to quantize: --keep-float keeps every projection in float")
    ops = ("MatMul",) if "embedding" in quantization.keep_float else ("MatMul", "Gather")  # what it rewrites
    chosen = set(nodes.quantized)
    weights = [node for node in model.graph if node.name in chosen and node.op_type in ops]
    progress = progress or untracked()
    progress.plan(len(weights), "weights quantized")
    for node in weights:
        _put_in_place(model, node, _quantize(_one_node_model(model, node), quantization, ops))
        progress.advance()
    _set_accuracy_level(model.graph, quantization.accuracy_level)
    weights_file.save(model, target)
    return quantization.record(nodes.quantized, nodes.kept)
