"""Quantizing one weight at a time writes what onnxruntime's quantizer writes given the whole graph at once, as
it was quantized before it streamed: the same nodes in the same order, the same initializers bit for bit, the
same opsets; and the large weights are written where onnxruntime can memory-map them."""

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import matmul_nbits_quantizer as nbits
from test_quantize import NAMES, projections

from exporters.quantization.quantize import quantize_graph
from exporters.quantization.settings import Quantization
from exporters.weights_file import ALIGNMENT

ALIGNED_FROM = 1 << 20  # weights_file aligns every tensor over a mebibyte

EXPORTED_CASES = {
    "rtn-int4": Quantization(4),
    "rtn-int8": Quantization(8),
    "rtn-int4-symmetric-block16": Quantization(4, 16, symmetric=True),
    "rtn-int8-symmetric-block64-level0": Quantization(8, 64, symmetric=True, accuracy_level=0),
    "hqq-int4": Quantization(4, method="hqq"),
    "rtn-int4-embedding": Quantization(4, keep_float=()),  # the Gather becomes GatherBlockQuantized
    "rtn-int8-embedding": Quantization(8, keep_float=()),  # onnxruntime quantizes Gathers to int4 only: left as is
    "rtn-int4-lm_head-float": Quantization(4, keep_float=("embedding", "lm_head")),
}
# neural-compressor's k_quant cannot take an exported graph whole: its topological sort looks up, for each graph
# input, the nodes that read it, and a cache input read only inside an If branch has none (KeyError). So it is
# compared on projections, whose inputs every node reads.
PROJECTION_CASES = {
    "k_quant-int4": Quantization(4, method="k_quant", keep_float=("fgate", "embedding")),
    "k_quant-int8": Quantization(8, method="k_quant", keep_float=("fgate", "embedding")),
    "hqq-int4": Quantization(4, method="hqq", keep_float=("fgate", "embedding")),
    "rtn-int4-symmetric": Quantization(4, symmetric=True, keep_float=("fgate", "embedding")),
}


def whole_graph(source, q: Quantization) -> onnx.ModelProto:
    """The quantization as it was made before it streamed: onnxruntime's quantizer given the whole float graph,
    then every MatMulNBits given the accuracy level."""
    model = onnx.load(str(source))
    ops = ("MatMul",) if "embedding" in q.keep_float else ("MatMul", "Gather")
    excluded = [node.name for node in model.graph.node if q.keeps(node.name)]
    config = {
        "rtn": lambda: nbits.DefaultWeightOnlyQuantConfig(
            block_size=q.block_size, is_symmetric=q.symmetric, accuracy_level=q.accuracy_level, bits=q.bits,
            op_types_to_quantize=ops,
        ),
        "hqq": lambda: nbits.HQQWeightOnlyQuantConfig(block_size=q.block_size, bits=q.bits, op_types_to_quantize=ops),
        "k_quant": lambda: nbits.KQuantWeightOnlyQuantConfig(op_types_to_quantize=ops),
    }[q.method]()  # fmt: skip
    quantizer = nbits.MatMulNBitsQuantizer(
        model, bits=q.bits, block_size=q.block_size, is_symmetric=q.symmetric, accuracy_level=q.accuracy_level,
        nodes_to_exclude=excluded, algo_config=config,
    )  # fmt: skip
    if q.method == "k_quant":  # its own table knows 4 bits only
        per_node = {"bits": q.bits, "group_size": q.block_size, "scheme": "sym" if q.symmetric else "asym"}
        table = {node.name: per_node for node in model.graph.node if node.op_type == "MatMul"}
        quantizer._generate_q4_node_config = lambda: table | dict.fromkeys(excluded, "fp32")
    place = {node.output[0]: index for index, node in enumerate(model.graph.node)}
    quantizer.process()
    quantized = quantizer.model.model
    if q.method == "k_quant":
        # neural-compressor appends each quantized node to the graph, then sorts the graph again from its inputs:
        # a node order of its own making, not a quantization. Each node goes back where the node it replaced was.
        nodes = sorted(quantized.graph.node, key=lambda node: place[node.output[0]])
        quantized.graph.ClearField("node")
        quantized.graph.node.extend(nodes)
    for node in quantized.graph.node:
        if node.op_type == "MatMulNBits":
            kept = [a for a in node.attribute if a.name != "accuracy_level"]
            level = [onnx.helper.make_attribute("accuracy_level", q.accuracy_level)] if q.accuracy_level else []
            del node.attribute[:]
            node.attribute.extend(kept + level)
    return quantized


