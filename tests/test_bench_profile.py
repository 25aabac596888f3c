"""`make profile`'s reading of onnxruntime's trace: node time lands on the decode step it ran in."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
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
