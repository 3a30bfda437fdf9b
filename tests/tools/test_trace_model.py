"""The synthetic routing trace model (tiers.tools.trace): shapes, skew, reuse, determinism."""
from __future__ import annotations

import pytest
import torch

from tiers.loader.layout import ExpertKey
from tiers.policy.slot_cache import belady_hits
from tiers.tools.trace import TraceModel, lookups


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
