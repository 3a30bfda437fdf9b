"""Engine behaviours not covered by the end-to-end and slot property tests."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tiers
from tiers.loader.layout import ExpertKey
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


# -- the copy pipeline, observed through recording streams ----------------------------------------
def _recorded_manager(packed, staging=4, cache="lru", cpu="int8", cpu_share=None):
    from test_slots import Recorder, RecordingStreams

    from tiers.loader.packed import read_manifest
    from tiers.config import load_config
    from tiers.engine import TierManager
    from tiers.policy import plan_placement

    rec = Recorder()
    streams = RecordingStreams(rec)
    cfg = load_config({"tiers": {"gpu": {"fraction": 0.4, "staging_slots": staging, "cache": cache}, "cpu": (cpu_share or {"fraction": 0.5}) | {"precision": cpu}}})
    manifest = read_manifest(packed)
    mgr = TierManager(manifest, cfg, plan_placement(cfg, manifest), device=torch.device("cpu"), streams=streams, progress=False)
    return mgr, rec, streams


def test_dequantization_runs_on_its_own_stream_after_the_copy(packed_factory):
    mgr, rec, streams = _recorded_manager(packed_factory("mixtral"))
    assert len(streams.made) == 2 and mgr.dequant_stream is not mgr.copy_stream
    for L in (0, 1, 2, 0, 1, 2):
        for _ in mgr.serve_layer(L, list(range(8))):
            pass
    order = rec.order
    recorded_on = {id(o[2]): o[1] for o in order if o[0] == "record"}
    dq_waits = [o for o in order if o[0] == "wait" and o[1] is mgr.dequant_stream]
    readies = [o for o in order if o[0] == "record" and o[1] is mgr.dequant_stream]
    assert readies and len(dq_waits) == len(readies), "one wait per dequantization"
    assert all(recorded_on[id(o[2])] is mgr.copy_stream for o in dq_waits), "the dequant stream waits on the copy only"
    for i, o in enumerate(order):  # each such wait comes after its event was recorded
        if o in dq_waits:
            assert any(p[0] == "record" and p[2] is o[2] for p in order[:i])
    # a transit row is rewritten only after its last dequantization: the copy stream waits on those
    reused = [o for o in order if o[0] == "wait" and o[1] is mgr.copy_stream and recorded_on.get(id(o[2])) is mgr.dequant_stream]
    staging = sum(p.n_slots - mgr.hot_count[id(p)] for p in mgr.pools)
    assert len(reused) >= len(readies) - staging


@pytest.mark.parametrize("cache", ["lru", "forecast", "markov"])
def test_parts_of_a_layer_call_alternate_between_slot_halves(packed_factory, cache):
    """More misses than staging slots: each part takes at most half the slots, and never the slots
    the part just before it reads, so its copies do not wait for that part's kernels."""
    import tiers.integration as integ

    mgr, _, _ = _recorded_manager(packed_factory("mixtral"), staging=4, cache=cache)
    layer = 1
    misses = [e for e in range(8) if not mgr.table[ExpertKey(layer, e)].pinned]
    assert len(misses) > 4
    mgr.begin_call(layer, list(range(8)), 16)
    parts = integ._chunks(mgr, layer, list(range(8)))
    assert all(sum(not mgr.table[ExpertKey(layer, e)].pinned for e in p) <= 2 for p in parts)
    previous: set[int] = set()
    for part in parts:
        held = mgr.acquire_layer(layer, part)
        slots = {h.slot for h in held if not mgr.table[h.key].pinned}
        assert not slots & previous, f"part {part} reuses the slots {slots & previous} of the part before"
        for h in held:
            mgr.wait(h)
            mgr.release(h)
        previous = slots


def test_slot_maps_are_exact_and_never_alias_the_ring(packed_factory, device):
    """expert -> slot maps for the grouped forward: listed experts map to their slots, the rest and
    the sentinel to n_slots; on CUDA the source is pinned (a non_blocking copy from pageable memory
    would wait for the compute stream to drain) and the result lives on the device."""
    mgr = manager_of(tiers.load(packed_factory("mixtral"), INT8, device=device, progress=False))
    pool = mgr.pool_of[0]
    assert all(m.is_pinned() for m in mgr.maps) == (device.type == "cuda")
    maps = [mgr.slot_map(0, [1, 5], [3, 0]) for _ in range(mgr.MAPS + 3)]  # around the ring and past it
    first = mgr.slot_map(0, [2], [1])
    second = mgr.slot_map(0, [7], [4])
    want = torch.full((9,), pool.n_slots, dtype=torch.int64)
    want[[1, 5]] = torch.tensor([3, 0])
    for m in maps:
        assert m.device.type == device.type and torch.equal(m.cpu(), want)
    assert first.cpu()[2] == 1 and first.cpu()[7] == pool.n_slots  # not changed by the next map
    assert second.cpu()[7] == 4 and second.cpu()[2] == pool.n_slots


