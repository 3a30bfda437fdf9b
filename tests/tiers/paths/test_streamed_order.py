"""Streamed calls on recording streams (tiers.paths.streamed): the order of each part's reads, the
copy and compute streams' waits, and its kernels, so a slot or transit row is rewritten only after
its last read.
"""
from __future__ import annotations

import pytest

from streamed_helpers import staged_layers, tiers_config
from tier_fakes import recorded_manager, waits_between
from tiers.loader.layout import ExpertKey
from untiered import assert_consistent


def _spy_reads(mgr, rec) -> None:
    """Log ("read", slot, key) for each copy a part queues (one driver batch of bf16 blobs)."""
    write_part, write = mgr.staging.write_part, mgr.staging.write

    def spy_part(pool, blob, slots, srcs):
        done = write_part(pool, blob, slots, srcs)
        if done:
            rec.order.extend(("read", slot, mgr.table.occupant(pool.index, slot)) for slot in slots)
        return done

    def spy_write(key, pool, slot, *a, **kw):
        rec.order.append(("read", slot, key))
        return write(key, pool, slot, *a, **kw)

    mgr.staging.write_part, mgr.staging.write = spy_part, spy_write


@pytest.mark.parametrize("first_two", [False, True])
@pytest.mark.parametrize("cached", [0, 1, 3])
def test_streamed_parts_read_after_the_part_before_last_and_before_their_kernels(cached, first_two, packed_factory):
    """Recording streams: part p's reads come after the copy stream waited on the event recorded
    after part p - 2's kernels (the same buffer) and before the compute stream's wait for them,
    which precedes part p's kernels; parts alternate between two disjoint buffers. With ``cached``
    of the call's experts staged into staging slots first (their writes not yet waited on), those
    are not read again: they open parts 0 and 1, and the compute stream waits on their writes
    before those kernels. ``first_two``: parts 0 and 1 are queued before any kernel, as ``run`` does."""
    mgr, rec, _ = recorded_manager(packed_factory("qwen3_moe"), tiers_config(fraction=0.4))
    layer = staged_layers(mgr)[0]
    pool = mgr.pool_of[layer]
    warm = [e for e in range(8) if not mgr.table[ExpertKey(layer, e)].hot]
    ahead = warm[-cached:] if cached else []
    for e in ahead:
        key = ExpertKey(layer, e)
        assert mgr.slots.claim(key, mgr.table[key], pool) is not None
    pre_ready = {mgr.table[ExpertKey(layer, e)].slot: mgr.table.ready_event(pool.index, mgr.table[ExpertKey(layer, e)].slot) for e in ahead}
    assert all(ev is not None for ev in pre_ready.values())
    _spy_reads(mgr, rec)
    path = mgr.streamed
    s = path.plan(layer, list(range(8)))
    assert len(s.parts) >= 3, "the test needs three parts or more"
    assert len(s.buffers) == 2 and not set(s.buffers[0]) & set(s.buffers[1])
    assert s.preloaded == set(ahead) and s.preloaded <= set(s.parts[0] + s.parts[1])
    assert sorted(e for part in s.parts for e in part) == warm and all(mgr.table[h.key].hot for h in s.held)
    kernels = {}
    path.read_part(s, 0)
    if first_two:
        path.read_part(s, 1)
    mgr.slots.wait_all(s.held)
    for p in range(len(s.parts)):
        if p + 1 < len(s.parts) and not (first_two and p == 0):
            path.read_part(s, p + 1)
        path.wait_part(s, p)
        kernels[p] = len(rec.order)
        rec.order.append(("kernels", p, None))
        path.end_part(s, p)
    path.end(s)
    order = rec.order
    compute, copy = mgr.streams.current(), mgr.staging.copy_stream
    for p, part in enumerate(s.parts):
        for e, slot in zip(part, s.part_slots[p]):
            if e in s.preloaded:  # no read; its write (or a later event on that stream) is waited on before the part's kernels
                at = next(i for i, o in enumerate(order) if o[0] == "record" and o[2] is pre_ready[slot])
                later = {id(o[2]) for o in order[at:] if o[0] == "record" and o[1] is order[at][1]}
                assert any(o[0] == "wait" and o[1] is compute and id(o[2]) in later for o in order[at:kernels[p]]), f"part {p}, slot {slot}"
        part = [e for e in part if e not in s.preloaded]
        if not part:
            continue
        at = [i for i, o in enumerate(order) if o[0] == "read" and o[2] in {ExpertKey(layer, e) for e in part}]
        assert len(at) == len(part) and {order[i][1] for i in at} == {sl for e, sl in zip(s.parts[p], s.part_slots[p]) if e in part}
        if p >= 2:
            freed = next(o[2] for o in order[kernels[p - 2]:] if o[0] == "record" and o[1] is compute)
            assert waits_between(order, kernels[p - 2], at[0], copy, freed), f"part {p}"
        # the compute stream waits on an event recorded after the part's reads, before its kernels
        waits = [o[2] for o in order[at[-1]:kernels[p]] if o[0] == "wait" and o[1] is compute]
        recorded_after = {id(o[2]) for o in order[at[-1]:kernels[p]] if o[0] == "record"}
        assert any(id(ev) in recorded_after for ev in waits), f"part {p}: kernels do not wait for its reads"
    # each buffer goes back with the event recorded right after its last part's kernels
    for h, buffer in enumerate(s.buffers):
        last = max(p for p in range(len(s.parts)) if p % 2 == h)
        after = next(o[2] for o in order[kernels[last]:] if o[0] == "record" and o[1] is compute)
        assert all(mgr.table.last_read(pool.index, slot) is after for slot in buffer), f"buffer {h}"
    assert_consistent(mgr)


