"""Batched host-to-device copies (tiers.transfer.h2d): many copies from pinned host memory, exact, in
one driver call on CUDA (one ``copy_`` each elsewhere); and staging's use of them for a streamed
part (``Staging.write_part``): one batch per part, bf16 misses straight into their slots, INT8
runs into transit rows."""
from __future__ import annotations

import threading

import pytest
import torch

import tiers
import tiers.transfer.staging as staging_mod
from tiers import report
from tiers.api import manager_of
from tiers.loader.layout import ExpertKey
from tiers.store.host_pool import HostPool
from tiers.transfer import h2d
from tiers.transfer.h2d import copy_batch

WARM = {"tiers": {"gpu": {"fraction": 0.25, "staging_slots": 4}, "cpu": {"budget": "64MiB", "precision": "bf16"}, "nvme": {"precision": "bf16"}}}


def _host_blocks(sizes: list[int], gap: int = 512) -> tuple[HostPool, list[torch.Tensor]]:
    """Blocks of random bytes of ``sizes``, ``gap`` bytes apart, in a host pool (pinned with CUDA)."""
    total = sum(sizes) + gap * len(sizes)
    pool = HostPool(total, pin=torch.cuda.is_available())
    slab = pool.view(pool.alloc(total, "blocks"), total)  # [total]
    slab.copy_(torch.randint(0, 256, slab.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(len(sizes))))
    blocks, at = [], gap
    for n in sizes:
        blocks.append(slab[at : at + n])
        at += n + gap
    return pool, blocks


def test_copy_batch_is_exact_and_leaves_the_rest(device):
    """Five blocks of unequal sizes, some typed as bf16 matrices, into scattered places of one
    device buffer: equal bytes, and every byte between them keeps what it held."""
    pool, blocks = _host_blocks([4000, 12288, 256, 8192, 1000])
    whole = torch.full((40000,), 7, dtype=torch.uint8, device=device)
    starts = [30000, 0, 20000, 21000, 38000]  # out of order, none overlapping
    dsts = [whole[a : a + b.numel()] for a, b in zip(starts, blocks)]
    srcs = list(blocks)
    dsts[1], srcs[1] = dsts[1].view(torch.bfloat16).view(64, 96), srcs[1].view(torch.bfloat16).view(64, 96)
    copy_batch(dsts, srcs, torch.cuda.Stream(device) if device.type == "cuda" else None)  # CUDA: the driver's batch
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    got = whole.cpu()
    mask = torch.ones(40000, dtype=torch.bool)
    for a, b in zip(starts, blocks):
        assert torch.equal(got[a : a + b.numel()], b), f"block at {a}"
        mask[a : a + b.numel()] = False
    assert (got[mask] == 7).all()
    pool.close()


def test_copy_batch_refuses_what_it_cannot_copy():
    src = torch.zeros(3, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"batched copy: \(3, 8\) torch.uint8 into \(3, 4\) torch.uint8, both must be contiguous"):
        copy_batch([torch.zeros(3, 4, dtype=torch.uint8)], [src])
    with pytest.raises(ValueError, match=r"batched copy: \(3, 8\) torch.uint8 into \(3, 8\) torch.int8"):
        copy_batch([torch.zeros(3, 8, dtype=torch.int8)], [src])
    with pytest.raises(ValueError, match=r"batched copy: \(3, 8\) torch.uint8 into \(3, 8\) torch.uint8, both must be contiguous"):
        copy_batch([torch.zeros(8, 3, dtype=torch.uint8).t()], [src])
    with pytest.raises(ValueError):  # as many sources as destinations
        copy_batch([src, src], [src])


class FakeDriver:
    """Records each batch's arrays and stream; answers ``rc``; has a current context or not."""

    def __init__(self, fail_index: bool, rc: int = 0, context: bool = True):
        self.batch_fail_index, self.calls, self.rc, self.context = fail_index, [], rc, context
        self.params = threading.local()

    def batch(self, dsts, srcs, sizes, n, attrs, idxs, n_attrs, *tail):
        a = attrs._obj
        assert len(tail) == (2 if self.batch_fail_index else 1), "12.8's entry point takes a failure index before the stream"
        self.calls.append((list(dsts), list(srcs), list(sizes), n, (a.srcAccessOrder, a.srcLocHint.type, a.dstLocHint.type,
                                                                      a.dstLocHint.id), list(idxs), n_attrs, tail[-1]))
        return self.rc

    def has_context(self):
        return self.context

    def name(self, rc):
        return f"CUDA_ERROR_{rc}"


