"""ONNX lowering: contract names and axes, and onnxruntime matching eager PyTorch step by step."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from exporters.graph.onnx_export import export_program, lower_to_onnx
from exporters.graph.passes import Choices
from exporters.graph.wrappers import ExportableFox
from exporters.pipeline.options import ONNX_ATTENTION_OPSET
from kvg_export import DynamicCache, FoxConfig, FoxForCausalLM
from runtime.contract import DEFAULT_OPSET, cache_layout

PRO = dict(use_k_shift=True, use_v_shift=True, qk_norm=True, use_output_gate=True, use_output_norm=True, use_rope=True)
# Plain FoX presets are exported in test_export_artifact. "saturated-gates" sets layer 0's forget-gate bias to
# -200 (f ~ exp(-200): each token attends itself) and layer 1's to +200 (f ~ 1: no decay), the ends of the
# gate's range, where a cut-off or an underflow in the lowered log-sigmoid would show.
CONFIGS = {"pro-gqa": dict(PRO, num_kv_heads=2), "saturated-gates": {}}
SATURATED_BIASES = (-200.0, 200.0)
MAX_CACHE_LEN = 24
FP32_TOLERANCE = 1e-4  # the target for fp32 exports (docs/exporting.md); measured errors are ~1e-6


def small_model(name):
    torch.manual_seed(5)
    config = FoxConfig(
        vocab_size=80, hidden_size=32, num_hidden_layers=2, num_heads=4, intermediate_size=48,
        initializer_range=0.2, pad_token_id=0, **CONFIGS[name],
    )  # fmt: skip
    model = FoxForCausalLM(config).eval()
    if name == "saturated-gates":
        with torch.no_grad():
            for layer, bias in zip(model.model.layers, SATURATED_BIASES, strict=True):
                layer.attn.fgate_proj.bias.fill_(bias)
    return model


# -gqa: attention lowered to GroupQueryAttention; -onnx-attention: to TensorScatter and ONNX Attention (opset 24)
KINDS = ("dynamic", "dynamic-gqa", "static", "static-gqa", "static-onnx-attention")


@pytest.fixture(scope="module", params=[(c, k) for c in CONFIGS for k in KINDS], ids=lambda p: "-".join(p))
def exported(request, tmp_path_factory):
    name, kind = request.param
    model = small_model(name)
    config = model.config
    layout = cache_layout(config, static=kind.startswith("static"))
    length = MAX_CACHE_LEN if layout.static else None
    attention = kind.partition("-")[2] or "standard"
    program, example = export_program(model, layout, length, in_place_attention=attention != "standard")
    path = tmp_path_factory.mktemp(f"{name}-{kind}") / "model.onnx"
    opset = ONNX_ATTENTION_OPSET if attention == "onnx-attention" else DEFAULT_OPSET
    lower_to_onnx(program, example, layout, path, opset, Choices(attention, window_offsets=False))
    return model, layout, path


def test_graph_inputs_and_outputs_follow_the_contract(exported):
    _, layout, path = exported
    graph = onnx.load(str(path)).graph
    assert [i.name for i in graph.input] == [*layout.input_names(), "logits_to_keep"]
    defaults = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    assert defaults["logits_to_keep"].tolist() == [0]  # an input with a default: every position's logits
    assert [o.name for o in graph.output] == layout.output_names()
    onnx.checker.check_model(str(path), full_check=True)
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.input}
    assert dims["input_ids"] == ["batch", "seq"]
    key = dims["past_key_values.0.key"]
    assert key[0] == "batch" and key[2] == (MAX_CACHE_LEN if layout.static else "past")
    gate_type = next(v for v in graph.input if v.name == "past_key_values.1.gate").type.tensor_type.elem_type
    assert gate_type == onnx.TensorProto.FLOAT


def uses_group_query_attention(path) -> bool:
    return any(node.op_type == "GroupQueryAttention" for node in onnx.load(str(path)).graph.node)


def run_steps(model, layout, path, ids, mask, logits_to_keep: int = 0):
    """Prefill 5 tokens then decode one at a time through onnxruntime, feeding present back as past.

    A static graph is given a mask as long as its buffer, which it must accept, except that a
    GroupQueryAttention graph takes a batch's first chunk only with the mask of exactly that chunk.
    A dynamic GroupQueryAttention graph is given key, value and gate buffers longer than the filled
    positions, as the runtime gives it, and must keep them that long."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    batch, total = ids.shape
    config = model.config
    gqa = uses_group_query_attention(path)
    length = MAX_CACHE_LEN if layout.static or gqa else 0
    past = {}
    for name in layout.past_names():
        field = name.rsplit(".", 1)[1]
        if field == "gate":
            shape = (batch, config.num_heads, length)
        elif field in ("key", "value"):
            shape = (batch, config.kv_heads, length, config.head_dim)
        else:
            shape = (batch, config.kv_heads * config.head_dim)
        past[name] = np.zeros(shape, dtype=np.float32)
    full_mask = np.zeros((batch, MAX_CACHE_LEN), dtype=np.int64)
    full_mask[:, :total] = mask.numpy()
    logits = []
    for start, stop in [(0, 5), *((t, t + 1) for t in range(5, total))]:
        feed = {"input_ids": ids[:, start:stop].numpy(), **past}
        if logits_to_keep:
            feed["logits_to_keep"] = np.array([logits_to_keep])
        if layout.static:
            window = full_mask[:, :stop] if start == 0 and gqa else full_mask
            feed |= {"attention_mask": window, "cache_position": np.arange(start, stop)}
        else:
            feed["attention_mask"] = mask[:, :stop].numpy()
        outputs = dict(zip(layout.output_names(), session.run(layout.output_names(), feed), strict=True))
        if gqa:
            assert outputs["present.0.key"].shape[2] == outputs["present.0.gate"].shape[2] == MAX_CACHE_LEN
        logits.append(outputs["logits"])
        past = {p: outputs[q] for p, q in zip(layout.past_names(), layout.present_names(), strict=True)}
    return np.concatenate(logits, axis=1)


