"""The option matrix's rows (tests/option_matrix.py), each exported from a tiny random checkpoint and held to eager
PyTorch. The rows carry the `matrix` marker: `make test-matrix` runs them (about 6 minutes of one core's time here,
which CI spends after `make test`); the tests below them run in `make test`."""

import itertools

import pytest
from conftest import CPU_FP32_ATTENTION
from option_matrix import OPTIONS, ROWS, WHOLE, check_row, config_of, row_params, write_checkpoint

from exporters.native.library import available


@pytest.mark.matrix
@pytest.mark.parametrize(("index", "row"), row_params())
def test_the_row_exports_and_generates_what_eager_generates(tmp_path, index, row):
    check_row(row, tmp_path, seed=index)


def test_the_rows_hold_every_pair_of_option_values_and_the_whole_product_of_the_shape_options():
    """Each pair of two options' values is in some row, but the two the options forbid (onnx-attention with a dynamic
    cache, a fixed forget gate without its decay-time bias); attention x RoPE x key shift x value shift in full; the
    rows are tiny official-format configs that load."""
    forbidden = {(("attention", "onnx-attention"), ("cache", "dynamic")),
                 (("fgate_type", "fixed"), ("fgate_bias_init", False))}  # fmt: skip
    names = list(OPTIONS)
    for a, b in itertools.combinations(names, 2):
        for x, y in itertools.product(OPTIONS[a], OPTIONS[b]):
            held = any(row[a] == x and row[b] == y for row in ROWS)
            assert held != (((a, x), (b, y)) in forbidden), (a, x, b, y)
    shapes = {tuple(row[name] for name in WHOLE) for row in ROWS}
    assert shapes == set(itertools.product(*(OPTIONS[name] for name in WHOLE)))
    assert len(ROWS) == len(shapes) == 32  # the pairs fit in the product's rows
    assert {config_of(row)["model_type"] for row in ROWS} == {"forgetting_transformer-project_fox"}


# The FoX-Pro: the paper's Transformer++ baseline with Pro components (no forget gate, RoPE, a value shift)
TRANSFORMER_PP = {name: values[0] for name, values in OPTIONS.items()} | {
    "attention": CPU_FP32_ATTENTION, "use_rope": True, "use_v_shift": True, "fgate_type": "none", "qk_norm": "per_head",
    "use_output_norm": True, "output_gate": "sigmoid",
}  # fmt: skip


def test_a_rope_fox_pro_without_a_forget_gate_exports_with_the_default_attention(tmp_path):
    """It stopped at "the ONNX graph does not match kvg_config.json": the manifest listed each token's shift states,
    which a RoPE graph, shifting around the fused operator, does not give."""
    check_row(TRANSFORMER_PP, tmp_path, seed=68, asked="auto")


@pytest.mark.skipif(available() is None, reason="the fused attention library cannot be built here")
def test_the_graph_refuses_shift_state_outputs_its_operator_does_not_give(tmp_path):
    """The lowering exposes the shift-state outputs the layout names, or refuses: asked for a RoPE model's, which its
    graph shifts around the operator, it names them rather than write a graph that differs from its manifest."""
    from exporters.graph.onnx_export import export_program, lower_to_onnx
    from exporters.graph.passes import Choices
    from kvg_export.presets import load_model
    from runtime.contract import DEFAULT_OPSET, cache_layout

    model = load_model(write_checkpoint(TRANSFORMER_PP | {"attention": "fused"}, tmp_path / "checkpoint", seed=68))
    layout = cache_layout(model.config, static=False, attention="fused")
    assert layout.shift_state_names() == []
    program, example = export_program(model, layout, in_place_attention="fused")
    wrong = Choices("fused", window_offsets=False, shift_states=("shift_states.0.value_shift",))
    with pytest.raises(ValueError, match=r"\['shift_states.0.value_shift'\] that no fused attention node gives"):
        lower_to_onnx(program, example, layout, tmp_path / "model.onnx", DEFAULT_OPSET, wrong)
