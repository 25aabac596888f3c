"""Weight-only quantization of an exported graph with onnxruntime's own quantizer: each MatMul over a constant
weight becomes `com.microsoft.MatMulNBits` (int8 or int4 weights in blocks along the input axis, each block
with its own scale and zero point), and the embedding's Gather optionally `GatherBlockQuantized`.

Activations, keys, values and gates keep their dtype. Which projections stay in float is chosen by role
(`FLOAT_ROLES`), matched against the node names the exporter gives (the modules' state-dict names).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx

BITS = {"int8": 8, "int4": 4}
# gptq is left out: onnxruntime 1.31's copy of it writes the same int4 weights as rtn, bit for bit (measured on
# fox-py and on a synthetic correlated Hessian), so offering it would promise what it does not do.
METHODS = ("rtn", "hqq", "k_quant")
NEURAL_COMPRESSOR_METHODS = ("k_quant",)  # onnxruntime's copy of Intel Neural Compressor's algorithms
BLOCK_SIZES = (16, 32, 64, 128, 256)
ACCURACY_LEVELS = range(5)  # MatMulNBits' accuracy_level: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 compute
FLOAT_ROLES = {  # role: what it matches in a node name (a module name, or a joined node's parts)
    "fgate": ".attn.fgate_proj",  # its output is summed over the whole context by the gate's cumulative sum
    "lm_head": "lm_head",
    "embedding": "model.embeddings",  # a Gather: quantizing it saves disk and memory, not time
}
# Measured on the trained presets (int4, block 32, test split at 2048 tokens; bench/README.md): the forget gate
# in float changes perplexity by 0.0 (fox-py) and 0.16 (fox-pro-py) points of a percent, and the error does not
# grow along the context, so it is quantized and stays joined with the query, key and value. The LM head in
# float gains 0.6 to 0.7 points but, at fox-small's vocabulary, would stream 4x the bytes of all its int4 layers.
# The embedding in float costs no time (a step reads one row) and keeps the graph at its opset.
DEFAULT_KEEP_FLOAT = ("embedding",)
EXTERNAL_DATA_BYTES = 1 << 30


class QuantizationError(Exception):
    """The quantization asked for cannot be made; the message says what to change."""


@dataclass(frozen=True)
class Quantization:
    """What to quantize and how; `record()` is what the manifest keeps."""

    bits: int
    block_size: int = 32
    method: str = "rtn"
    accuracy_level: int = 4
    keep_float: tuple[str, ...] = DEFAULT_KEEP_FLOAT
    symmetric: bool = False

    def __post_init__(self) -> None:
        if self.bits not in BITS.values():
            raise QuantizationError(f"quantization to {self.bits} bits is not supported; choose int8 or int4")
        if self.method not in METHODS:
            raise QuantizationError(f"--quant-method must be one of {', '.join(METHODS)}, not {self.method!r}")
        if self.block_size not in BLOCK_SIZES:
            sizes = ", ".join(map(str, BLOCK_SIZES))
            raise QuantizationError(f"--block-size must be one of {sizes}, not {self.block_size}")
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise QuantizationError(f"--accuracy-level must be 0 to 4, not {self.accuracy_level}")
        unknown = sorted(set(self.keep_float) - set(FLOAT_ROLES))
        if unknown:
            raise QuantizationError(
                f"--keep-float: unknown role {', '.join(unknown)}; roles are {', '.join(FLOAT_ROLES)}"
            )
        if self.method == "hqq" and self.bits != 4:
            raise QuantizationError(
                "hqq's int8 weights (with float zero points) have no onnxruntime CPU kernel; "
                "use int4 or --quant-method rtn"
            )
        if self.method == "hqq" and self.symmetric:
            raise QuantizationError("hqq finds its own zero points; it has no symmetric form")
        if self.method in NEURAL_COMPRESSOR_METHODS and "embedding" not in self.keep_float:
            raise QuantizationError(
                f"{self.method} quantizes MatMuls only; keep the embedding in float or quantize it with rtn or hqq"
            )

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    def keeps(self, node_name: str) -> bool:
        """Whether the node (a module name, or joined modules' names separated by "+") stays in float."""
        return any(FLOAT_ROLES[role] in part for role in self.keep_float for part in node_name.split("+"))

    def record(self, quantized: list[str], kept: list[str]) -> dict:
        return {
            **asdict(self),
            "keep_float": list(self.keep_float),
            "dtype": self.name,
            "format": "com.microsoft.MatMulNBits",
            "quantized_nodes": quantized,
            "float_nodes": kept,
        }


@dataclass
class WeightNodes:
    """The graph's weight-reading nodes, split by whether they are quantized."""

    quantized: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    # A MatMul or Gather that reads another initializer (window_offsets, an integer input with a default):
    # the quantizer would take it for a weight
    not_weights: list[str] = field(default_factory=list)


FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def _weight_nodes(model: onnx.ModelProto, quantization: Quantization) -> WeightNodes:
    inputs = {value.name for value in model.graph.input}
    initializers = {initializer.name: initializer for initializer in model.graph.initializer}
    nodes = WeightNodes()
    for node in model.graph.node:
        read = {"MatMul": 1, "Gather": 0}.get(node.op_type)
        if read is None or node.input[read] not in initializers:
            continue
        initializer = initializers[node.input[read]]
        if initializer.data_type not in FLOATS or initializer.name in inputs:
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


def _set_accuracy_level(model: onnx.ModelProto, level: int) -> None:
    """Give every MatMulNBits the same compute precision (not every algorithm's writer sets it)."""
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            kept = [a for a in node.attribute if a.name != "accuracy_level"]
            del node.attribute[:]
            node.attribute.extend(kept + ([onnx.helper.make_attribute("accuracy_level", level)] if level else []))


def quantize_graph(source: Path, target: Path, quantization: Quantization) -> dict:
    """Write the quantized form of the graph at `source` to `target`; returns the manifest's record."""
    model = onnx.load(str(source))
    nodes = _weight_nodes(model, quantization)
    if not any(name for name in nodes.quantized):
        raise QuantizationError("no weight is left to quantize: --keep-float keeps every projection in float")
    ops = ("MatMul",) if "embedding" in quantization.keep_float else ("MatMul", "Gather")
    quantizer = _quantizer_module().MatMulNBitsQuantizer(
        model, bits=quantization.bits, block_size=quantization.block_size, is_symmetric=quantization.symmetric,
        accuracy_level=quantization.accuracy_level, nodes_to_exclude=nodes.kept + nodes.not_weights,
        algo_config=_algorithm(quantization, ops),
    )  # fmt: skip
    if quantization.method in NEURAL_COMPRESSOR_METHODS:
        # Its per-node settings (bits, block, scheme; "fp32" leaves a node alone) are built by this method, which
        # knows only 4 bits: give it the whole table instead.
        per_node = {"bits": quantization.bits, "group_size": quantization.block_size,
                    "scheme": "sym" if quantization.symmetric else "asym"}  # fmt: skip
        table = {name: per_node for name in nodes.quantized} | dict.fromkeys(nodes.kept + nodes.not_weights, "fp32")
        quantizer._generate_q4_node_config = lambda: table
    with warnings.catch_warnings():
        # hqq hands torch a read-only numpy view of each weight, which it only reads; rtn's Gather path divides
        # by a zero scale for an all-zero block (the padding row) before choosing its own value there.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        warnings.filterwarnings("ignore", message="invalid value encountered in divide", category=RuntimeWarning)
        with contextlib.redirect_stdout(io.StringIO()):  # neural-compressor's methods draw a progress bar there
            quantizer.process()
    quantized = quantizer.model.model if hasattr(quantizer.model, "model") else quantizer.model
    _set_accuracy_level(quantized, quantization.accuracy_level)
    external = quantized.ByteSize() > EXTERNAL_DATA_BYTES
    onnx.save(quantized, str(target), save_as_external_data=external, location=f"{target.name}.data")
    return quantization.record(nodes.quantized, nodes.kept)
