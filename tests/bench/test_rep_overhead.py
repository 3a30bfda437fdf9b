"""bench/rep_overhead.py: per-repetition decode overhead read back from a bench result file."""
from __future__ import annotations

import json

from bench_script import load

rep_overhead = load("rep_overhead")


def test_rows_report_the_per_repetition_overhead_and_skip_arms_without_it(tmp_path):
    moved = 55e9 * 4e-3  # a 4 ms bytes bound
    arms = {"all_gpu": {"decode_ms_per_token": 10.0},
            "tiers_50_int8": {"decode_ms_per_rep": [14.0, 22.0, 13.0], "paired_decode_ms_per_rep": [12.0, 20.0, 10.0],
                              "bytes_moved_per_token": {"cpu": moved, "nvme": 0.0}, "paired_overhead_over_bytes_bound": 0.75},
            "tiers_25_int8": {"bytes_moved_per_token": {"cpu": moved}}}  # from before the lists were kept
    path = tmp_path / "bench-x.json"
    path.write_text(json.dumps({"arms": arms}))
    assert rep_overhead.rows(str(path)) == ["| bench-x.json | tiers_50_int8 | 0.75 | 2.00 | 0.50 |"]
