"""The option matrix: which combinations of the official FoX configuration's options, the attention the CPU runs and
the cache kind are exported and held to eager PyTorch (tests/test_option_matrix.py runs its rows).

Rows are generated, deterministically: first the whole product of the options that change the graph's shape together
(`WHOLE`: the attention choice, RoPE, the key shift and the value shift, each of which moves work into or out of the
fused operator and adds or takes away cache tensors and outputs), with every other option chosen greedily to cover
the most pairs of values not yet in a row; then, while some pair of values is in no row, a row made for it. So every
pair of two options' values is exported in some row (pairwise coverage), and `WHOLE` in full.

`python tests/option_matrix.py` prints the rows as a markdown table.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

# Every option and its values, the first the official default. kv_heads of 4 heads: MHA, GQA, MQA.
OPTIONS = {
    "attention": ("fused", "gqa", "standard", "onnx-attention"),  # the attention kinds onnxruntime's CPU runs
    "use_rope": (False, True),
    "use_k_shift": (False, True),
    "use_v_shift": (False, True),
    "cache": ("dynamic", "static"),
    "fgate_type": ("full", "bias_only", "fixed", "none"),  # per head from x, a learned bias per head, fixed, none
    "fgate_bias_init": (False, True),  # the forget gate's bias from decay times (the official decay-time init)
    "qk_norm": ("off", "per_head", "shared"),  # qk_norm and qk_norm_share_param_across_head
    "use_output_norm": (False, True),
    "output_gate": ("off", "sigmoid", "silu"),  # use_output_gate and ogate_act
    "kv_heads": (4, 2, 1),
    "tie_word_embeddings": (False, True),
    "hidden_act": ("swish", "sigmoid"),
    "log_pruning_tolerance": (None, -10.0),  # the config's pruning: an in-place export's graph takes window offsets
}
WHOLE = ("attention", "use_rope", "use_k_shift", "use_v_shift")


def allowed(row: dict) -> bool:
    """Whether a (partial) row is a combination the options allow: onnx-attention writes a static buffer
    (TensorScatter), and a fixed forget gate is its decay-time bias."""
    if row.get("attention") == "onnx-attention" and row.get("cache") == "dynamic":
        return False
    return not (row.get("fgate_type") == "fixed" and row.get("fgate_bias_init") is False)


def required_pairs() -> set[tuple]:
    """Every pair of two options' values that some row may hold: ((option, value), (option, value)), options in
    OPTIONS' order."""
    return {
        ((a, x), (b, y))
        for a, b in itertools.combinations(OPTIONS, 2)
        for x in OPTIONS[a]
        for y in OPTIONS[b]
        if allowed({a: x, b: y})
    }


def pairs_of(row: dict) -> set[tuple]:
    names = [name for name in OPTIONS if name in row]
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)}


def _filled(row: dict, uncovered: set[tuple], used: dict) -> dict:
    """`row` with each option it lacks set, in OPTIONS' order, to the allowed value that covers the most uncovered
    pairs with the options already set (ties: the value in fewest rows so far, then the first)."""
    row = dict(row)
    for name in OPTIONS:
        if name in row:
            continue

        def gain(value, name=name):
            trial = row | {name: value}
            new = sum(((a, row[a]), (name, value)) in uncovered or ((name, value), (a, row[a])) in uncovered
                      for a in row)  # fmt: skip
            return (allowed(trial), new, -used[name, value])

        row[name] = max(OPTIONS[name], key=gain)
        used[name, row[name]] += 1
    assert allowed(row), row
    return row


def generate() -> list[dict]:
    """The rows: WHOLE's product first, then a row for each pair still uncovered (see the module's docstring)."""
    uncovered, used = required_pairs(), dict.fromkeys(((n, v) for n in OPTIONS for v in OPTIONS[n]), 0)
    rows = []
    for values in itertools.product(*(OPTIONS[name] for name in WHOLE)):
        row = _filled(dict(zip(WHOLE, values, strict=True)), uncovered, used)
        rows.append(row)
        uncovered -= pairs_of(row)
    while uncovered:
        (a, x), (b, y) = min(uncovered, key=lambda pair: [list(OPTIONS).index(n) for n, _ in pair])
        row = _filled({a: x, b: y}, uncovered, used)
        rows.append(row)
        uncovered -= pairs_of(row)
    return [{name: row[name] for name in OPTIONS} for row in rows]


ROWS = generate()


def row_id(row: dict) -> str:
    """A row's test id: the attention, cache and each option that is not its default."""
    named = [row["attention"], row["cache"]]
    for name, value in row.items():
        if name in ("attention", "cache") or value == OPTIONS[name][0]:
            continue
        named.append(name if value is True else f"{name}={value}")
    return "-".join(named)


def config_of(row: dict) -> dict:
    """The official config.json fields of a row's model: tiny (hidden 32, 4 heads of 8, 2 layers, vocab 96), with
    weights drawn larger than the official init so that every option changes the logits well above fp32's error."""
    gated, normed = row["output_gate"] != "off", row["qk_norm"] != "off"
    timed = {"decay_time_min": 2.0, "decay_time_max": 64.0} if row["fgate_bias_init"] else {}
    return {
        "model_type": "forgetting_transformer-project_fox",
        "architectures": ["FoxForCausalLM"],
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_heads": 4,
        "num_kv_heads": row["kv_heads"],
        "hidden_act": row["hidden_act"],
        "initializer_range": 0.1,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": row["tie_word_embeddings"],
        "use_rope": row["use_rope"],
        "rope_base": 10000.0,
        "use_output_gate": gated,
        "ogate_act": row["output_gate"] if gated else "sigmoid",
        "fgate_type": row["fgate_type"],
        "fgate_bias_init": row["fgate_bias_init"],
        **timed,
        "use_output_norm": row["use_output_norm"],
        "qk_norm": normed,
        "qk_norm_share_param_across_head": row["qk_norm"] == "shared",
        "use_k_shift": row["use_k_shift"],
        "use_v_shift": row["use_v_shift"],
        "log_pruning_tolerance": row["log_pruning_tolerance"],
    }