@pytest.mark.parametrize("fail_index", [False, True])
def test_the_driver_gets_the_batch_its_order_and_stream(monkeypatch, fail_index):
    """CPU twin of the driver call, for CUDA 13's entry point and 12.8's: the addresses and byte
    sizes in order, one attribute for all copies (sources read in stream order, host to the
    device's memory), the stream; a thread without a current context gets the device's made
    current first, once; an error is raised with the batch's size."""
    made_current = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    drv = FakeDriver(fail_index)
    h2d._queue_batch(drv, [100, 200], [300, 400], [8, 16], 77, torch.device("cuda", 1))
    assert drv.calls == [([100, 200], [300, 400], [8, 16], 2, (h2d._ORDER_STREAM, h2d._LOC_HOST, h2d._LOC_DEVICE, 1), [0], 1, 77)]
    assert made_current == []
    drv = FakeDriver(fail_index, context=False)
    h2d._queue_batch(drv, [100], [300], [8], 77, torch.device("cuda", 0))
    h2d._queue_batch(drv, [100], [300], [8], 77, torch.device("cuda", 0))
    assert len(drv.calls) == 2 and made_current == [torch.device("cuda", 0)]
    drv = FakeDriver(fail_index, rc=1)
    with pytest.raises(RuntimeError, match=r"batched copy of 2 copies \(24 bytes\) failed: CUDA_ERROR_1"):
        h2d._queue_batch(drv, [100, 200], [300, 400], [8, 16], 77, torch.device("cuda", 0))


