"""The bench's bound arithmetic and report on hand-made results (no run): overheads, baselines, offload ratios, the Markdown."""
from __future__ import annotations

import json
import statistics

import pytest

from tiers.tools import bench, bench_bounds, bench_report


def test_rep_overhead_is_the_median_of_differences_within_repetitions():
    """Repetitions on a host whose speed changes: the median of the per-repetition differences
    keeps the arm's true 1 ms overhead, the difference of the medians does not."""
    arm = [11.0, 11.0, 21.0, 21.0, 21.0]  # two fast repetitions, three slow
    pair = [10.0, 10.0, 10.0, 20.0, 20.0]  # its pair was fast in a slow repetition of the arm
    row = {"decode_ms_per_rep": arm, "paired_decode_ms_per_rep": pair}
    assert bench_bounds.rep_overhead_ms(row) == pytest.approx(1.0)
    assert statistics.median(arm) - statistics.median(pair) == pytest.approx(11.0)
    assert bench_bounds.rep_overhead_ms({"decode_ms_per_rep": arm}) is None
    assert bench_bounds.rep_overhead_ms({"decode_ms_per_rep": arm, "paired_decode_ms_per_rep": pair[:3]}) is None
    moved = 55e9 * 2e-3  # bytes a 2 ms bound moves
    r = {"arms": {"all_gpu": {"decode_ms_per_token": 10.0, "prefill_s": 0.03},
                  "tiers_25_int8": {"decode_ms_per_token": 21.0, "paired_all_gpu_ms_per_token": 10.0, "bytes_moved_per_token": {"cpu": moved},
                                    "prefill_s": 0.05, "prefill_bytes_moved": 0.0, **row}}}
    t = bench_bounds.add_bounds(r)["arms"]["tiers_25_int8"]
    assert t["rep_overhead_ms_per_token"] == pytest.approx(1.0) and t["rep_overhead_over_bytes_bound"] == pytest.approx(0.5)


def test_figures_against_the_pairs_need_no_all_gpu_arm_of_the_routing():
    """A skewed arm in a run that lists no all_gpu@skewed: what is held against the run's all-GPU
    arm is left out, what is held against the arm's own pairs (and its bytes) is derived (the
    Markdown showed 0.00 for the interleaved bytes bound it had not derived)."""
    moved = 55e9 * 2e-3  # bytes a 2 ms bound moves
    il = {"tokens": 16, "block": 8, "arm_ms_per_token": 13.0, "pair_ms_per_token": 10.0, "overhead_ms_per_token": 3.0,
          "block_overhead_ms_per_token": 3.0, "bytes_moved_per_token": {"cpu": moved}}
    row = {"decode_ms_per_token": 13.0, "paired_all_gpu_ms_per_token": 10.0, "bytes_moved_per_token": {"cpu": moved},
           "decode_ms_per_rep": [13.0, 13.0], "paired_decode_ms_per_rep": [10.0, 11.0], "prefill_s": 0.05,
           "paired_prefill_s": 0.04, "prefill_bytes_moved": 0.0, "interleaved": il}
    r = bench_bounds.add_bounds({"arms": {"all_gpu": {"decode_ms_per_token": 9.0, "prefill_s": 0.03}, "tiers_25_int8@skewed": row}})
    t = r["arms"]["tiers_25_int8@skewed"]
    assert "bound_ms_per_token" not in t and "overhead_ms_per_token" not in t and "prefill_over_bound" not in t
    assert t["paired_overhead_over_bytes_bound"] == pytest.approx(1.5) and t["over_paired_all_gpu"] == pytest.approx(1.3)
    assert t["rep_overhead_over_bytes_bound"] == pytest.approx(1.25)
    assert t["interleaved"]["bound_ms"] == pytest.approx(2.0) and t["interleaved"]["overhead_over_bytes_bound"] == pytest.approx(1.5)
    assert t["prefill_over_paired_bound"] == pytest.approx(1.25)


