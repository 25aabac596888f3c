"""The artifact's manifest (runtime/contract.py's MANIFEST_NAME): all the runtime needs to serve an export, no torch.

It records sizes, dtypes, the IO name templates and every graph input and output (name, dtype, axes),
the cache kind and limits, special token ids, the opset and where the export came from. The ONNX graph
is checked against it before an artifact is called good.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from pathlib import Path

import onnx

from runtime import contract
from runtime.contract import CacheLayout
from runtime.text.tokenizer import TextRules

ONNX_DTYPES = {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16,
               "bfloat16": onnx.TensorProto.BFLOAT16, "int64": onnx.TensorProto.INT64}  # fmt: skip


def source_digest(folder: Path) -> str:
    """sha256 over the checkpoint's weight files, in name order."""
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.suffix in (".safetensors", ".bin", ".pt", ".pth", ".ckpt"):
            digest.update(path.name.encode())
            with path.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def _io_entry(name: str, dtype: str, axes: list) -> dict:
    return {"name": name, "dtype": dtype, "axes": axes}


def graph_io(
    config, layout: CacheLayout, dtype: str, max_cache_len: int | None, folded: bool = False
) -> tuple[list, list]:
    """The graph's inputs and outputs as the contract defines them: name, dtype and axes (names or sizes);
    `folded`: a run may fold the present keys' and values' heads into rows (exporters/graph/passes/window_offsets.py).
    The layout, which the graph's lowering also follows, says which outputs there are: each token's shift states
    follow the presents where it names them (exporters/graph/passes/shift_states.py)."""
    heads, kv_heads, head_dim = config.num_heads, config.kv_heads, config.head_dim
    length_in, length_out = (
        (max_cache_len, max_cache_len) if layout.static else (contract.PAST_AXIS, contract.TOTAL_AXIS)
    )
    batch = contract.BATCH_AXIS

    def cache_entry(name: str, field: str, length, rows: list) -> dict:
        axes = {
            "key": [*rows, length, head_dim],
            "value": [*rows, length, head_dim],
            "gate": [batch, heads, length],
        }.get(field, [batch, kv_heads * head_dim])
        return _io_entry(name, "float32" if field == "gate" else dtype, axes)

    inputs = [
        _io_entry(contract.INPUT_IDS, "int64", [batch, contract.SEQ_AXIS]),
        _io_entry(
            contract.ATTENTION_MASK, "int64", [batch, contract.WINDOW_AXIS if layout.static else contract.TOTAL_AXIS]
        ),
    ]
    if layout.static:
        inputs.append(_io_entry(contract.CACHE_POSITION, "int64", [contract.SEQ_AXIS]))
    fields = layout.fields * layout.num_layers
    rows_in, rows_out = (
        [batch, kv_heads],
        [contract.ROWS_AXIS, contract.ROW_HEADS_AXIS] if folded else [batch, kv_heads],
    )
    inputs += [cache_entry(n, f, length_in, rows_in) for n, f in zip(layout.past_names(), fields, strict=True)]
    outputs = [_io_entry(contract.LOGITS, "float32", [batch, contract.KEPT_AXIS, config.vocab_size])]
    outputs += [cache_entry(n, f, length_out, rows_out) for n, f in zip(layout.present_names(), fields, strict=True)]
    outputs += [
        _io_entry(n, dtype, [batch, contract.SEQ_AXIS, kv_heads * head_dim]) for n in layout.shift_state_names()
    ]
    return inputs, outputs