def test_onnxruntime_matches_eager_through_prefill_and_decode_of_a_left_padded_batch(exported):
    model, layout, path = exported
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 80, (2, 12), generator=generator)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits.numpy()
    got = run_steps(model, layout, path, ids, mask)
    real = mask.numpy().astype(bool)
    assert np.abs(got - want)[real].max() < FP32_TOLERANCE


def test_logits_to_keep_gives_the_last_positions_logits_alone(exported):
    """Fed n > 0, the optional input keeps the last n positions' logits: a 5-token prefill gives its last."""
    model, layout, path = exported
    ids = torch.randint(3, 80, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 12, dtype=torch.long)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits.numpy()
    got = run_steps(model, layout, path, ids, mask, logits_to_keep=1)
    assert got.shape[1] == 12 - 4  # the prefill's last position, then one per decode step
    assert np.abs(got - want[:, 4:]).max() < FP32_TOLERANCE


@pytest.mark.parametrize("name", CONFIGS)
def test_the_dynamic_wrapper_returns_the_cache_eager_decoding_builds(name):
    model = small_model(name)
    layout = cache_layout(model.config, static=False)
    ids = torch.randint(3, 80, (2, 4))
    mask = torch.ones(2, 4, dtype=torch.long)
    empty = []
    cfg = model.config
    for _ in range(layout.num_layers):
        for field in layout.fields:
            if field == "gate":
                empty.append(torch.zeros(2, cfg.num_heads, 0))
            elif field in ("key", "value"):
                empty.append(torch.zeros(2, cfg.kv_heads, 0, cfg.head_dim))
            else:
                empty.append(torch.zeros(2, cfg.kv_heads * cfg.head_dim))
    with torch.no_grad():
        outputs = ExportableFox(model, layout)(ids, mask, *empty)
        cache = DynamicCache()
        model(ids, attention_mask=mask, past_key_values=cache)
    presents = dict(zip(layout.present_names(), outputs[1:], strict=True))
    for i, layer in enumerate(cache.layers):
        assert torch.equal(presents[f"present.{i}.key"], layer.keys)
        assert torch.equal(presents[f"present.{i}.gate"], layer.gates)
        if "value_shift" in layout.fields:
            assert torch.equal(presents[f"present.{i}.value_shift"], layer.value_shift)


def reads(node: onnx.NodeProto) -> set[str]:
    """What a node reads, its subgraphs' reads from the enclosing graph included."""
    inner = (value for attribute in node.attribute if attribute.g.node for n in attribute.g.node for value in reads(n))
    return {*node.input, *inner}


