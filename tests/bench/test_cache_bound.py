"""bench/cache_bound.py's online bound: exact where the trace model is deterministic or uniform,
never beaten by the cache's own policies on a long trace."""
from __future__ import annotations


import pytest
import torch

from tiers.cache import belady_hits, make_cache, replay
from tiers.trace import TraceModel, lookups

from bench_script import load

cache_bound = load("cache_bound")


def test_next_call_chances_count_k_picks_and_keep_sticky_experts():
    model = TraceModel(2, 10, 3, zipf_s=1.0, reuse_p=0.7, seed=4)
    g = torch.Generator().manual_seed(0)
    p = cache_bound.next_call_chances(model, 1, [2, 5, 9], 6000, g, chunk=1000)
    assert p.sum().item() == pytest.approx(3.0, abs=1e-9)  # every draw uses exactly k experts
    assert all(p[e] >= 0.7 for e in (2, 5, 9)), "a previous pick is kept with chance reuse_p at least"
    sticky = TraceModel(2, 10, 3, reuse_p=1.0, seed=4)
    q = cache_bound.next_call_chances(sticky, 0, [1, 4, 6], 500, g)
    assert q.tolist() == [1.0 if e in (1, 4, 6) else 0.0 for e in range(10)]


def test_bound_is_exact_for_a_frozen_trace():
    """reuse 1: every token repeats the first; a cache of C slots can hit C of the L*k picks."""
    model = TraceModel(3, 6, 2, zipf_s=1.0, reuse_p=1.0, seed=1)
    trace = model.sample(10)
    got = cache_bound.online_bound(model, trace, capacity=4, draws=200)
    assert got == pytest.approx((10 - 1) / 10 * 4 / 6, abs=1e-12)


def test_bound_for_uniform_routing_is_capacity_over_experts():
    """No skew, no reuse: every expert is used at a call with chance k/E, whatever came before."""
    model = TraceModel(3, 8, 2, seed=2)
    trace = model.sample(40)
    got = cache_bound.online_bound(model, trace, capacity=6, draws=20000)
    assert got == pytest.approx((40 - 1) / 40 * 6 / (3 * 8), rel=0.03)


@pytest.mark.parametrize("policy", ["forecast", "lru", "lfu"])
def test_no_policy_beats_the_bound_on_a_long_trace(policy):
    model = TraceModel(4, 8, 2, zipf_s=1.2, reuse_p=0.5, seed=3)
    trace = model.sample(1200)
    layers = list(range(4))
    seq = lookups(trace, layers)
    bound = cache_bound.online_bound(model, trace, capacity=8, draws=20000) * len(seq)
    hits = replay(seq, 8, set(), lambda s: make_cache(policy, s, layers=layers))
    assert hits <= bound * 1.02, f"{policy}: {hits} hits against a bound of {bound:.0f}"
    assert belady_hits(seq, 8, set()) > bound, "Belady, knowing the draws, should beat any online policy here"


def test_hot_set_is_round_robin_over_layers_and_the_most_popular_in_each():
    model = TraceModel(3, 8, 2, zipf_s=1.2, seed=5)
    pop = model.popularity()
    hot = cache_bound.hot_set(model, 5)  # layers 0 and 1 get two, layer 2 one
    assert sorted(sum(k.layer == L for k in hot) for L in range(3)) == [1, 2, 2]
    assert {L for L in range(3) if sum(k.layer == L for k in hot) == 2} == {0, 1}
    for L in range(3):
        mine = [k.expert for k in hot if k.layer == L]
        assert min(pop[L, e].item() for e in mine) >= max(pop[L, e].item() for e in range(8) if e not in mine)
    assert cache_bound.hot_set(model, 0) == set()


def test_splits_count_hot_hits_plus_the_policy_behind_them():
    """A split's hit rate is its hot set's lookups plus the shipped policy's hits over the staging
    slots, recomputed here; Belady's is over as many slots with none pinned, and is never beaten."""
    from tiers.cache import MarkovSlots

    rows = cache_bound.measure_splits("mixtral", [(0, 4), (9, 4), (10, 4)], tokens=300, seed=3)
    model = TraceModel(*cache_bound.COUNTS["mixtral"], zipf_s=1.2, reuse_p=0.5, seed=3)
    seq = lookups(model.sample(300), list(range(8)))
    for r in rows:
        hot = cache_bound.hot_set(model, r["hot"])
        hits = sum(k in hot for k in seq) + replay(seq, r["staging"], hot, lambda s: MarkovSlots(s, list(range(8)), experts=8))
        assert r["hit_rate"] == hits / len(seq)
        assert r["belady_hit_rate"] == belady_hits(seq, r["hot"] + r["staging"], set()) / len(seq)
        assert r["hit_rate"] <= r["belady_hit_rate"] and r["over_belady"] == pytest.approx(r["hit_rate"] / r["belady_hit_rate"])
    assert rows[2]["hit_rate"] > rows[1]["hit_rate"]  # one more hot expert, its layer's next most popular


@pytest.mark.parametrize("bad", ["9", "9:0", "-1:4", "a:b", "9:4:1"])
def test_splits_refuse_what_is_not_hot_and_staging_counts(bad):
    with pytest.raises(SystemExit, match="--splits"):
        cache_bound.parse_splits(bad)
