"""`make profile`: its reading of onnxruntime's trace (node time lands on the decode step it ran in), and the
gate-free copy of an artifact that times what the forget gates cost."""

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import CPU_FP32_ATTENTION

from runtime.artifact import SessionOptions
from runtime.cache.device_cache import DeviceCache
from runtime.decode.generator import GenerationConfig, Generator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from gate_cost import without_forget_gates
from graph_time import bound_step
from profile_ops import decode_profile


def run(ts: int, dur: int) -> dict:
    return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur}


def node(ts: int, dur: int, op: str) -> dict:
    return {"cat": "Node", "name": f"n{ts}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}


def test_only_the_last_generations_decode_runs_count():
    # Two generations of three runs each (prefill + 2 decode steps); the second's decode runs start at 400, 500.
    trace = [run(t, 50) for t in (0, 100, 200, 300, 400, 500)]
    trace += [node(t + 1, 10, "MatMul") for t in (0, 100, 200, 300)]  # warm-up and prefill: not counted
    trace += [node(401, 20, "MatMul"), node(430, 5, "Add"), node(501, 30, "MatMul"), node(520, 7, "Add")]
    trace += [node(460, 99, "MatMul")]  # between runs: belongs to none
    trace += [{"cat": "Node", "name": "n1_fence_before", "ts": 402, "dur": 3, "args": {"op_name": "MatMul"}}]
    result = decode_profile(trace, runs_per_generation=3)
    assert result["decode_steps"] == 2 and result["step_us"] == 50
    assert result["ops"] == {"MatMul": {"nodes": 1, "us": 25}, "Add": {"nodes": 1, "us": 6}}
    assert list(result["ops"]) == ["MatMul", "Add"] and result["in_kernels_us"] == 31


def test_the_gate_free_copy_runs_the_contract_without_any_forget_gate_node(exported, tmp_path):
    """bench/gate_cost.py's timing-only copy: nothing computes, stores or sums a gate any more, attention gets
    no bias, the runtime still opens and runs it, and each present gate is its past, untouched."""
    result, _ = exported("fox-tiny", "dynamic", attention="gqa")
    nodes = without_forget_gates(result.path, tmp_path / "bare")
    graph = onnx.load(str(tmp_path / "bare" / "model.onnx")).graph
    kinds = {node.op_type for node in graph.node}
    assert len(graph.node) == nodes and not kinds & {"Softplus", "CumSum", "Pad", "ScatterElements", "Where"}
    attentions = [node for node in graph.node if node.op_type == "GroupQueryAttention"]
    assert attentions and all(len(node.input) <= 10 or not node.input[10] for node in attentions)
    generator = Generator.open(tmp_path / "bare", SessionOptions(provider="cpu"))
    cache = DeviceCache(generator.model.artifact, 1)
    generator.generate([[5, 6, 7]], GenerationConfig(max_new_tokens=4, min_new_tokens=4), cache=cache)
    gates = generator.model.artifact.gate_names()
    assert gates and all(not np.any(cache.held_in(name).numpy()) for name in gates)  # zeros, as allocated


@pytest.mark.skipif(CPU_FP32_ATTENTION != "fused", reason="the fused operator's library cannot be built here")
def test_the_gate_free_copy_is_refused_for_a_fused_artifact(exported, tmp_path):
    """The fused operator computes its gates inside: a copy that drops gate nodes would time a broken graph."""
    result, _ = exported("fox-tiny", "dynamic", attention="fused")
    with pytest.raises(ValueError, match="fused FoX operator"):
        without_forget_gates(result.path, tmp_path / "bare")
    assert not (tmp_path / "bare").exists()


@pytest.mark.parametrize("attention", sorted({"gqa", CPU_FP32_ATTENTION}))
def test_graph_time_runs_a_decode_step_written_into_buffers_bound_as_past_and_present(exported, attention):
    """bench/graph_time.py's step: the new key, value and gate land at slot `filled` of the bound buffers,
    every other slot stays as it was, and each run rewrites the same slot (the step's shapes never change).
    A fused graph opens with its custom-op library registered, as the runtime opens it."""
    result, _ = exported("fox-tiny", "dynamic", attention=attention)
    filled, buffer = 5, 12
    step, buffers = bound_step(result.path / "model.onnx", filled, buffer, threads=1)
    before = {name: array.copy() for name, array in buffers.items()}
    assert buffers and all(array.shape[2] == buffer for array in buffers.values())
    for _ in range(2):
        step()
    for name, array in buffers.items():
        written = np.zeros(buffer, bool)
        written[filled] = True
        changed = (array != before[name]).reshape(*array.shape[:3], -1).any(axis=(0, 1, 3))
        np.testing.assert_array_equal(changed, written, err_msg=name)
