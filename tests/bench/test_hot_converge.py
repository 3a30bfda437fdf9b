"""bench/hot_converge.py: the hot set's coverage of a trace's popularity, and its config parser."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tiers.loader.layout import ExpertKey

from bench_script import load

hot_converge = load("hot_converge")


@dataclass
class _Row:
    pinned: bool


class _Table(dict):
    pass


def test_coverage_is_the_popularity_the_hot_experts_hold_against_the_best_as_many_could():
    pop = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    table = _Table({ExpertKey(L, e): _Row(False) for L in (3, 5) for e in range(4)})
    table[ExpertKey(3, 1)] = _Row(True)  # layer 3 holds 0.3 of its picks; its best single expert 0.5
    table[ExpertKey(5, 0)] = _Row(True)  # layer 5 holds 0.1 + 0.4; its best two 0.4 + 0.3
    table[ExpertKey(5, 3)] = _Row(True)
    got, best = hot_converge.coverage(table, pop, [3, 5])
    assert got == pytest.approx((0.3 + 0.5) / 2) and best == pytest.approx((0.5 + 0.7) / 2)


def test_configs_parse_and_refuse_what_they_cannot_read():
    assert hot_converge.parse_configs("auto:16,2:4:0.5,8:64:3:8") == [(None, 16, None, None), (2, 4, 0.5, None), (8, 64, 3.0, 8)]
    for bad in ("auto", "x:4", "2:y", "0:4", "2:0", "2:4:z", "2:4:-1", "2:4:1:0", "2:4:1:x", "2:4:1:1:1"):
        with pytest.raises(SystemExit, match="--configs"):
            hot_converge.parse_configs(bad)


def test_a_tiny_run_records_each_generate_and_the_buffers_it_asked_for(packed_factory):
    """Three layers of 8 experts: the forced buffer count is the one loaded, the library's count
    otherwise (4 here: tiny experts, ``max_moves``), restored after the forced load; coverage
    stays within [0, best] after every generate."""
    from tiers.config import load_config
    from tiers.rebalance import Rebalancer

    packed = packed_factory("qwen3_moe")
    kw = dict(every=2, generates=2, tokens=5, vocab=256, device=torch.device("cpu"))
    forced = hot_converge.converge(packed, 1 << 26, 0.5, 3, 2, 0.5, 6, **kw)
    assert forced["buffers"] == 3 and forced["significance"] == 0.5 and forced["max_moves"] == 6 and len(forced["generates"]) == 2
    auto = hot_converge.converge(packed, 1 << 26, 0.5, None, 2, **kw)
    from tiers.loader.packed import read_manifest

    cfg = load_config({"tiers": {"gpu": {"fraction": 0.5}, "rebalance": {"every_tokens": 2}}})
    assert auto["buffers"] == Rebalancer.buffer_count(read_manifest(packed), cfg)
    assert auto["significance"] == cfg.rebalance.significance and auto["max_moves"] == cfg.rebalance.max_moves
    for row in (forced, auto):
        assert 0 < row["best_coverage"] <= 1 + 1e-9
        for g in row["generates"]:
            assert 0 <= g["coverage"] <= row["best_coverage"] + 1e-9 and 0 <= g["hit_rate"] <= 1 and g["promoted_hot"] >= 0
    assert auto["buffers"] != 3, "the forced count leaked into the next load"


def test_reload_starts_a_new_load_from_the_routing_counted(packed_factory):
    """``--reload 1``: the routing the run counted ranks a fresh load, whose coverage at load and
    over one generate are recorded beside the run's."""
    packed = packed_factory("qwen3_moe")
    kw = dict(every=2, generates=2, tokens=5, vocab=256, device=torch.device("cpu"))
    row = hot_converge.converge(packed, 1 << 26, 0.5, None, 4, 0.0, None, reload=1, **kw)
    again = row["reloaded"]
    assert again["routing_tokens"] > 0 and len(again["generates"]) == 1
    assert 0 <= again["coverage_at_load"] <= row["best_coverage"] + 1e-9
    assert "reloaded" not in hot_converge.converge(packed, 1 << 26, 0.5, None, 4, **kw)