@pytest.mark.parametrize("cpu", ["int8", "bf16"])
def test_wait_all_waits_once_per_stream_on_the_latest_copy(packed_factory, cpu):
    """A layer call's held experts: the compute stream waits once per stream that wrote them, on
    the latest of their ready events (a stream runs in order, so it covers the others), and every
    one of their ready events was recorded on that stream no later than the one waited on. With
    bf16 warm and INT8 cold experts the writes end on two streams (copy and dequant)."""
    mgr, rec, streams = _recorded_manager(packed_factory("mixtral"), staging=6, cpu=cpu)
    layer = 1
    experts = list(range(8))
    held = mgr.acquire_layer(layer, experts[:6])
    assert held is not None
    pending = {h.slot: (h.pool.ready[h.slot], h.pool.ready_on[h.slot][0]) for h in held if h.pool.ready[h.slot] is not None}
    assert len(pending) >= 2, "the call must stage several experts"
    start = len(rec.order)
    mgr.wait_all(held)
    waits = [o for o in rec.order[start:] if o[0] == "wait"]
    streams_used = {id(st) for _, st in pending.values()}
    assert len(waits) == len(streams_used) and all(w[1] is streams.compute for w in waits)
    where = {id(o[2]): i for i, o in enumerate(rec.order) if o[0] == "record"}
    for w in waits:
        on = next(st for ev, st in pending.values() if ev is w[2])
        covered = [ev for ev, st in pending.values() if st is on]
        assert all(where[id(ev)] <= where[id(w[2])] for ev in covered), "an expert's copy is not covered by the wait"
        assert all(rec.order[where[id(ev)]][1] is on for ev in covered)
    assert all(h.pool.ready[h.slot] is None for h in held)
    mgr.release_all(held)


def test_release_all_records_one_last_read_for_the_staged_and_none_for_hot(packed_factory):
    mgr, rec, streams = _recorded_manager(packed_factory("mixtral"), staging=3)
    layer = next(L for L in mgr.manifest.layers if L not in mgr.static_maps and any(mgr.table[ExpertKey(L, e)].pinned for e in range(8)))
    hot = [e for e in range(8) if mgr.table[ExpertKey(layer, e)].pinned]
    staged = [e for e in range(8) if e not in hot][:3]
    assert hot and staged
    held = mgr.acquire_layer(layer, sorted(hot + staged))
    mgr.wait_all(held)
    before = {h.slot: h.pool.last_read[h.slot] for h in held}
    start = len(rec.order)
    mgr.release_all(held)
    records = [o for o in rec.order[start:] if o[0] == "record"]
    assert len(records) == 1 and records[0][1] is streams.compute
    for h in held:
        if h.key.expert in hot:
            assert h.pool.last_read[h.slot] is before[h.slot]
        else:
            assert h.pool.last_read[h.slot] is records[0][2]
    assert all(r == 0 for p in mgr.pools for r in p.readers)


def test_upload_ints_is_exact_and_never_aliases_the_ring(packed_factory, device):
    mgr = manager_of(tiers.load(packed_factory("mixtral"), INT8, device=device, progress=False))
    values = [[i * 7 - 3 for i in range(n)] for n in (1, 5, 4 * mgr.HOST_ROUTED_ROWS + mgr.pools[0].n_slots)]
    got = [mgr.upload_ints(v) for _ in range(mgr.MAPS + 2) for v in values]  # around the ring and past it
    for i, t in enumerate(got):
        want = values[i % len(values)]
        assert t.device.type == device.type and t.dtype == torch.int32 and t.cpu().tolist() == want