def write_checkpoint(row: dict, folder: Path, seed: int) -> Path:
    """A local checkpoint folder (config.json, safetensors weights) of the row's model: random weights from `seed`,
    every parameter moved off its init (norm weights off 1, biases off 0) so that no option is an identity."""
    import torch

    from kvg_export.fox import FoxConfig, FoxForCausalLM

    fields = config_of(row)
    config = FoxConfig(**{k: v for k, v in fields.items() if k not in ("model_type", "architectures")})
    torch.manual_seed(seed)
    model = FoxForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.empty_like(parameter).uniform_(-0.3, 0.3))
    model.save_pretrained(folder, safe_serialization=True)
    assert json.loads((folder / "config.json").read_text())["model_type"] == fields["model_type"]
    return folder


def row_params() -> list:
    """The rows as pytest parameters (index, row) named by `row_id`; a fused row is skipped where the fused
    operator's library cannot be built."""
    import pytest

    from exporters.native.library import available

    skip = pytest.mark.skip(reason="the fused attention library cannot be built here")
    unbuilt = [skip] if available() is None else []  # asked once: it may try a build
    return [
        pytest.param(index, row, id=f"{index}-{row_id(row)}", marks=unbuilt if row["attention"] == "fused" else [])
        for index, row in enumerate(ROWS)
    ]


def check_row(row: dict, folder: Path, seed: int, asked: str | None = None) -> None:
    """Export the row's model (a checkpoint folder under `folder`, weights from `seed`) with its cache and the
    attention `asked` (None: the row's, which the export must then attend through), in this process: the export
    validates onnxruntime against eager at every step and raises past the tolerance. Then hold it to eager
    independently: its manifest lists the graph's outputs, each token's shift states only where the fused operator
    does the shift (not with RoPE); and the runtime's greedy decoding of a left-padded batch (chunked prefill, the
    cache bound in place, pruning at the config's tolerance) is transformers' generate()'s, tokens and logits."""
    import onnx
    from conftest import STATIC_LENGTH

    from exporters.checks.references import eager_generate
    from exporters.checks.validate import greedy_disagreement
    from exporters.pipeline.export import export_artifact
    from exporters.pipeline.options import ExportOptions
    from kvg_export.presets import load_model
    from runtime.artifact import SessionOptions
    from runtime.decode.generator import GenerationConfig, Generator

    checkpoint = write_checkpoint(row, folder / "checkpoint", seed)
    length = STATIC_LENGTH if row["cache"] == "static" else None
    options = ExportOptions(str(checkpoint), folder / "artifact", row["cache"], max_cache_len=length,
                            attention=asked or row["attention"], separate_process=False)  # fmt: skip
    result = export_artifact(options, log=lambda line: None)
    assert result.report.passed
    manifest = json.loads((result.path / "kvg_config.json").read_text())
    assert (manifest["attention"], manifest["cache"]["kind"]) == (row["attention"], row["cache"])
    graph = onnx.load(str(result.path / "model.onnx"), load_external_data=False).graph
    outputs = [value.name for value in graph.output]
    assert outputs == [entry["name"] for entry in manifest["outputs"]]
    shifts = [f for f, on in (("key_shift", row["use_k_shift"]), ("value_shift", row["use_v_shift"])) if on]
    each_token = shifts if row["attention"] == "fused" and not row["use_rope"] else []
    assert [name for name in outputs if name.startswith("shift_states.")] == [
        f"shift_states.{layer}.{field}" for layer in range(2) for field in each_token
    ]
    pruning = manifest["pruning"]
    in_place = row["cache"] == "static" or row["attention"] in ("fused", "gqa")
    assert (pruning or {}).get("log_pruning_tolerance") == (row["log_pruning_tolerance"] if in_place else None)

    model = load_model(checkpoint)
    prompts = [[(seed * 7 + 13 * i + 5 * n) % 93 + 3 for i in range(n)] for n in PROMPT_LENGTHS]
    want_tokens, want_logits = eager_generate(model, prompts, NEW_TOKENS)
    generator = Generator.open(result.path, SessionOptions(provider="cpu"))
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    got = generator.generate(prompts, config, keep_logits=True)
    assert greedy_disagreement(got.tokens, want_tokens, got.step_logits, want_logits, "float32") is None


PROMPT_LENGTHS = (5, 11, 8)  # a left-padded batch
NEW_TOKENS = 12


def table(rows: list[dict] = ROWS) -> str:
    """The rows as a markdown table, one column per option."""
    lines = ["| # | " + " | ".join(OPTIONS) + " |", "|---" * (len(OPTIONS) + 1) + "|"]
    for index, row in enumerate(rows):
        cells = ["-" if value is None else str(value) for value in row.values()]
        lines.append(f"| {index} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
    print(f"\n{len(ROWS)} rows; {len(required_pairs())} pairs of values, all covered")
