"""bench/static_count.py: the host time of counting a static layer's call, marks against the count before."""
from __future__ import annotations

import torch

from bench_script import load

static_count = load("static_count")


def test_both_counts_agree_over_more_calls_than_mark_rows(packed_factory):
    """70 forwards through 3 all-hot layers: each layer's marks run out once (64 rows), and the
    engine's count equals the one it replaced, both the sum of each call's distinct experts."""
    row = static_count.measure(packed_factory("qwen3_moe"), rows=16, top_k=2, forwards=70, device=torch.device("cpu"))
    assert row["layers"] == 3 and row["mark_rows"] == 64 and row["forwards"] * row["layers"] > row["mark_rows"]
    g = torch.Generator().manual_seed(0)
    per_forward = sum(len(set(torch.randint(0, row["experts"], (16, 2), generator=g).reshape(-1).tolist())) for _ in range(3))
    assert row["hits_counted"] == {"marks": 70 * per_forward, "before": 70 * per_forward} and row["counts_agree"]
    for how in ("marks", "before"):
        t = row["host_us_per_call"][how]
        assert 0 < t["fastest"] <= t["median"]
