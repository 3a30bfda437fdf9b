"""Direct stacks (tiers.transfer.staging): the host-routed path's small warm misses, decoded by one
launch straight from the pinned pool into their staging slots (forced on the CPU, the default on CUDA).
"""
from __future__ import annotations

import random

import torch

import tiers
from tiers import report
from blob_files import decoded
from tier_fakes import recorded_manager
from tiers.api import manager_of
from tiers.loader.layout import ExpertKey
from tiers.store.table import Home
from tiers.transfer.staging import Staging
from untiered import assert_consistent


def test_direct_stacks_serve_the_decoded_blob(device, packed_factory):
    """Random layer calls staged through direct stacks (forced on the CPU, the default on CUDA):
    every slot holds exactly its blob dequantized alone (warm ones from the pool, cold ones from
    their slot's ring buffer), and no copy into a transit row is made."""
    cfg = {"tiers": {"gpu": {"fraction": 0.6, "staging_slots": 6}, "cpu": {"fraction": 0.25, "precision": "int8"}, "nvme": {"precision": "int8"}}}
    packed = packed_factory("qwen3_moe")
    mgr = manager_of(tiers.load(packed, cfg, device=device, progress=False))
    if device.type == "cpu":
        mgr.staging.direct_reads = True
    assert mgr.staging.direct_reads
    copies = []
    mgr.staging._stage_copy = lambda *a: copies.append(a)
    rng = random.Random(0)
    layers = [L for L in mgr.manifest.layers if not mgr.resident.qualifies(L)]
    checked, cold = 0, 0
    for _ in range(30):
        layer = rng.choice(layers)
        held = mgr.slots.acquire_layer(layer, sorted(rng.sample(range(8), rng.randint(2, 6))))
        mgr.slots.wait_all(held)
        for h in held:
            r = mgr.table[h.key]
            if not r.hot:
                want = decoded(packed, h.key, mgr.staging.precision_of(r), device)
                for name, t in h.tensors.items():
                    assert torch.equal(t, want[name]), f"{h.key} {name}"
                checked += 1
                cold += r.home is Home.NVME
        mgr.slots.release_all(held)
    assert checked > 30 and cold > 0 and not copies
    assert report.stats(mgr).direct["stacks"] > 0
    assert_consistent(mgr)


def test_a_direct_stack_reads_after_the_slots_last_reads_and_before_its_ready_event(packed_factory):
    """Recording streams: a direct stack's launch (a use of the copy stream) comes after the copy
    stream waited on the last read of every slot it rewrites; its slots' ready event is recorded
    on the copy stream after the launch; stacks hold at most ``STACK_EXPERTS`` experts."""
    mgr, rec, _ = recorded_manager(packed_factory("qwen3_moe"), {"gpu": {"fraction": 0.4, "staging_slots": 4},
                                                                 "cpu": {"fraction": 0.5, "precision": "int8"}})
    mgr.staging.direct_reads = True
    pool = mgr.pools[0]
    stacks = []
    fetch = mgr.staging._fetch_stack

    def spy(pool_, blob, src, starts, slots, stream, tensors=None):
        if src is mgr.staging.host.slab:  # a direct stack (else a decode from transit rows)
            rec.order.append(("fetch", None, tuple(slots)))
            stacks.append(tuple(slots))
        fetch(pool_, blob, src, starts, slots, stream, tensors)

    mgr.staging._fetch_stack = spy
    layers = [L for L in mgr.manifest.layers if not mgr.resident.qualifies(L)]
    copy = mgr.staging.copy_stream
    checked = 0
    for round_ in range(12):
        layer = layers[round_ % len(layers)]
        misses = [e for e in range(8) if not mgr.table[ExpertKey(layer, e)].hot][:4]
        last_reads = {s: mgr.table.last_read(pool.index, s) for s in range(pool.n_slots)}
        start = len(rec.order)
        held = mgr.slots.acquire_layer(layer, misses)
        assert held is not None
        order = rec.order[start:]
        for slots in stacks:
            at = next(i for i, o in enumerate(order) if o[0] == "fetch" and o[2] == slots)
            ready = mgr.table.ready_event(pool.index, slots[0])
            assert len(slots) <= Staging.STACK_EXPERTS
            for s in slots:
                ev = last_reads[s]
                if ev is not None:
                    assert any(o[0] == "wait" and o[1] is copy and o[2] is ev for o in order[:at]), f"slot {s}"
                    checked += 1
            rec_at = next(i for i, o in enumerate(order) if o[0] == "record" and o[2] is ready)
            assert order[rec_at][1] is copy and rec_at > at
            for h in held:
                if h.slot in slots:
                    assert mgr.table.ready_event(pool.index, h.slot) is ready
        assert stacks, "the misses must be read by direct stacks"
        stacks.clear()
        mgr.slots.wait_all(held)
        mgr.slots.release_all(held)
    assert checked > 10
    assert_consistent(mgr)
