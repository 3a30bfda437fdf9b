"""bench/rebalance_cost.py: the rebalancer's serving-thread steps timed per decode token."""
from __future__ import annotations

import pytest
import torch

from bench_script import load

rebalance_cost = load("rebalance_cost")


def test_a_tiny_run_times_the_rebalancer_on_the_direct_decode_path(packed_factory):
    """Three layers of 8 experts, 8 staging slots (4 reserved for a decode step's 2 picks),
    rebalancing every 2 tokens: the timed generates run direct decode through decode graphs
    (every layer's calls noted, the first layer's once per token), rebalance once per interval,
    and the serving total is the sum of its top-level steps."""
    row = rebalance_cost.measure(packed_factory("qwen3_moe"), 1 << 26, 0.6, every=2, generates=2, timed=2, tokens=5, vocab=256,
                                 device=torch.device("cpu"), staging=8)
    tokens = 2 * 5
    assert row["tokens_timed"] == tokens and row["direct_calls"] > 0 and row["decode_graphs"]["replayed"] > 0
    # one forward per token: the prompt's and each decode step's first layer notes the call once
    assert row["calls"]["note_first"] == tokens and row["calls"]["note_other"] > 0
    assert row["rebalances"] == row["calls"]["rebalance"] > 0
    steps = row["steps_ms_per_token"]
    assert row["serving_ms_per_token"] == pytest.approx(steps["note_first"] + steps["note_other"] + steps.get("_refresh_direct", 0.0))
    assert steps["note_first"] >= steps["rebalance"] and row["wall_ms_per_token"] > row["serving_ms_per_token"]