def test_baseline_is_the_faster_all_gpu_measurement_of_the_same_routing():
    arms = {"all_gpu": {"decode_ms_per_token": 12.0, "prefill_s": 0.03}, "all_gpu/end": {"decode_ms_per_token": 10.0, "prefill_s": 0.04},
            "all_gpu@skewed": {"decode_ms_per_token": 9.0, "prefill_s": 0.05}, "all_gpu@skewed/end": {"error": "boom"}}
    r = {"arms": arms}
    assert bench_bounds.baseline(r, "tiers_25_int8") == {"decode_ms_per_token": 10.0, "prefill_s": 0.03}
    assert bench_bounds.baseline(r, "tiers_25_int8@skewed_norebal") == {"decode_ms_per_token": 9.0, "prefill_s": 0.05}
    assert bench_bounds.baseline({"arms": {}}, "tiers_25_int8") == {}


def _offload_result() -> dict:
    """All-GPU at 10 ms (uniform, the faster of two) and 8 ms (skewed); accelerate and lazy 1010
    and 110 ms; three offloaded Tiers arms and the 100% one."""
    arms = {"all_gpu": {"decode_ms_per_token": 12.0}, "all_gpu/end": {"decode_ms_per_token": 10.0},
            "all_gpu@skewed": {"decode_ms_per_token": 8.0}, "all_gpu@skewed/end": {"decode_ms_per_token": 9.0},
            "lazy": {"decode_ms_per_token": 110.0}, "accelerate": {"decode_ms_per_token": 1010.0},
            "tiers_100_bf16": {"decode_ms_per_token": 9.0, "bytes_moved_per_token": {}},
            # 2 ms above the faster all-GPU, 4 per repetition, 1 interleaved: the largest is 4
            "tiers_25_int8": {"decode_ms_per_token": 12.0, "bytes_moved_per_token": {"cpu": 55e6},
                              "decode_ms_per_rep": [14.0], "paired_decode_ms_per_rep": [10.0],
                              "interleaved": {"tokens": 8, "arm_ms_per_token": 11.0, "pair_ms_per_token": 10.0,
                                              "overhead_ms_per_token": 1.0, "block_overhead_ms_per_token": 1.0,
                                              "bytes_moved_per_token": {"cpu": 55e6}}},
            # held against the skewed all-GPU measurement: 18 - 8 = 10 ms
            "tiers_25_int8@skewed": {"decode_ms_per_token": 18.0, "bytes_moved_per_token": {"cpu": 55e6}},
            # faster than all-GPU by every statistic
            "tiers_50_int8": {"decode_ms_per_token": 9.5, "bytes_moved_per_token": {"cpu": 55e6}}}
    return bench_bounds.add_bounds({"arms": arms, "command": "python tools/bench.py"})


def test_offload_overheads_take_each_arms_largest_statistic():
    r = _offload_result()
    off = bench_bounds.offload_overheads(r)
    assert r["offload"] == off  # add_bounds keeps it in the results (the JSON)
    assert off["overhead_ms"] == {"accelerate": pytest.approx(1000.0), "lazy": pytest.approx(100.0)}
    assert set(off["arms"]) == {"tiers_25_int8", "tiers_25_int8@skewed", "tiers_50_int8"}  # not the 100% arm
    a = off["arms"]["tiers_25_int8"]
    assert a["overhead_ms"] == {"faster_all_gpu": pytest.approx(2.0), "per_rep": pytest.approx(4.0), "interleaved": pytest.approx(1.0)}
    assert a["largest_ms"] == pytest.approx(4.0)
    assert a["accelerate_over"] == pytest.approx(250.0) and a["lazy_over"] == pytest.approx(25.0)
    s = off["arms"]["tiers_25_int8@skewed"]
    assert s["largest_ms"] == pytest.approx(10.0) and s["lazy_over"] == pytest.approx(10.0)
    faster = off["arms"]["tiers_50_int8"]
    assert faster["largest_ms"] == pytest.approx(-0.5) and faster["accelerate_over"] is None and faster["lazy_over"] is None
    r = _offload_result()
    del r["arms"]["lazy"]
    assert bench_bounds.offload_overheads(r) == {}  # no ratio without both slow arms