def test_each_in_place_buffer_is_read_by_the_one_node_that_writes_its_present(exported):
    """What lets the runtime bind one buffer as past and present: no other node reads a past tensor's data
    (Shape reads only its size). gqa graphs write keys and values with GroupQueryAttention, onnx-attention
    graphs with TensorScatter, standard static graphs with ScatterElements; static gates scatter, and a
    dynamic gqa graph's gates are written by an If whose branches scatter them, in place into the past
    (a buffer longer than the filled positions) or into the past padded to the window."""
    _, layout, path = exported
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    gqa = "GroupQueryAttention" in ops
    if not layout.static and not gqa:
        pytest.skip("a standard dynamic graph's present is a new tensor, past + seq long")
    nodes = onnx.load(str(path)).graph.node
    for past, present in zip(layout.past_names(), layout.present_names(), strict=True):
        if past.endswith("shift"):
            continue  # read by the token shift besides being replaced; the runtime swaps two buffers
        readers = [n for n in nodes if n.op_type != "Shape" and past in reads(n)]
        (writer,) = [n for n in nodes if present in n.output]
        if past.endswith((".key", ".value")):
            kv_writer = next(op for op in ("GroupQueryAttention", "TensorScatter", "ScatterElements") if op in ops)
            assert readers == [writer] and writer.op_type == kv_writer
        elif layout.static:
            assert readers == [writer] and writer.op_type == "ScatterElements"
        else:
            assert readers == [writer] and writer.op_type == "If"
            branches = {attribute.name: attribute.g.node for attribute in writer.attribute}
            (in_place,) = branches["then_branch"]
            pad, grown = branches["else_branch"]
            assert in_place.op_type == "ScatterElements" and in_place.input[0] == past
            assert pad.op_type == "Pad" and pad.input[0] == past
            assert grown.op_type == "ScatterElements" and grown.input[0] == pad.output[0]
            assert grown.input[1:] == in_place.input[1:]


def test_each_activation_is_projected_by_one_matmul(exported):
    """The attention's input projections (query, key, value, forget gate and FoX-Pro's output gate) are joined
    into one MatMul, as the MLP's gate and up projections already are: per layer one for those, one for the
    attention output, two for the MLP, then the LM head."""
    model, _, path = exported
    graph = onnx.load(str(path)).graph
    weights = {i.name for i in graph.initializer}
    activations = [n.input[0] for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    assert len(activations) == len(set(activations)) == 4 * model.config.num_hidden_layers + 1


def test_every_residual_add_is_joined_with_the_norm_after_it(exported):
    """Each block's two residual sums reach the next norm through one SkipSimplifiedLayerNormalization, and no
    norm is left reading an Add; the embedding's norm, which no add feeds, is left for onnxruntime to fuse."""
    model, _, path = exported
    nodes = onnx.load(str(path)).graph.node
    producer = {output: node for node in nodes for output in node.output}
    skips = [n for n in nodes if n.op_type == "SkipSimplifiedLayerNormalization"]
    assert len(skips) == 2 * model.config.num_hidden_layers and all(n.domain == "com.microsoft" for n in skips)
    squared = [producer.get(n.input[0]) for n in nodes if n.op_type == "Pow"]
    assert not [p for p in squared if p is not None and p.op_type == "Add"]


def test_in_place_gate_decay_is_one_cumsum_a_layer_summing_from_the_end(exported):
    """In float32 the in-place attention's bias is c_last - c_j: one reverse, exclusive CumSum a layer and no
    per-query Gather or Sub of gate sums."""
    model, _, path = exported
    if not {"GroupQueryAttention", "TensorScatter"} & {node.op_type for node in onnx.load(str(path)).graph.node}:
        pytest.skip("the standard graph attends with c_i - c_j")
    cumsums = [n for n in onnx.load(str(path)).graph.node if n.op_type == "CumSum"]
    decays = [n for n in cumsums if {a.name: a.i for a in n.attribute} == {"reverse": 1, "exclusive": 1}]
    assert len(decays) == model.config.num_hidden_layers
    assert len(cumsums) - len(decays) == model.config.use_rope  # RoPE's positions count the mask's tokens
