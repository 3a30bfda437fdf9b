"""Cache policies against Belady's MIN, and the synthetic trace model."""
from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.layout import ExpertKey
from tiers.cache import LfuSlots, LruSlots, belady_hits, make_cache, replay
from tiers.trace import TraceModel, lookups


def brute_force_optimum(seq, capacity):
    """Exhaustive search over every eviction choice: the true optimum for tiny traces."""
    best = 0

    def go(i, cache, hits):
        nonlocal best
        if i == len(seq):
            best = max(best, hits)
            return
        k = seq[i]
        if k in cache:
            go(i + 1, cache, hits + 1)
        elif len(cache) < capacity:
            go(i + 1, cache | {k}, hits)
        else:
            for out in cache:
                go(i + 1, (cache - {out}) | {k}, hits)

    go(0, frozenset(), 0)
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=11), st.integers(1, 3))
def test_belady_is_optimal_on_small_traces(raw, capacity):
    seq = [ExpertKey(0, e) for e in raw]
    assert belady_hits(seq, capacity, set()) == brute_force_optimum(seq, capacity)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=1, max_size=200), st.integers(1, 5), st.sampled_from(["lru", "lfu"]))
def test_no_policy_beats_belady(raw, capacity, policy):
    seq = [ExpertKey(0, e) for e in raw]
    hits = replay(seq, capacity, set(), lambda s: make_cache(policy, s, decay=0.9))
    assert hits <= belady_hits(seq, capacity, set())


def test_hot_keys_are_excluded():
    seq = [ExpertKey(0, e) for e in [0, 1, 0, 1, 2, 0]]
    assert belady_hits(seq, 1, {ExpertKey(0, 0)}) == 1  # 1 1 2 -> one hit
    assert replay(seq, 1, {ExpertKey(0, 0)}, LruSlots) == 1


def test_lru_order_and_held_slots():
    c = LruSlots(range(3))
    for s, e in [(0, 0), (1, 1), (2, 2)]:
        c.assign(s, ExpertKey(0, e))
    c.touch(0)
    assert c.victim([0, 0, 0]) == 1
    assert c.victim([0, 1, 0]) == 2
    assert c.victim([1, 1, 1]) is None


def test_empty_slot_taken_first():
    c = LfuSlots(range(2), decay=0.5)
    c.assign(1, ExpertKey(0, 1))
    assert c.victim([0, 0]) == 0


def test_lfu_keeps_the_frequent_expert():
    c = LfuSlots(range(2), decay=0.99)
    a, b, x = ExpertKey(0, 0), ExpertKey(0, 1), ExpertKey(0, 2)
    for _ in range(5):
        c.access(a)
    c.assign(0, a)
    c.access(b)
    c.assign(1, b)
    c.touch(0)  # a is also the most recent; LRU alone would evict b as well, so make b recent
    c.touch(1)
    c.access(x)
    assert c.victim([0, 0]) == 1  # b (1 lookup) goes, a (5 lookups) stays, though b is more recent


def test_lfu_decay_forgets():
    c = LfuSlots(range(1), decay=0.5)
    a, b = ExpertKey(0, 0), ExpertKey(0, 1)
    for _ in range(4):
        c.access(a)
    for _ in range(3):
        c.access(b)
    assert c.score(b) > c.score(a)  # a's 4 old lookups decayed below b's 3 recent ones


def test_bad_decay_and_policy_name():
    with pytest.raises(ValueError, match="lfu_decay"):
        LfuSlots(range(1), decay=0.0)
    with pytest.raises(ValueError, match="tiers.gpu.cache"):
        make_cache("fifo", range(1))


# -- trace model ------------------------------------------------------------------------------

def test_trace_shape_distinct_and_deterministic():
    m = TraceModel(num_layers=3, num_experts=8, top_k=2, zipf_s=1.2, reuse_p=0.5, seed=4)
    t = m.sample(200)
    assert t.shape == (200, 3, 2)
    assert (t[..., 0] != t[..., 1]).all()
    assert torch.equal(t, m.sample(200))
    assert ((t >= 0) & (t < 8)).all()


def test_uniform_trace_is_near_uniform():
    t = TraceModel(num_layers=1, num_experts=8, top_k=2, seed=1).sample(4000)
    share = torch.bincount(t.flatten(), minlength=8).double() / t.numel()
    assert (share - 1 / 8).abs().max() < 0.02


def test_zipf_skew_matches_prior():
    m = TraceModel(num_layers=2, num_experts=16, top_k=1, zipf_s=1.0, seed=2)
    t = m.sample(6000)
    pop = m.popularity()
    for layer in range(2):
        share = torch.bincount(t[:, layer, 0], minlength=16).double() / 6000
        assert (share - pop[layer]).abs().max() < 0.025
        top = pop[layer].argmax()
        assert share[top] > 3 * (1 / 16)  # the head expert takes far more than a uniform share


def test_reuse_probability_is_measured():
    m = TraceModel(num_layers=1, num_experts=64, top_k=1, zipf_s=0.0, reuse_p=0.6, seed=3)
    t = m.sample(5000)[:, 0, 0]
    same = (t[1:] == t[:-1]).double().mean().item()
    assert abs(same - (0.6 + 0.4 / 64)) < 0.03  # kept, or redrawn and landing on it by chance


def test_skew_and_reuse_raise_the_achievable_hit_rate():
    def best(m):
        seq = lookups(m.sample(600), [0, 1])
        return belady_hits(seq, 4, set()) / len(seq)

    uniform = best(TraceModel(2, 16, 2, seed=5))
    skewed = best(TraceModel(2, 16, 2, zipf_s=1.2, reuse_p=0.5, seed=5))
    assert skewed > uniform + 0.2


def test_lookups_order():
    trace = torch.tensor([[[3, 1], [0, 2]]])
    assert lookups(trace, [5, 7]) == [ExpertKey(5, 1), ExpertKey(5, 3), ExpertKey(7, 0), ExpertKey(7, 2)]


def test_bad_trace_model():
    with pytest.raises(ValueError, match="top_k"):
        TraceModel(1, 4, 5)
    with pytest.raises(ValueError, match="reuse_p"):
        TraceModel(1, 4, 1, reuse_p=2)