def test_report_rewrites_the_markdown_from_a_bench_json(tmp_path, capsys):
    r = _offload_result()
    r["arms"]["tiers_25_int8"]["prefill_marks"] = [{"host_syncs": ["tiers/a.py:1", "tiers/b.py:2", "tiers/a.py:1"]}, {"host_syncs": []}]
    r["arms"]["tiers_50_int8"]["prefill_marks"] = [{"host_syncs": []}]
    r.update(model="mixtral", shape={"layers": 2}, device="cpu", experts=8, expert_bytes_bf16=2**30, decode_tokens=4,
             prefill_tokens=16, routing={"skewed": {}})
    for a in r["arms"].values():
        a.setdefault("decode_tok_s", 1e3 / a["decode_ms_per_token"])
        a.setdefault("prefill_s", 0.01)
        a.setdefault("prefill_bytes_moved", 0.0)
    path = tmp_path / "bench-mixtral-run1.json"
    path.write_text(json.dumps(r))
    assert bench.main(["--report", str(path)]) == 0
    md = (tmp_path / "bench-mixtral-run1.md").read_text()
    assert "| tiers_25_int8 | 2.00 | 4.00 | 1.00 | 4.00 | 250.0x | 25.0x |" in md
    assert "| tiers_50_int8 | -0.50 | - | - | -0.50 | - | - |" in md
    assert "- tiers_25_int8, marked prefill 1: tiers/a.py:1 x2; tiers/b.py:2 x1" in md
    assert "- tiers_25_int8, marked prefill 2: none" in md and "tiers_50_int8, marked" not in md
    assert json.loads(path.read_text()) == r  # the JSON is left as it was
    assert "This run ended after its arms, before its end-of-run measurements" in md  # no cache replay: a partial JSON
    r["cache_replay"] = {}
    path.write_text(json.dumps(r))
    assert bench.main(["--report", str(path)]) == 0
    assert "This run ended" not in (tmp_path / "bench-mixtral-run1.md").read_text()
    capsys.readouterr()
    bad = tmp_path / "bench-bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(SystemExit) as e:
        bench.main(["--report", str(bad)])
    assert "bench-bad.json" in str(e.value.code)


def test_phase_usage_picks_the_fastest_and_slowest_block_by_host_time():
    fast = {"host_ms": [10.0, 11.0], "cpu_ms": [9.0, 10.0], "sys_ms": [0.1, 0.1], "faults": [0, 0], "preempted": [0, 1]}
    slow = {"host_ms": [30.0, 31.0], "cpu_ms": [29.0, 30.0], "sys_ms": [0.2, 0.4], "faults": [4, 0], "preempted": [0, 0]}
    mid = {"host_ms": [20.0, 20.0], "cpu_ms": [5.0, 5.0], "sys_ms": [0.1, 0.1], "faults": [0, 0], "preempted": [0, 0]}
    usage = {k: mid[k] + slow[k] + fast[k] + [99] for k in fast}  # a partial last block is left out of the blocks
    p = bench_report.phase_usage(usage, 2)
    assert p["fastest"] == {"host_ms": 10.5, "cpu_ms": 9.5, "sys_ms": 0.1, "faults": 0, "preempted": 0.5}
    assert p["slowest"]["host_ms"] == 30.5 and p["slowest"]["cpu_ms"] == 29.5 and p["slowest"]["sys_ms"] == pytest.approx(0.3)
    assert p["per_step"] == {"faults": pytest.approx(103 / 7), "preempted": pytest.approx(100 / 7)}
    assert bench_report.phase_usage({"host_ms": [1.0]}, 2) is None and bench_report.phase_usage({}, 2) is None