def test_a_streamed_call_that_fails_gives_its_slots_back_after_its_reads(packed_factory):
    """A call that stops after queuing part 0's reads, before its kernels: every reserved slot
    goes back with one last-read event recorded after the compute stream waited on those reads."""
    mgr, rec, _ = recorded_manager(packed_factory("qwen3_moe"), tiers_config(fraction=0.4))
    layer = staged_layers(mgr)[0]
    pool, compute = mgr.pool_of[layer], mgr.streams.current()
    s = mgr.streamed.plan(layer, list(range(8)))
    mgr.streamed.read_part(s, 0)
    read_events = {id(mgr.table.ready_event(pool.index, slot)) for slot in s.part_slots[0]}
    start = len(rec.order)
    mgr.streamed.end(s)
    tail = rec.order[start:]
    waited = next(i for i, o in enumerate(tail) if o[0] == "wait" and o[1] is compute and id(o[2]) in read_events)
    ev = next(o[2] for o in tail[waited:] if o[0] == "record" and o[1] is compute)
    assert all(mgr.table.last_read(pool.index, slot) is ev for b in s.buffers for slot in b)
    assert_consistent(mgr)


def test_a_streamed_int8_part_copies_into_rows_only_after_their_last_dequantization(packed_factory):
    """Recording streams: before a part's first copy the copy stream waits on the last
    dequantization of every transit row the part writes (rows are reused part after part)."""
    mgr, rec, _ = recorded_manager(packed_factory("qwen3_moe"), tiers_config("int8", fraction=0.4))
    staging = mgr.staging
    pid = mgr.pools[0].index
    check, dequantize = staging._check_pinned, staging._dequantize
    staging._check_pinned = lambda src: rec.order.append(("copy", None, src.numel())) or check(src)
    stacks = []
    staging._dequantize = lambda b, g: stacks.append((g.row, len(g.slots))) or dequantize(b, g)
    checked = 0
    for layer in staged_layers(mgr) * 2:
        s = mgr.streamed.plan(layer, list(range(8)))
        for p in range(len(s.parts)):
            before = dict(staging.transit_done)
            start = len(rec.order)
            n_stacks = len(stacks)
            mgr.streamed.read_part(s, p)
            if len(stacks) == n_stacks:  # cached experts alone: nothing read
                mgr.streamed.wait_part(s, p)
                mgr.streamed.end_part(s, p)
                continue
            row0, k = stacks[-1]
            first = next(i for i in range(start, len(rec.order)) if rec.order[i][0] == "copy")
            for r in range(row0, row0 + k):
                ev = before.get((pid, r))
                if ev is not None:
                    assert waits_between(rec.order, start, first, staging.copy_stream, ev), f"layer {layer} part {p} row {r}"
                    checked += 1
            mgr.streamed.wait_part(s, p)
            mgr.streamed.end_part(s, p)
        mgr.streamed.end(s)
    assert checked > 4