def assert_same_quantization(got: onnx.ModelProto, expected: onnx.ModelProto) -> None:
    def nodes(model):
        return [
            (node.name, node.op_type, node.domain, list(node.input), list(node.output),
             {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute})
            for node in model.graph.node
        ]  # fmt: skip

    def arrays(model):
        return {tensor.name: onnx.numpy_helper.to_array(tensor) for tensor in model.graph.initializer}

    def io(model):
        return [(v.name, v.type) for v in model.graph.input], [(v.name, v.type) for v in model.graph.output]

    assert any(node.op_type == "MatMulNBits" for node in expected.graph.node)
    assert nodes(got) == nodes(expected)
    got_arrays, expected_arrays = arrays(got), arrays(expected)
    assert sorted(got_arrays) == sorted(expected_arrays)
    for name, array in expected_arrays.items():
        assert got_arrays[name].dtype == array.dtype and np.array_equal(got_arrays[name], array), name
    assert {o.domain: o.version for o in got.opset_import} == {o.domain: o.version for o in expected.opset_import}
    assert got.ir_version == expected.ir_version
    assert io(got) == io(expected)


@pytest.fixture(scope="module")
def float_graph(exported):
    return exported("fox-tiny", "dynamic")[0].path / "model.onnx"


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # the whole graph's all-zero padding row
@pytest.mark.parametrize("quantization", EXPORTED_CASES.values(), ids=EXPORTED_CASES)
def test_an_exported_graph_streamed_is_quantized_as_whole(float_graph, tmp_path, quantization):
    quantize_graph(float_graph, tmp_path / "model.onnx", quantization)
    assert_same_quantization(onnx.load(str(tmp_path / "model.onnx")), whole_graph(float_graph, quantization))


@pytest.mark.parametrize("quantization", PROJECTION_CASES.values(), ids=PROJECTION_CASES)
def test_projections_streamed_are_quantized_as_whole(tmp_path, quantization):
    rng = np.random.default_rng(quantization.bits)
    projections(tmp_path / "float.onnx", {name: rng.standard_normal((64, 48)).astype(np.float32) for name in NAMES})
    quantize_graph(tmp_path / "float.onnx", tmp_path / "q.onnx", quantization)
    assert_same_quantization(onnx.load(str(tmp_path / "q.onnx")), whole_graph(tmp_path / "float.onnx", quantization))


def test_large_weights_are_written_where_they_can_be_memory_mapped(tmp_path):
    rng = np.random.default_rng(0)
    weights = {name: rng.standard_normal((1024, 2048)).astype(np.float32) for name in NAMES[:2]}
    projections(tmp_path / "float.onnx", weights)  # q_proj quantized to 2 MiB of int8, fgate_proj kept: 8 MiB
    quantize_graph(tmp_path / "float.onnx", tmp_path / "q.onnx", Quantization(8, keep_float=("fgate", "embedding")))
    graph = onnx.load(str(tmp_path / "q.onnx"), load_external_data=False).graph
    stored = {t.name: {e.key: e.value for e in t.external_data} for t in graph.initializer}
    large = {name: int(place["offset"]) for name, place in stored.items() if int(place.get("length", 0)) > ALIGNED_FROM}
    assert sorted(large) == ["w0_Q8", "w1"]
    assert all(offset % ALIGNMENT == 0 for offset in large.values()), large
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.initializer if t.name in large)
