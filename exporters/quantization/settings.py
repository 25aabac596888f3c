"""What a weight-only quantization is asked to do, checked before anything is traced: the settings, their choices,
and the roles that stay in float (exporters/quantization/quantize.py does the quantizing). Separate from it, so that
the exporting process holds none of what quantizing imports while the torch half runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

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
