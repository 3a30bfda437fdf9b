"""Small index uploads (tiers.transfer.uploads): exact, from the pinned ring in the host pool, never aliasing it."""
from __future__ import annotations

import torch

from tier_fakes import recorded_manager
import tiers
from tiers.api import manager_of
from tiers.paths.routing import HOST_ROUTED_ROWS

INT8 = {"tiers": {"gpu": {"fraction": 0.25, "staging_slots": 2}, "cpu": {"fraction": 0.4}, "nvme": {"precision": "int8"}}}


def test_slot_maps_are_exact_and_never_alias_the_ring(packed_factory, device):
    """expert -> slot maps for the grouped forward: listed experts map to their slots, the rest and
    the sentinel to n_slots; the sources are views of the host pool (pinned on CUDA: a non_blocking
    copy from pageable memory would wait for the compute stream to drain) and the result lives on
    the device."""
    mgr = manager_of(tiers.load(packed_factory("mixtral"), INT8, device=device, progress=False))
    up, slab = mgr.uploads, mgr.host.slab
    pool = mgr.pool_of[0]
    assert mgr.host.pinned == (device.type == "cuda")
    assert all(slab.data_ptr() <= b.data_ptr() < slab.data_ptr() + slab.numel() for b in up._bufs), "buffers live in the host pool"
    assert mgr.host.parts["uploads"] >= up.BUFFERS * up._bufs[0].numel() * 8
    maps = [up.slot_map(8, pool.n_slots, [1, 5], [3, 0]) for _ in range(up.BUFFERS + 3)]  # around the ring and past it
    first = up.slot_map(8, pool.n_slots, [2], [1])
    second = up.slot_map(8, pool.n_slots, [7], [4])
    want = torch.full((9,), pool.n_slots, dtype=torch.int64)
    want[[1, 5]] = torch.tensor([3, 0])
    for m in maps:
        assert m.device.type == device.type and m.dtype == torch.int64 and torch.equal(m.cpu(), want)
    assert first.cpu()[2] == 1 and first.cpu()[7] == pool.n_slots  # not changed by the next map
    assert second.cpu()[7] == 4 and second.cpu()[2] == pool.n_slots


def test_upload_ints_is_exact_and_never_aliases_the_ring(packed_factory, device):
    mgr = manager_of(tiers.load(packed_factory("mixtral"), INT8, device=device, progress=False))
    up = mgr.uploads
    values = [[i * 7 - 3 for i in range(n)] for n in (1, 5, 4 * HOST_ROUTED_ROWS + mgr.pools[0].n_slots)]
    got = [up.ints(v) for _ in range(up.BUFFERS + 2) for v in values]  # around the ring and past it
    for i, t in enumerate(got):
        want = values[i % len(values)]
        assert t.device.type == device.type and t.dtype == torch.int32 and t.cpu().tolist() == want
    wide = up.ints([1 << 40, -5], dtype=torch.int64)
    assert wide.dtype == torch.int64 and wide.cpu().tolist() == [1 << 40, -5]


def test_upload_int_lists_packs_lists_into_the_fewest_uploads(packed_factory, device):
    """Lists go up in order, exact, several per pinned buffer while they fit, a new upload when
    the next would not (here: 3 uploads for 2 + 1 + 2 lists)."""
    mgr = manager_of(tiers.load(packed_factory("mixtral"), INT8, device=device, progress=False))
    up = mgr.uploads
    room = up.room  # int32 entries per pinned buffer
    assert room == 2 * len(up._bufs[0])
    sizes = [room // 3, room // 3, room - 1, 1, room // 2, room // 2]
    lists = [[i * 1000 + j for j in range(n)] for i, n in enumerate(sizes)]
    uploads, upload = [], up.ints
    up.ints = lambda v, *a, **kw: uploads.append(len(v)) or upload(v, *a, **kw)
    got = up.int_lists(lists)
    assert [t.cpu().tolist() for t in got] == lists and all(t.dtype == torch.int32 and t.device.type == device.type for t in got)
    assert uploads == [sizes[0] + sizes[1], sizes[2] + sizes[3], sizes[4] + sizes[5]]
    # the same on the copy stream, read on the current one (on CUDA: its own copies, then this stream waits)
    got = up.int_lists(lists, on=mgr.staging.copy_stream)
    assert [t.cpu().tolist() for t in got] == lists and all(t.dtype == torch.int32 and t.device.type == device.type for t in got)


def test_an_upload_on_the_copy_stream_is_waited_for_by_the_current_one(packed_factory):
    """Recording streams: ``int_lists(..., on=copy)`` records an event on the copy stream after
    its uploads, and the current (compute) stream waits on it before returning."""
    mgr, rec, streams = recorded_manager(packed_factory("mixtral"), {"gpu": {"fraction": 0.4, "staging_slots": 4}})
    copy = mgr.staging.copy_stream
    start = len(rec.order)
    got = mgr.uploads.int_lists([[1, 2], [3]], on=copy)
    assert [t.tolist() for t in got] == [[1, 2], [3]]
    order = rec.order[start:]
    at = next(i for i, o in enumerate(order) if o[0] == "record" and o[1] is copy)
    assert any(o[0] == "wait" and o[1] is streams.current() and o[2] is order[at][2] for o in order[at:])
