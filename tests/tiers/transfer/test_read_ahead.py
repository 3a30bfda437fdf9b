"""Read-ahead of cold misses (tiers.transfer.read_ahead.ReadAhead, used by tiers.slots.Slots): a
layer call's cold misses are read from disk on reader threads into their staging slots' ring
buffers, each slot held by its read until it lands, a failed read surfacing at the demand read."""
from __future__ import annotations

import shutil
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blob_files import corrupt_expert, decoded
import tiers
from tiers import report
from tiers.config import load_config
from tiers.loader.layout import ExpertKey
from tiers.loader.packed import read_manifest
from tiers.manager import Manager
from tiers.policy.placement import plan_placement
from tiers.store.table import Home, SlotState

COLD = {"tiers": {"gpu": {"fraction": 0.5, "staging_slots": 4}, "cpu": {"fraction": 0.0}, "nvme": {"precision": "bf16"}}}
MIXED = {"tiers": {"gpu": {"fraction": 0.5, "staging_slots": 4}, "cpu": {"fraction": 0.3, "precision": "bf16"}, "nvme": {"precision": "bf16"}}}


def manager(packed, doc=COLD, staging: int | None = None) -> Manager:
    if staging is not None:
        doc = {"tiers": {**doc["tiers"], "gpu": {**doc["tiers"]["gpu"], "staging_slots": staging}}}
    cfg = load_config(doc)
    m = read_manifest(packed)
    return Manager(m, cfg, plan_placement(cfg, m), device=torch.device("cpu"), progress=False)


def nothing_held(mgr) -> bool:
    return all(r == 0 for p in mgr.pools for r in mgr.table.readers(p.index))


def assert_exact(mgr, handles) -> None:
    for h in handles:
        want = decoded(mgr.manifest.root, h.key, "bf16")
        assert all(torch.equal(h.tensors[n], want[n]) for n in want), f"{h.key} differs from its blob"


def test_cold_misses_of_a_call_are_read_on_reader_threads(packed_factory, monkeypatch):
    mgr = manager(packed_factory("mixtral"))
    threads = []
    real = mgr.disk.read

    def spy(key, precision, out):
        threads.append(threading.current_thread().name)
        return real(key, precision, out)

    monkeypatch.setattr(mgr.disk, "read", spy)
    cold = [k for k in mgr.placement.cold if k.layer == 1][:2]
    assert len(cold) == 2
    held = mgr.slots.acquire_layer(1, [k.expert for k in cold])
    assert len(threads) == 2 and all(t.startswith("tiers-read") for t in threads)
    assert not mgr.read_ahead.pending and not mgr.slots.demand_reads, "every read landed and was looked up"
    mgr.slots.wait_all(held)
    assert_exact(mgr, held)
    mgr.slots.release_all(held)
    s = report.stats(mgr)
    assert s.read_ahead == {"reads": 2, "errors": 0}
    assert s.hits["nvme"] == 2 and s.hits["gpu"] == 0, "a read-ahead demand miss counts as an nvme hit"
    assert s.bytes_moved["nvme"] == sum(mgr.manifest.ref(k, "bf16").nbytes for k in cold)
    # a lone cold miss reads on the calling thread
    threads.clear()
    other = [k for k in mgr.placement.cold if k.layer == 2][0]
    held = mgr.slots.acquire_layer(2, [other.expert])
    mgr.slots.release_all(held)
    assert threads == [threading.current_thread().name]
    assert report.stats(mgr).read_ahead["reads"] == 2
    mgr.close()


def test_a_call_that_does_not_fit_reads_nothing_ahead(packed_factory):
    """More non-hot experts than unheld staging slots: no read-ahead (it would take a slot the call
    needs), and the call is not held."""
    mgr = manager(packed_factory("mixtral"))
    layer = 1
    cold = [k.expert for k in mgr.placement.cold if k.layer == layer]
    assert len(cold) > 4
    assert mgr.slots.acquire_layer(layer, cold) is None
    assert report.stats(mgr).read_ahead["reads"] == 0 and not mgr.read_ahead.pending
    assert nothing_held(mgr)
    mgr.close()