def cuda_only(test):
    """Marked as a CUDA test, and skipped with the reason where there is no CUDA device."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


def _cuda_targets(sizes: list[int]) -> tuple[torch.device, HostPool, list[torch.Tensor], list[torch.Tensor]]:
    """Host blocks of ``sizes`` (``_host_blocks``) and zeroed CUDA buffers of the same sizes."""
    device = torch.device("cuda")
    pool, blocks = _host_blocks(sizes)
    return device, pool, blocks, [torch.zeros(b.numel(), dtype=torch.uint8, device=device) for b in blocks]


@cuda_only
def test_copy_batch_is_queued_on_the_stream_given():
    """The batch runs on the stream given, after what that stream has queued: read on another
    stream while the given one sleeps, the bytes are still the old ones; after it, the new."""
    assert h2d.driver() is not None, "the H200 machine's driver has batched copies"
    device, pool, blocks, dsts = _cuda_targets([8000, 8000, 4096])
    side = torch.cuda.Stream(device)
    torch.cuda.synchronize(device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # a few tenths of a second of the side stream
    copy_batch(dsts, blocks, side)
    early = [d.cpu() for d in dsts]  # the current stream: not ordered after the side stream
    side.synchronize()
    assert not any(e.any() for e in early), "the batch did not wait for the stream it was queued on"
    assert all(torch.equal(d.cpu(), b) for d, b in zip(dsts, blocks))
    pool.close()


@cuda_only
def test_copy_batch_on_the_legacy_default_stream():
    """The driver refuses batches on the legacy default stream: there the copies go one by one."""
    device, pool, blocks, dsts = _cuda_targets([4096, 1000])
    assert torch.cuda.current_stream(device).cuda_stream == 0
    copy_batch(dsts, blocks)
    torch.cuda.synchronize(device)
    assert all(torch.equal(d.cpu(), b) for d, b in zip(dsts, blocks))
    pool.close()


@cuda_only
def test_copy_batch_from_a_thread_new_to_cuda():
    """A thread that never used CUDA has no current context for the driver: the batch still lands."""
    device, pool, blocks, dsts = _cuda_targets([4096, 4096])
    side = torch.cuda.Stream(device)
    errors = []

    def work():
        try:
            copy_batch(dsts, blocks, side)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    t = threading.Thread(target=work)
    t.start()
    t.join()
    side.synchronize()
    assert not errors and all(torch.equal(d.cpu(), b) for d, b in zip(dsts, blocks))
    pool.close()


def _pooled_layer(mgr) -> int:
    return next(L for L in mgr.manifest.layers if not mgr.resident.qualifies(L))


@pytest.mark.parametrize("swapped", [False, True])
@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_a_streamed_part_is_one_batch_and_lands_exactly(device, packed_factory, monkeypatch, precision, swapped):
    """A streamed part of warm misses is queued as one batch: bf16, each tensor of each expert
    straight into its slot, every slot then holding its expert's weights exactly; INT8, each run
    of blobs back to back in the host pool into transit rows, each slot then holding its
    expert's dequantized weights (equal to dequantizing its blob alone). ``swapped``: the part's
    two experts trade slots, so their blobs are no run (INT8: two copies, two transit rows)."""
    cfg = {"tiers": {"gpu": {"fraction": 0.25 if precision == "bf16" else 0.4, "staging_slots": 4},  # INT8: room for transit rows
                     "cpu": {"budget": "64MiB", "precision": precision}, "nvme": {"precision": precision}}}
    model = tiers.load(packed_factory("qwen3_moe"), cfg, device=device, progress=False)
    mgr = manager_of(model)
    streamed = mgr.streamed
    calls = []
    real = staging_mod.copy_batch
    monkeypatch.setattr(staging_mod, "copy_batch", lambda dsts, srcs, stream=None: calls.append(len(dsts)) or real(dsts, srcs, stream))
    layer = _pooled_layer(mgr)
    s = streamed.plan(layer, list(range(8)))
    assert s is not None and len(s.parts[0]) == 2 and not s.preloaded
    if swapped:
        s.parts[0].reverse()
    part, slots = s.parts[0], s.part_slots[0]
    blob = mgr.manifest.blob(ExpertKey(layer, part[0]), precision)
    offsets = [mgr.table[ExpertKey(layer, e)].host_offset for e in part]
    runs = 1 + sum(b != a + blob.stride for a, b in zip(offsets, offsets[1:]))
    assert runs == (2 if swapped else 1)
    mgr.reset_stats()
    streamed.read_part(s, 0)
    streamed.wait_part(s, 0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    assert calls == [len(part) * len(blob.shapes) if precision == "bf16" else runs]
    for e, slot in zip(part, slots):
        assert mgr.table.occupant(s.pool.index, slot) == ExpertKey(layer, e)
        src = mgr.host.view(mgr.table[ExpertKey(layer, e)].host_offset, blob.nbytes).to(device)
        want = {n: torch.empty(sh, dtype=torch.bfloat16, device=device) for n, sh in blob.shapes}
        blob.dequantize_into(src, want)
        got = s.pool.tensors(slot)
        assert all(torch.equal(got[n], want[n]) for n in want), f"expert {e} in slot {slot}"
    assert report.stats(mgr).bytes_moved["cpu"] == len(part) * blob.nbytes
    streamed.end_part(s, 0)
    for p in range(1, len(s.parts)):
        streamed.read_part(s, p)
        streamed.wait_part(s, p)
        streamed.end_part(s, p)
    streamed.end(s)
    assert len(calls) == len(s.parts)
    assert all(r == 0 for r in mgr.table.readers(s.pool.index)) and not any(mgr.table.reserved(s.pool.index, x) for x in s.pool.staging)
    mgr.table.check()


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_a_streamed_part_counts_its_bytes_in_its_pool(device, packed_factory, precision):
    """A streamed part's copies count their bytes among the pool's staged bytes (what decides
    whether decode reads its misses directly), bf16 and INT8 alike."""
    cfg = {"tiers": {"gpu": {"fraction": 0.4, "staging_slots": 4}, "cpu": {"budget": "64MiB", "precision": precision},
                     "nvme": {"precision": precision}}}
    model = tiers.load(packed_factory("qwen3_moe"), cfg, device=device, progress=False)
    mgr = manager_of(model)
    layer = _pooled_layer(mgr)
    nbytes = mgr.manifest.blob(ExpertKey(layer, 0), precision).nbytes
    before = list(mgr.staging.staged_bytes)
    s = mgr.streamed.plan(layer, list(range(8)))
    mgr.streamed.read_part(s, 0)
    mgr.streamed.end(s)
    after = list(mgr.staging.staged_bytes)
    assert after[s.pool.index] - before[s.pool.index] == len(s.parts[0]) * nbytes
    assert all(a == b for i, (a, b) in enumerate(zip(after, before)) if i != s.pool.index)
