"""The bench's plot: decode ms/token per arm against its bytes bound, as a PNG beside the Markdown (CPU)."""
from __future__ import annotations

import json
import sys

import pytest

from tiers.tools import bench, bench_plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _result() -> dict:
    """A run's result as ``add_bounds`` leaves it: two Tiers arms with a bound, the all-GPU arm
    and a failed arm without one."""
    return {"model": "qwen3_moe", "shape": {"layers": 2}, "device": "cpu", "arms": {
        "all_gpu": {"decode_ms_per_token": 10.0},
        "tiers_25_int8": {"decode_ms_per_token": 14.0, "bound_ms_per_token": 12.0},
        "tiers_50_bf16": {"error": "RuntimeError: boom"},
        "tiers_50_int8@skewed": {"decode_ms_per_token": 11.0, "bound_ms_per_token": 11.5}}}


def test_only_arms_with_a_bound_are_drawn_in_the_runs_order():
    assert bench_plot.bounded_arms(_result()) == [("tiers_25_int8", 14.0, 12.0), ("tiers_50_int8@skewed", 11.0, 11.5)]


def test_the_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench-qwen3_moe.png"
    assert bench_plot.plot(_result(), path) == path
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_without_matplotlib_the_plot_is_skipped_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: importing it raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    path = tmp_path / "bench-qwen3_moe.png"
    assert bench_plot.plot(_result(), path) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "matplotlib" in err and not path.exists()


def test_a_run_without_bounds_draws_nothing(tmp_path, capsys):
    r = _result()
    r["arms"] = {k: v for k, v in r["arms"].items() if "bound_ms_per_token" not in v}
    assert bench_plot.plot(r, tmp_path / "x.png") is None and not (tmp_path / "x.png").exists()
    assert capsys.readouterr().err.count("\n") == 1


def test_report_draws_the_plot_beside_the_markdown(tmp_path, capsys):
    """``--report RUN.json``: the Markdown and the PNG next to the JSON, the bound derived from it."""
    pytest.importorskip("matplotlib")
    arms = {"all_gpu": {"decode_ms_per_token": 10.0, "decode_tok_s": 100.0, "prefill_s": 0.03},
            "tiers_25_int8": {"decode_ms_per_token": 13.0, "decode_tok_s": 76.9, "prefill_s": 0.05,
                              "bytes_moved_per_token": {"cpu": 55e6}, "prefill_bytes_moved": 0.0}}
    r = {"command": "python tools/bench.py", "model": "mixtral", "shape": {"layers": 2}, "device": "cpu", "experts": 16,
         "expert_bytes_bf16": 2**30, "decode_tokens": 4, "prefill_tokens": 16, "routing": {"skewed": {}}, "arms": arms}
    path = tmp_path / "bench-mixtral-run1.json"
    path.write_text(json.dumps(r))
    assert bench.main(["--report", str(path)]) == 0
    capsys.readouterr()
    assert "| tiers_25_int8 | 13.0 | 76.90 | 11.0 |" in (tmp_path / "bench-mixtral-run1.md").read_text()  # bound: 10 + 1 ms
    assert (tmp_path / "bench-mixtral-run1.png").read_bytes().startswith(PNG_MAGIC)