def test_upload_int_lists_packs_lists_into_the_fewest_uploads(packed_factory, device):
    """Lists go up in order, exact, several per pinned buffer while they fit, a new upload when
    the next would not (here: 3 uploads for 2 + 1 + 2 lists)."""
    mgr = manager_of(tiers.load(packed_factory("mixtral"), INT8, device=device, progress=False))
    room = 2 * len(mgr.maps[0])  # int32 entries per pinned buffer
    sizes = [room // 3, room // 3, room - 1, 1, room // 2, room // 2]
    lists = [[i * 1000 + j for j in range(n)] for i, n in enumerate(sizes)]
    uploads, upload = [], mgr.upload_ints
    mgr.upload_ints = lambda v, *a, **kw: uploads.append(len(v)) or upload(v, *a, **kw)
    got = mgr.upload_int_lists(lists)
    assert [t.cpu().tolist() for t in got] == lists and all(t.dtype == torch.int32 and t.device.type == device.type for t in got)
    assert uploads == [sizes[0] + sizes[1], sizes[2] + sizes[3], sizes[4] + sizes[5]]
    # the same on the copy stream, read on the current one (on CUDA: its own copies, then this stream waits)
    got = mgr.upload_int_lists(lists, on=mgr.copy_stream)
    assert [t.tolist() for t in got] == lists and all(t.dtype == torch.int32 and t.device.type == device.type for t in got)


def test_an_upload_on_the_copy_stream_is_waited_for_by_the_current_one(packed_factory):
    """Recording streams: ``upload_int_lists(..., on=copy)`` records an event on the copy stream
    after its uploads, and the current (compute) stream waits on it before returning."""
    mgr, rec, streams = _recorded_manager(packed_factory("mixtral"))
    start = len(rec.order)
    got = mgr.upload_int_lists([[1, 2], [3]], on=mgr.copy_stream)
    assert [t.tolist() for t in got] == [[1, 2], [3]]
    order = rec.order[start:]
    at = next(i for i, o in enumerate(order) if o[0] == "record" and o[1] is mgr.copy_stream)
    assert any(o[0] == "wait" and o[1] is streams.current() and o[2] is order[at][2] for o in order[at:])


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(0, 300), st.integers(1, 5), min_size=1, max_size=40), st.integers(1, 20))
def test_windows_partition_the_rows_and_keep_every_slot_at_its_offset(slot_rows, gap):
    import tiers.integration as integ

    items = sorted(slot_rows.items())
    old, integ.WINDOW_GAP = integ.WINDOW_GAP, gap
    try:
        windows = integ._windows(items)
    finally:
        integ.WINDOW_GAP = old
    row = 0
    for i, w in enumerate(windows):
        assert w["a"] == row and len(w["offs"]) == w["hi"] - w["lo"]
        assert all(x <= y for x, y in zip(w["offs"], w["offs"][1:])) and w["offs"][-1] == w["b"] - w["a"]
        inside = [(s, n) for s, n in items if w["lo"] <= s < w["hi"]]
        assert inside[0][0] == w["lo"] and inside[-1][0] == w["hi"] - 1
        assert all(t - s - 1 < gap for (s, _), (t, _) in zip(inside, inside[1:])), "a window spans a gap it should have closed at"
        for s, n in inside:  # each slot's rows sit at its offsets: end minus start is its count
            before = w["offs"][s - w["lo"] - 1] if s > w["lo"] else 0
            assert w["offs"][s - w["lo"]] - before == n
        if i:
            assert w["lo"] - windows[i - 1]["hi"] >= gap, "a window closed before a gap of WINDOW_GAP empty slots"
        row = w["b"]
    assert row == sum(slot_rows.values())


def test_streams_current_and_use_follow_the_device_module(device):
    """``Streams.current`` is the device's current stream, and ``use(s)`` makes ``s`` current
    inside and restores the previous one after, nested and inside a caller's own stream context
    (on CUDA through the engine's own fast path, checked against torch's)."""
    from tiers.engine import Streams

    st = Streams(device)
    mod = torch.get_device_module(device)
    now = (lambda: mod.current_stream(device)) if device.type == "cuda" else mod.current_stream
    base = now()
    assert st.current() == base
    a, b, user = st.new_stream(), st.new_stream(), st.new_stream()
    with st.use(a):
        assert now() == a and st.current() == a
        with st.use(b):
            assert now() == b and st.current() == b
        assert now() == a and st.current() == a
    assert now() == base and st.current() == base
    with mod.stream(user):
        assert st.current() == user
        with st.use(a):
            assert now() == a
        assert now() == user and st.current() == user
    assert now() == base
    if device.type == "cuda":  # work queued inside use() runs on that stream
        x = torch.ones(1 << 20, device=device)
        with st.use(a):
            y = x * 2
            ev = st.event()
            ev.record(a)
        ev.synchronize()
        assert float(y[0]) == 2.0 and a.query()
