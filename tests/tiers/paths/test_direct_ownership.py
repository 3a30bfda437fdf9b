"""Direct decode's slot ownership (tiers.paths.direct), a property test: while decode stages come and
go, their reserved slots stay theirs, never handed to the host-routed path, and hold exactly their picks.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiers
from blob_files import decoded
from tiers.api import manager_of
from tiers.loader.layout import ExpertKey
from tiers.store.table import SlotState
from untiered import assert_consistent

_OPS = st.lists(st.tuples(st.sampled_from(["begin", "end", "direct", "acquire", "host"]),
                          st.integers(0, 2), st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True)),
                min_size=1, max_size=30)


@pytest.fixture(scope="module")
def direct_manager(packed_factory):
    cfg = {"tiers": {"gpu": {"fraction": 0.6, "staging_slots": 8}, "cpu": {"budget": "64MiB", "precision": "int8"},
                     "nvme": {"precision": "int8"}}}
    packed = packed_factory("qwen3_moe")
    mgr = manager_of(tiers.load(packed, cfg, device="cpu", progress=False))
    mgr.staging.direct_reads = mgr.direct.enabled = True  # the torch reference on the CPU
    return mgr, packed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_decode_stages_keep_slot_ownership(direct_manager, ops):
    """Random decode stages, direct calls and host-routed calls (``host``: as the manager runs one in
    the decode stage, giving a pool's reserved slots back first; ``acquire``: without): while a stage
    runs its reserved slots stay reserved and empty in the table, never handed to the host-routed
    path; each direct call leaves every pick that is not hot in a reserved slot holding exactly its
    decoded blob (distinct picks in distinct slots) and every hot pick pointing at its hot slot;
    after a stage nothing is held or reserved."""
    mgr, packed = direct_manager
    d = mgr.direct
    for op, layer, experts in ops:
        pool = mgr.pool_of[layer]
        if op == "begin":
            mgr.begin_decode()
        elif op == "end":
            mgr.end_decode()
        elif op == "direct":
            if not d.qualifies(layer, len(experts)):
                assert not d.reserved
                continue
            t = d.layers[layer]
            ids = d._fetch(t, layer, torch.tensor([experts]), t.counts)[0].tolist()
            reserved = mgr.table.reserved_slots(pool.index, "direct")
            assert len(set(ids)) == len(ids), "two picks of a call share a slot"
            for e, slot in zip(experts, ids):
                r = mgr.table[ExpertKey(layer, e)]
                if r.hot:
                    assert slot == r.slot
                else:
                    assert slot in reserved
                    want = decoded(packed, ExpertKey(layer, e), "int8")
                    assert all(torch.equal(pool.tensors(slot)[n], want[n]) for n in want)
            # the slot cache: one expert per lane, each non-hot pick's lane naming its cell
            cache = d.reserved[pool.index].cache
            owners = [c for c in cache.owner.tolist() if c >= 0]
            assert len(owners) == len(set(owners)), "an expert in two reserved slots"
            row = mgr.table.grid.row[layer] * cache.width
            for e, slot in zip(experts, ids):
                if not mgr.table[ExpertKey(layer, e)].hot:
                    assert cache.owner[cache.slots.tolist().index(slot)] == row + e
        else:
            if op == "host":
                d.leave(pool)
            reserved = {s for p in d.reserved for s in mgr.table.reserved_slots(p, "direct")}
            held = mgr.slots.acquire_layer(layer, sorted(experts))
            if held is not None:
                assert not any(h.slot in reserved for h in held), "a host-routed call got a reserved slot"
                mgr.slots.wait_all(held)
                mgr.slots.release_all(held)
            else:
                assert reserved, "only reserved slots keep a call from its slots"
        for p in mgr.pools:
            slots = mgr.table.reserved_slots(p.index, "direct")
            assert bool(slots) == (p.index in d.reserved), "the table's reservations are direct decode's"
            for s in slots:
                assert mgr.table.state(p.index, s) is SlotState.RESERVED and mgr.table.reserved(p.index, s) == "direct"
            if slots:
                assert d.reserved[p.index].cache.slots.tolist() == slots, "the device's slot cache covers the reserved slots"
        mgr.table.check()
    mgr.end_decode()
    mgr.slots.drain()
    assert_consistent(mgr)
