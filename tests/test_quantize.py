"""Weight-only quantization: MatMuls become MatMulNBits whose products stay within the rounding bound of their
blocks, the roles kept in float stay exact MatMuls, and settings that cannot work are refused by name."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from exporters import weights_file
from exporters.quantization.quantize import quantize_graph
from exporters.quantization.settings import Quantization, QuantizationError

K, N, BLOCK = 64, 48, 32
NAMES = ("model.layers.0.attn.q_proj", "model.layers.0.attn.fgate_proj", "lm_head")


def projections(path, weights: dict[str, np.ndarray]) -> None:
    """y_name = x @ weight for each weight, each MatMul named after its module as the exporter names them, the
    weights beside the graph as the exporter writes them."""
    rows = next(iter(weights.values())).shape[0]
    x = ir.Value(name="x", shape=ir.Shape([2, 3, rows]), type=ir.TensorType(ir.DataType.FLOAT))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 20}, name="projections")
    for index, (name, weight) in enumerate(weights.items()):
        initializer = ir.Value(name=f"w{index}", const_value=ir.tensor(weight))
        graph.register_initializer(initializer)
        product = ir.node("MatMul", [x, initializer], name=name)
        product.outputs[0].name, product.outputs[0].dtype = f"y{index}", ir.DataType.FLOAT
        graph.append(product)
        graph.outputs.append(product.outputs[0])
    weights_file.save(ir.Model(graph, ir_version=10), path)


def rounding_bound(x: np.ndarray, weight: np.ndarray, bits: int) -> np.ndarray:
    """|x @ dequantized - x @ weight| can be at most sum_k |x_k| * step(k's block), where a block's step is its
    range (zero included, for the zero point) over 2^bits - 1 levels: a whole step, rounding and clipping."""
    blocks = weight.reshape(K // BLOCK, BLOCK, N)
    step = (np.maximum(blocks.max(1), 0) - np.minimum(blocks.min(1), 0)) / (2**bits - 1)
    return np.abs(x) @ np.repeat(step, BLOCK, axis=0) * (1 + 1e-5) + 1e-6


@pytest.mark.parametrize(("method", "bits"), [("rtn", 8), ("rtn", 4), ("hqq", 4), ("k_quant", 8), ("k_quant", 4)])
def test_products_stay_within_the_blocks_rounding_and_kept_roles_stay_exact(tmp_path, bits, method):
    rng = np.random.default_rng(bits)
    weights = {name: rng.standard_normal((K, N)).astype(np.float32) for name in NAMES}
    projections(tmp_path / "float.onnx", weights)
    quantization = Quantization(bits, BLOCK, method, keep_float=("fgate", "embedding"))
    record = quantize_graph(tmp_path / "float.onnx", tmp_path / "q.onnx", quantization)
    assert record["quantized_nodes"] == ["model.layers.0.attn.q_proj", "lm_head"]
    assert record["float_nodes"] == ["model.layers.0.attn.fgate_proj"]
    graph = onnx.load(str(tmp_path / "q.onnx")).graph
    ops = {node.name: node for node in graph.node}
    assert ops["model.layers.0.attn.fgate_proj"].op_type == "MatMul"
    quantized = [node for node in graph.node if node.op_type == "MatMulNBits"]
    assert len(quantized) == 2
    for node in quantized:
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attributes["bits"], attributes["block_size"], attributes["accuracy_level"]) == (bits, BLOCK, 4)
    x = rng.standard_normal((2, 3, K)).astype(np.float32)
    got = ort.InferenceSession(str(tmp_path / "q.onnx")).run(None, {"x": x})
    for (name, weight), product in zip(weights.items(), got, strict=True):
        exact = x.astype(np.float64) @ weight.astype(np.float64)
        if "fgate" in name:
            np.testing.assert_allclose(product, exact, rtol=1e-5, atol=1e-5)
        else:
            error = np.abs(product - exact)
            assert np.all(error <= rounding_bound(x, weight, bits)), f"{name}: {error.max()}"
            assert error.max() > 0  # it was quantized


def test_roles_match_modules_and_joined_projections():
    quantization = Quantization(4, keep_float=("fgate", "lm_head"))
    assert quantization.keeps("lm_head")
    assert quantization.keeps("model.layers.3.attn.fgate_proj")
    assert quantization.keeps("model.layers.0.attn.q_proj+model.layers.0.attn.fgate_proj")
    assert not quantization.keeps("model.layers.0.attn.q_proj+model.layers.0.attn.k_proj")
    assert not quantization.keeps("model.layers.0.mlp.gate_proj")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"bits": 3}, "3 bits is not supported; choose int8 or int4"),
        ({"bits": 4, "block_size": 48}, "--block-size must be one of 16, 32, 64, 128, 256"),
        ({"bits": 4, "method": "gptq"}, "--quant-method must be one of rtn, hqq, k_quant"),
        ({"bits": 4, "keep_float": ("norms",)}, "unknown role norms; roles are fgate, lm_head, embedding"),
        ({"bits": 4, "method": "k_quant", "keep_float": ()}, "k_quant quantizes MatMuls only; keep the embedding"),
        ({"bits": 4, "accuracy_level": 5}, "--accuracy-level must be 0 to 4"),
        ({"bits": 8, "method": "hqq"}, "hqq's int8 weights .* have no onnxruntime CPU kernel"),
    ],
)
def test_settings_that_cannot_work_are_refused_by_name(settings, message):
    with pytest.raises(QuantizationError, match=message):
        Quantization(**settings)


def test_a_graph_with_nothing_left_to_quantize_is_refused(tmp_path):
    projections(tmp_path / "float.onnx", {"lm_head": np.ones((K, N), np.float32)})
    with pytest.raises(QuantizationError, match="no weight is left to quantize"):
        quantize_graph(tmp_path / "float.onnx", tmp_path / "q.onnx", Quantization(4, keep_float=("lm_head",)))
    assert not (tmp_path / "q.onnx").exists()
