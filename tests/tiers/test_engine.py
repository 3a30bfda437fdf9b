"""Engine behaviours not covered by the end-to-end and slot property tests."""
from __future__ import annotations

import pytest
import torch

import tiers
from tiers.integration import manager_of

INT8 = {"tiers": {"gpu": {"fraction": 0.25, "staging_slots": 2}, "cpu": {"fraction": 0.4}, "nvme": {"precision": "int8"}}}


def test_stopping_early_releases_every_held_slot(packed_factory, device):
    mgr = manager_of(tiers.load(packed_factory("mixtral"), INT8, device=device, progress=False))
    gen = mgr.serve_layer(0, list(range(8)))
    next(gen)  # one yielded, more acquired ahead
    assert sum(sum(p.readers) for p in mgr.pools) >= 2
    gen.close()
    assert all(r == 0 for p in mgr.pools for r in p.readers)
    # and the layer can be served in full afterwards
    assert [e for e, _ in mgr.serve_layer(0, list(range(8)))] == list(range(8))


def test_an_exception_in_the_caller_releases_slots(packed_factory):
    mgr = manager_of(tiers.load(packed_factory("mixtral"), INT8, device="cpu", progress=False))
    with pytest.raises(ZeroDivisionError):
        for _e, _w in mgr.serve_layer(1, [0, 3, 5, 7]):
            1 / 0
    assert all(r == 0 for p in mgr.pools for r in p.readers)


def test_more_misses_than_staging_slots_in_one_call(packed_factory):
    mgr = manager_of(tiers.load(packed_factory("mixtral"), {"tiers": {"gpu": {"fraction": 0.2, "staging_slots": 1}}},
                                device="cpu", progress=False))
    served = [e for e, w in mgr.serve_layer(2, list(range(8)))]
    assert served == list(range(8))
    s = mgr.stats()
    assert s.hits["cpu"] + s.hits["nvme"] + s.hits["gpu"] == 8


def test_cached_staging_slot_is_a_gpu_hit(packed_factory):
    mgr = manager_of(tiers.load(packed_factory("mixtral"), INT8, device="cpu", progress=False))
    cold = mgr.placement.cold[0]
    for _ in mgr.serve_layer(cold.layer, [cold.expert]):
        pass
    before = mgr.stats().hits["gpu"]
    for _e, w in mgr.serve_layer(cold.layer, [cold.expert]):
        assert all(t.dtype == torch.bfloat16 for t in w.values())
    s = mgr.stats()
    assert s.hits["gpu"] == before + 1
    assert s.gpu_slots["cached"] >= 1
