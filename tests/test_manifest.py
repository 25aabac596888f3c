"""exporters/checks/manifest.py: kvg_config.json names every graph input and output as the graph has it and as the
contract
spells it, says what the cache holds, and a graph that differs from it is refused."""

import copy
import hashlib
import json
import re

import onnx
import pytest
from conftest import STATIC_LENGTH

from exporters.checks.manifest import build_manifest, check_graph_matches, source_digest
from exporters.pipeline.options import DEFAULT_MAX_BATCH
from kvg_export import FoxConfig
from runtime.contract import cache_layout


def graph_entries(values) -> list[dict]:
    """A graph's inputs or outputs as name, numpy's name for the element type, and axes (names or sizes)."""
    entries = []
    for value in values:
        tensor = value.type.tensor_type
        axes = [d.dim_param if d.HasField("dim_param") else d.dim_value for d in tensor.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
        entries.append({"name": value.name, "dtype": dtype, "axes": axes})
    return entries


def contract_io(config: FoxConfig, dtype: str, max_cache_len: int | None, fused: bool) -> tuple[list, list]:
    """The contract's inputs (optional ones last) and outputs, spelled out from the model's sizes: keys and values
    in the model's dtype `[batch, kv_heads, length, head_dim]`, gates float32 `[batch, heads, length]`, shift states
    `[batch, kv_heads * head_dim]`; a static cache's length is its size, a dynamic one's "past" before a run and
    "total" after it. A `fused` graph then gives each token's shift states `[batch, seq, kv_heads * head_dim]`, but
    not with RoPE, whose shifts the graph does around the operator."""
    heads, kv_heads, dim = config.num_heads, config.kv_heads, config.head_dim
    shifts = [f for f, on in (("key_shift", config.use_k_shift), ("value_shift", config.use_v_shift)) if on]

    def cache(prefix: str, length) -> list[dict]:
        axes = {"key": ["batch", kv_heads, length, dim], "value": ["batch", kv_heads, length, dim],
                "gate": ["batch", heads, length]}  # fmt: skip
        return [
            {"name": f"{prefix}.{layer}.{field}", "dtype": "float32" if field == "gate" else dtype,
             "axes": axes.get(field, ["batch", kv_heads * dim])}
            for layer in range(config.num_hidden_layers) for field in ("key", "value", "gate", *shifts)
        ]  # fmt: skip

    static = max_cache_len is not None
    inputs = [
        {"name": "input_ids", "dtype": "int64", "axes": ["batch", "seq"]},
        {"name": "attention_mask", "dtype": "int64", "axes": ["batch", "window" if static else "total"]},
        *([{"name": "cache_position", "dtype": "int64", "axes": ["seq"]}] if static else []),
        *cache("past_key_values", max_cache_len if static else "past"),
        {"name": "logits_to_keep", "dtype": "int64", "axes": [1]},
    ]
    logits = {"name": "logits", "dtype": "float32", "axes": ["batch", "kept", config.vocab_size]}
    each_token = [
        {"name": f"shift_states.{layer}.{field}", "dtype": dtype, "axes": ["batch", "seq", kv_heads * dim]}
        for layer in range(config.num_hidden_layers) for field in shifts
    ] if fused and not config.use_rope else []  # fmt: skip
    return inputs, [logits, *cache("present", max_cache_len if static else "total"), *each_token]


@pytest.mark.parametrize(
    ("preset", "cache", "dtype"),
    [("fox-pro-tiny", "static", "fp32"), ("fox-tiny", "dynamic", "fp32"), ("fox-gqa-tiny", "dynamic", "fp16")],
)
def test_the_manifest_lists_the_graphs_inputs_and_outputs_and_its_cache_as_the_contract_spells_them(
    exported, preset, cache, dtype
):  # fmt: skip
    """Each entry's name, dtype and axes are the graph's own (read with onnx) and the contract's (from the model's
    sizes); the cache section and the name templates describe the same tensors: a shift model's five fields a
    layer, keys and values in fp16 where the model is, gates in float32."""
    path = exported(preset, cache, dtype)[0].path
    manifest = json.loads((path / "kvg_config.json").read_text())
    graph = onnx.load(str(path / "model.onnx"), load_external_data=False).graph
    config = FoxConfig.from_pretrained(path)
    length = STATIC_LENGTH if cache == "static" else None
    fused = manifest["attention"] == "fused"
    inputs, outputs = contract_io(config, {"fp32": "float32", "fp16": "float16"}[dtype], length, fused)
    assert graph_entries(graph.input) == manifest["inputs"] + manifest["optional_inputs"] == inputs
    assert graph_entries(graph.output) == manifest["outputs"] == outputs
    initializers = {tensor.name for tensor in graph.initializer}
    assert all(entry["name"] in initializers for entry in manifest["optional_inputs"])  # each has its default
    shifted = config.use_k_shift
    fields = ["key", "value", "gate", *(["key_shift", "value_shift"] if shifted else [])]
    assert manifest["cache"] == {
        "kind": cache, "max_cache_len": length, "max_batch": DEFAULT_MAX_BATCH, "fields": fields,
        "shift_width": config.kv_heads * config.head_dim if shifted else None, "heads_apart_in_chunks": False,
    }  # fmt: skip
    names = manifest["names"]
    layers = range(manifest["model"]["num_layers"])
    pasts = [entry["name"] for entry in inputs if entry["name"].startswith("past_key_values.")]
    assert [names["past"].format(layer=i, field=f) for i in layers for f in fields] == pasts
    presents = [entry["name"] for entry in outputs if entry["name"].startswith("present.")]
    assert [names["present"].format(layer=i, field=f) for i in layers for f in fields] == presents
    assert manifest["model"] == {
        "num_layers": config.num_hidden_layers, "num_heads": config.num_heads, "num_kv_heads": config.kv_heads,
        "head_dim": config.head_dim, "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
    }  # fmt: skip


def test_a_graph_that_differs_from_its_manifest_is_refused_with_each_difference_named(exported):
    """The export's last check before an artifact is called good: a renamed input, a missing optional input, an
    output's dtype or an input's axes that the manifest says otherwise each fail it, all of them named at once."""
    path = exported("fox-tiny", "dynamic")[0].path
    model = path / "model.onnx"
    manifest = json.loads((path / "kvg_config.json").read_text())
    check_graph_matches(model, manifest)  # as exported
    renamed = copy.deepcopy(manifest)
    renamed["inputs"][2]["name"] = "past_key_values.0.keys"
    graph_names = re.escape("input names ['input_ids', 'attention_mask', 'past_key_values.0.key', ")
    manifest_names = re.escape("!= manifest ['input_ids', 'attention_mask', 'past_key_values.0.keys', ")
    with pytest.raises(ValueError, match=f"{graph_names}.*{manifest_names}"):
        check_graph_matches(model, renamed)
    without_default = copy.deepcopy(manifest)
    without_default["optional_inputs"] = []
    missing = r"input names \[.*'logits_to_keep'\] != manifest \[.*'past_key_values.1.gate'\]"
    with pytest.raises(ValueError, match=missing):
        check_graph_matches(model, without_default)
    changed = copy.deepcopy(manifest)
    next(e for e in changed["outputs"] if e["name"] == "present.1.gate")["dtype"] = "float16"
    next(e for e in changed["inputs"] if e["name"] == "past_key_values.0.key")["axes"][2] = STATIC_LENGTH
    with pytest.raises(ValueError) as refused:
        check_graph_matches(model, changed)
    first, *problems = str(refused.value).splitlines()
    assert first == "the ONNX graph does not match kvg_config.json:"
    assert [problem.split(":")[0].strip() for problem in problems] == [
        "input past_key_values.0.key", "output present.1.gate"
    ]  # fmt: skip
    assert "'past'" in problems[0] and f"{STATIC_LENGTH}" in problems[0].partition("!= manifest")[2]
    assert "'float32'" in problems[1] and "'float16'" in problems[1].partition("!= manifest")[2]


def small_config(**ids) -> FoxConfig:
    return FoxConfig(vocab_size=80, hidden_size=32, num_hidden_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=48, **ids)  # fmt: skip


def manifest_of(config: FoxConfig, special_ids=None, window_offsets=False, attention="gqa") -> dict:
    return build_manifest(
        config, cache_layout(config, static=False), dtype="float32", opset=20, max_cache_len=None, max_batch=4,
        attention=attention, source="fox-test", source_sha256="0" * 64, exporter_version="0",
        files={"model": "model.onnx", "tokenizer": None}, window_offsets=window_offsets,
        tokenizer_special_ids=special_ids,
    )  # fmt: skip


def test_the_tokenizers_special_ids_stand_in_for_those_the_config_leaves_out():
    """eos is always a list (or None): the runtime stops at any of them."""
    named = {"bos": 5, "eos": 6, "pad": 7}
    bare = small_config(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    assert manifest_of(bare, named)["special_tokens"] == {"bos": 5, "eos": [6], "pad": 7}
    assert manifest_of(bare)["special_tokens"] == {"bos": None, "eos": None, "pad": None}
    full = small_config(bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0)
    assert manifest_of(full, named)["special_tokens"] == {"bos": 1, "eos": [2, 3], "pad": 0}
    assert manifest_of(small_config(eos_token_id=2), named)["special_tokens"]["eos"] == [2]


@pytest.mark.parametrize("attention", ["gqa", "fused"])
def test_a_pruned_graph_takes_window_offsets_and_its_keys_and_values_may_come_folded_unless_fused(attention):
    """With window_offsets (one per layer and kv head) a gqa graph's present keys and values may come with their
    heads folded into rows, which their axes say; the fused operator never folds them, and gates never fold."""
    config = small_config()  # 2 layers, 4 heads, 2 kv heads of 8
    pruned = manifest_of(config, window_offsets=True, attention=attention)
    assert pruned["optional_inputs"] == [
        {"name": "window_offsets", "dtype": "int64", "axes": [2, 2]},
        {"name": "logits_to_keep", "dtype": "int64", "axes": [1]},
    ]
    rows = ["batch", 2] if attention == "fused" else ["rows", "row_heads"]
    axes = {entry["name"]: entry["axes"] for entry in pruned["inputs"] + pruned["outputs"]}
    for layer in range(2):
        assert axes[f"present.{layer}.key"] == axes[f"present.{layer}.value"] == [*rows, "total", 8]
        assert axes[f"past_key_values.{layer}.key"] == ["batch", 2, "past", 8]
        assert axes[f"present.{layer}.gate"] == ["batch", 4, "total"]
    assert pruned["cache"]["heads_apart_in_chunks"] is True
    unpruned = manifest_of(config, attention=attention)
    assert [entry["name"] for entry in unpruned["optional_inputs"]] == ["logits_to_keep"]
    assert next(e for e in unpruned["outputs"] if e["name"] == "present.0.key")["axes"] == ["batch", 2, "total", 8]
    assert unpruned["cache"]["heads_apart_in_chunks"] is False


def test_the_source_digest_covers_the_weight_files_in_name_order_and_nothing_else(tmp_path):
    """sha256 over each weight file's name and bytes, by name: a config edit leaves it, a changed weight does not."""
    (tmp_path / "b.safetensors").write_bytes(b"second")
    (tmp_path / "a.bin").write_bytes(b"first")
    (tmp_path / "config.json").write_text("{}")
    want = hashlib.sha256(b"a.bin" + b"first" + b"b.safetensors" + b"second").hexdigest()
    assert source_digest(tmp_path) == want
    (tmp_path / "config.json").write_text('{"edited": true}')
    assert source_digest(tmp_path) == want
    (tmp_path / "a.bin").write_bytes(b"firsT")
    assert source_digest(tmp_path) != want