def test_a_read_ahead_holds_its_slot_until_it_lands(packed_factory):
    """A read in flight holds its slot: the cache offers it to no one (a read-ahead never takes a
    held slot and never evicts another read-ahead), a lookup of its expert lands it first, and a
    miss that finds every other slot held lands it before taking its slot."""
    mgr = manager(packed_factory("mixtral"), staging=3)
    pool = mgr.pools[0]
    cache, table = mgr.caches[pool.index], mgr.table
    cold = [k for k in mgr.placement.cold if k.layer == 2]
    held = [mgr.slots.acquire(k) for k in cold[:2]]  # three staging slots, two held
    free = cache.victim()
    assert free not in {h.slot for h in held}
    mgr.read_ahead.start(cold[2], pool, free)
    assert table.state(pool.index, free) is SlotState.IN_USE and table.occupant(pool.index, free) == cold[2]
    assert cache.victim() is None, "the read's slot is not offered while it is in flight"
    for h in held:
        assert table.occupant(pool.index, h.slot) == h.key
    got = mgr.slots.acquire(cold[2])
    assert got.slot == free and not mgr.read_ahead.pending
    mgr.slots.wait_all(held + [got])
    assert_exact(mgr, held + [got])
    mgr.slots.release_all([got])
    # every other slot held: a miss lands the read in flight first, then takes its slot
    mgr.read_ahead.start(cold[3], pool, cache.victim())
    assert cache.victim() is None
    late = mgr.slots.acquire(cold[4])
    assert late.slot == free and not mgr.read_ahead.pending and table[cold[3]].slot is None
    mgr.slots.wait_all([late])
    assert_exact(mgr, held + [late])
    mgr.slots.release_all(held + [late])
    assert nothing_held(mgr) and report.stats(mgr).read_ahead == {"reads": 2, "errors": 0}
    table.check()
    mgr.close()


def test_failed_read_ahead_surfaces_at_the_demand_read(packed_factory, tmp_path):
    packed = tmp_path / "p"
    shutil.copytree(packed_factory("mixtral"), packed)
    mgr = manager(packed)
    pool = mgr.pools[0]
    key = [k for k in mgr.placement.cold if k.layer == 1][0]
    corrupt_expert(packed, key, "bf16", where=100 / mgr.manifest.ref(key, "bf16").nbytes)
    mgr.read_ahead.start(key, pool, mgr.caches[pool.index].victim())
    mgr.slots.drain()
    assert report.stats(mgr).read_ahead == {"reads": 1, "errors": 1}
    assert mgr.table[key].slot is None and nothing_held(mgr)
    mgr.table.check()
    with pytest.raises(tiers.IntegrityError, match=f"layer {key.layer} expert {key.expert}"):
        mgr.slots.acquire(key)
    assert mgr.table[key].slot is None and nothing_held(mgr)
    mgr.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 7), max_size=4, unique=True),
                          st.lists(st.integers(0, 7), max_size=6, unique=True)), min_size=1, max_size=12),
       st.integers(2, 5))
def test_read_ahead_interleaved_with_layer_calls_never_corrupts_held_experts(packed_factory, calls, staging):
    """Layer calls (their cold misses read ahead), and while each call's experts are held, reads
    ahead of the next layer's cold experts into the cache's victims: every held expert stays
    exactly its own weights, and once every read landed nothing is held."""
    mgr = manager(packed_factory("mixtral"), MIXED, staging)
    pool = mgr.pools[0]
    cache, table = mgr.caches[pool.index], mgr.table
    try:
        for layer, used, predicted in calls:
            used = sorted(used)[:staging]
            held = mgr.slots.acquire_layer(layer, used)
            assert held is not None
            nxt = (layer + 1) % 3
            for e in predicted:  # read ahead while this layer's experts are held
                key = ExpertKey(nxt, e)
                r = table[key]
                if r.slot is not None or r.home is not Home.NVME:
                    continue
                slot = cache.victim()
                if slot is None:
                    break
                assert table.readers(pool.index)[slot] == 0 and slot not in {h.slot for h in held}
                mgr.read_ahead.start(key, pool, slot)
                cache.touch(slot)
            mgr.slots.wait_all(held)
            assert_exact(mgr, held)
            mgr.slots.release_all(held)
            table.check()
        mgr.slots.drain()  # read-aheads hold their slot until they land
        assert nothing_held(mgr)
        for s in pool.staging:
            k = table.occupant(pool.index, s)
            if k is not None:
                assert table[k].slot == s
                h = mgr.slots.hold_resident(k)
                mgr.slots.wait_all([h])
                assert_exact(mgr, [h])
                mgr.slots.release_all([h])
    finally:
        mgr.close()