def build_manifest(
    config, layout: CacheLayout, *, dtype: str, opset: int, max_cache_len: int | None, max_batch: int,
    attention: str, source: str, source_sha256: str, exporter_version: str, files: dict[str, str | None],
    window_offsets: bool = False, text: TextRules | None = None, tokenizer_special_ids: dict[str, int] | None = None,
    pruning: dict | None = None, custom_ops: dict | None = None,
) -> dict:  # fmt: skip
    """The manifest of a lowered graph, all but what is learned of it afterwards (`with_results`).

    `attention`: "standard" (ONNX MatMul and Softmax, any provider), "fused" (the fused FoX operator, CPU, whose
    library the artifact carries: `custom_ops`, exporters/native/library.py's manifest_entry), "gqa" (onnxruntime's
    GroupQueryAttention, which cannot take a chunk of a prompt after the first for batch > 1) or "onnx-attention".
    `text`: how the tokenizer's text is escaped and what comes first (runtime/text/tokenizer.py's TextRules);
    `tokenizer_special_ids`: the special tokens the tokenizer names, which stand in for those the model's config
    leaves out; `pruning`: the tolerance and score bounds the runtime prunes with (exporters/pipeline/lowering.py), None
    for a cache it cannot prune."""
    inputs, outputs = graph_io(config, layout, dtype, max_cache_len, folded=window_offsets and attention != "fused")
    return {
        "format_version": contract.FORMAT_VERSION,
        "exporter_version": exporter_version,
        "source": {"model": source, "sha256": source_sha256, "model_type": config.model_type},
        "opset": opset,
        "dtype": dtype,
        "gate_dtype": "float32",
        "attention": attention,
        "cache": {
            "kind": "static" if layout.static else "dynamic",
            "max_cache_len": max_cache_len,
            "max_batch": max_batch,
            "fields": list(layout.fields),
            "shift_width": config.kv_heads * config.head_dim
            if any(map(contract.is_shift_state, layout.fields))
            else None,
            # with window_offsets, a prompt's chunk may run with a layer's heads' windows staggered, as decode steps do
            "heads_apart_in_chunks": window_offsets,
        },
        "model": {
            "num_layers": config.num_hidden_layers,
            "num_heads": config.num_heads,
            "num_kv_heads": config.kv_heads,
            "head_dim": config.head_dim,
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
        },
        "names": {
            "past": contract.PAST_TEMPLATE,
            "present": contract.PRESENT_TEMPLATE,
            "fields": list(contract.CACHE_FIELDS),
        },
        "inputs": inputs,
        # inputs with a default (ONNX initializers that are also inputs), fed only to change it: in a pruned export
        # window_offsets, zeros (exporters/graph/passes/window_offsets.py, which also folds its present keys and
        # values);
        # logits_to_keep, 0 (every position's logits) unless fed n > 0 (the last n)
        "optional_inputs": [_io_entry(contract.WINDOW_OFFSETS, "int64", [config.num_hidden_layers, config.kv_heads])]
        * window_offsets
        + [_io_entry(contract.LOGITS_TO_KEEP, "int64", [1])],
        "outputs": outputs,
        "special_tokens": _special_tokens(config, tokenizer_special_ids or {}),
        "text": asdict(text or TextRules()),
        "files": files,
        # with_results records a quantized export's settings here (exporters/quantization/quantize.py)
        "quantization": None,
        "pruning": pruning,
        "validation": None,  # with_results records it once the graph is validated
    } | ({"custom_ops": custom_ops} if custom_ops else {})


def _special_tokens(config, named: dict[str, int]) -> dict:
    """The config's bos, eos and pad ids, the tokenizer's `named` ones where the config leaves one out; eos always a
    list (or None), as the runtime stops at any of them."""
    eos = config.eos_token_id if config.eos_token_id is not None else named.get("eos")
    return {
        "bos": config.bos_token_id if config.bos_token_id is not None else named.get("bos"),
        "eos": eos if isinstance(eos, list) or eos is None else [eos],
        "pad": config.pad_token_id if config.pad_token_id is not None else named.get("pad"),
    }


def with_results(
    manifest: dict, *, validation: dict | None = None, quantization: dict | None = None, quality: dict | None = None
) -> dict:
    """`manifest` with what the export learns of its graph after the lowering, each given as it becomes known: the
    float graph's validation summary, a quantized graph's quantization record, then its quality on held-out text
    (part of its validation); each one left out stays as it was. A new dict, not a patch: this and build_manifest
    are where the manifest's content is decided."""
    validation = validation or manifest["validation"]
    return manifest | {
        "validation": validation if quality is None else validation | {"quality": quality},
        "quantization": quantization or manifest["quantization"],
    }


def _described(value: onnx.ValueInfoProto) -> dict:
    tensor = value.type.tensor_type
    dtype = next((k for k, v in ONNX_DTYPES.items() if v == tensor.elem_type), str(tensor.elem_type))
    axes = [d.dim_param if d.HasField("dim_param") else d.dim_value for d in tensor.shape.dim]
    return _io_entry(value.name, dtype, axes)


def check_graph_matches(model_path: Path, manifest: dict) -> None:
    """Raise ValueError naming every graph input or output that differs from the manifest."""
    graph = onnx.load(str(model_path), load_external_data=False).graph
    problems = []
    for kind, values in (("input", graph.input), ("output", graph.output)):
        actual = [_described(v) for v in values]
        expected = manifest[f"{kind}s"] + (manifest.get("optional_inputs", []) if kind == "input" else [])
        if [a["name"] for a in actual] != [e["name"] for e in expected]:
            problems.append(f"{kind} names {[a['name'] for a in actual]} != manifest {[e['name'] for e in expected]}")
            continue
        problems += [
            f"{kind} {a['name']}: graph {a} != manifest {e}" for a, e in zip(actual, expected, strict=True) if a != e
        ]
    if problems:
        raise ValueError(f"the ONNX graph does not match {contract.MANIFEST_NAME}:\n  " + "\n  ".join(problems))
