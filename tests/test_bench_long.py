"""`make bench-long`'s arithmetic and bookkeeping, on made-up runs: which prompt lengths a system can hold, the
medians and per-round ratios to onnxruntime-genai, and what the table says of a length a system skipped."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from long_context import capacity, fits, rows_at, table

from runtime.contract import FORMAT_VERSION, MANIFEST_NAME


def answer(ttft: float, speed: float, rss: float) -> dict:
    return {"ttft_s": ttft, "decode_tokens_per_s": speed, "peak_rss_mb": rss}


def test_a_prompt_fits_where_it_and_the_new_tokens_are_held():
    assert fits(4096, 64, 4160) and not fits(4097, 64, 4160)
    assert fits(32768, 64, None)  # a dynamic artifact without --max-cache-len: no limit


def test_capacity_reads_the_artifacts_max_cache_len_and_genais_context_length(tmp_path):
    static, dynamic, genai = (tmp_path / name for name in ("static", "dynamic", "genai"))
    for folder in (static, dynamic, genai):
        folder.mkdir()
    for folder, kind, length in ((static, "static", 4160), (dynamic, "dynamic", None)):
        manifest = {"format_version": FORMAT_VERSION, "cache": {"kind": kind, "max_cache_len": length}}
        (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    (genai / "genai_config.json").write_text(json.dumps({"model": {"context_length": 1088}}))
    assert (capacity(static), capacity(dynamic), capacity(genai)) == (4160, None, 1088)


def test_medians_peaks_and_round_by_round_ratios_to_genai():
    runs = {
        "runtime-static": [answer(2.0, 90.0, 300), answer(4.0, 100.0, 310), answer(3.0, 80.0, 320)],
        "genai-fp32": [answer(1.0, 100.0, 200), answer(1.0, 125.0, 200), answer(2.0, 100.0, 210)],
    }
    rows = {row["system"]: row for row in rows_at("fox-small", 4096, runs, died={})}
    static = rows["runtime-static"]
    assert static["ttft_s"] == {"median": 3.0, "min": 2.0, "max": 4.0}
    assert static["decode_tokens_per_s"] == {"median": 90.0, "min": 80.0, "max": 100.0}
    assert static["peak_rss_mb"] == 320  # the worker's peak after the length's last run, not a median
    # per round: TTFT 2/1, 4/1, 3/2 -> 2, 4, 1.5; decode 90/100, 100/125, 80/100 -> 0.9, 0.8, 0.8
    assert static["ttft_vs_genai"] == {"median": 2.0, "min": 1.5, "max": 4.0}
    assert static["decode_vs_genai"] == pytest.approx({"median": 0.8, "min": 0.8, "max": 0.9})
    assert rows["genai-fp32"]["decode_vs_genai"] == {"median": 1.0, "min": 1.0, "max": 1.0}


def test_a_system_whose_worker_died_gets_no_figures_and_no_one_a_ratio_to_a_dead_genai():
    runs = {"runtime-dynamic": [answer(1.0, 50.0, 100)], "genai-fp32": []}
    rows = rows_at("fox-small", 32768, runs, died={"genai-fp32": -9})
    assert "ttft_vs_genai" not in rows[0] and rows[0]["ttft_s"]["median"] == 1.0
    assert rows[1]["skipped"] == "its worker died here, exit status -9 (killed: out of memory?)"


def test_the_table_gives_figures_and_says_why_a_length_was_skipped():
    runs = {"runtime-dynamic": [answer(1.5, 40.0, 812.4)], "genai-fp32": [answer(0.5, 50.0, 700)]}
    rows = rows_at("fox-pro-py", 512, runs, died={})
    rows.append(
        {
            "model": "fox-pro-py",
            "prompt": 32768,
            "system": "runtime-static",
            "skipped": "needs 32832 positions, holds 4160",
        }
    )
    lines = table({"rows": rows}).splitlines()
    assert lines[2] == (
        "| fox-pro-py | 512 | runtime-dynamic | 1.50 (1.50 to 1.50) | 40.0 (40.0 to 40.0) | 812 | "
        "3.00 (3.00 to 3.00) | 0.80 (0.80 to 0.80) |"
    )
    assert lines[4] == "| fox-pro-py | 32768 | runtime-static | not run: needs 32832 positions, holds 4160 | | | | |"
    assert all(line.count("|") == lines[0].count("|") for line in lines)
