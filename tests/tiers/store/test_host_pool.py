"""The warm tier's host slab (tiers.store.host_pool): its bump allocator counts bytes per part, and a
pool collected inside a CUDA graph capture keeps its pages mapped until its unregistration can run.

CUDA refuses ``cudaHostUnregister`` while the calling thread captures a graph, and fails the
capture; pages unmapped while still registered make the next registration at that address fail
(CUDA error 712). The CPU tests drive the waiting logic with a fake ``cudart``; the CUDA ones
finalize a real pool inside a real capture."""
from __future__ import annotations

import gc
import mmap
import os

import pytest
import torch

from tiers.store import host_pool
from tiers.store.host_pool import HostPool


class FakeCudart:
    """Records unregistrations; fails the next ``fail`` of them; refuses registrations with
    ``register_rc``."""

    def __init__(self, fail: int = 0, register_rc: int = 0):
        self.unregistered: list[int] = []
        self.fail = fail
        self.register_rc = register_rc

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        return self.register_rc

    def cudaHostUnregister(self, ptr: int) -> int:
        if self.fail:
            self.fail -= 1
            return 1  # cudaErrorInvalidValue
        self.unregistered.append(ptr)
        return 0


@pytest.fixture
def fake_cuda(monkeypatch):
    state = {"capturing": False, "cudart": FakeCudart(), "resets": 0}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(torch.cuda, "cudart", lambda: state["cudart"])
    monkeypatch.setattr(host_pool, "_pending", [])

    def reset():
        state["resets"] += 1
        return 0

    monkeypatch.setattr(host_pool, "reset_last_error", reset)
    return state


def test_unregistration_waits_while_capturing_and_keeps_the_mapping(fake_cuda):
    mapping = mmap.mmap(-1, 4096)
    fake_cuda["capturing"] = True
    host_pool._unregister(1234, mapping)
    assert fake_cuda["cudart"].unregistered == []  # no CUDA call in the capture
    assert host_pool._pending == [(1234, mapping)]  # the mapping is held: its pages stay mapped
    assert host_pool.release_pending() == 1  # still capturing: nothing happens
    assert fake_cuda["cudart"].unregistered == []
    fake_cuda["capturing"] = False
    assert host_pool.release_pending() == 0
    assert fake_cuda["cudart"].unregistered == [1234] and host_pool._pending == []


def test_a_refused_unregistration_is_retried_not_dropped(fake_cuda, caplog):
    mapping = mmap.mmap(-1, 4096)
    fake_cuda["cudart"].fail = 1
    with caplog.at_level("WARNING", logger="tiers.store.host_pool"):
        host_pool._unregister(99, mapping)
    assert host_pool._pending == [(99, mapping)] and "CUDA error 1" in caplog.text
    assert fake_cuda["resets"] == 1  # the runtime's last error, left by the refusal, is cleared
    assert host_pool.release_pending() == 0 and fake_cuda["cudart"].unregistered == [99]
    assert fake_cuda["resets"] == 1


def test_a_refused_registration_names_its_error_and_clears_it(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fake_cuda["cudart"].register_rc = 712
    with pytest.raises(RuntimeError, match=r"4096 bytes failed with CUDA error 712 \(part of the range is registered already\)"):
        host_pool.pin_host(torch.zeros(4096, dtype=torch.uint8))
    assert fake_cuda["resets"] == 1
    fake_cuda["cudart"].register_rc = 0
    assert host_pool.pin_host(torch.zeros(8, dtype=torch.uint8)) is True
    assert fake_cuda["resets"] == 1  # a registration that succeeds leaves the runtime alone


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc")
def test_the_runtime_library_is_the_one_mapped(tmp_path):
    """``_runtime_library`` loads the libcudart the process has mapped, from its maps' path
    column (here a stand-in: a link named like it to the C library), and None where none is."""
    libc = host_pool.mapped_path("/libc.so")
    if libc is None:
        pytest.skip("no C library mapped to stand in")
    link = tmp_path / "libcudart.so.13"
    link.symlink_to(libc)
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r--p 00000000 00:00 0 \n"  # an anonymous mapping: no path
                    f"7f01-7f02 r-xp 00000000 08:01 42 {link}\n")
    lib = host_pool._runtime_library.__wrapped__(str(maps))
    assert lib is not None and lib._name == str(link) and hasattr(lib, "getpid")
    maps.write_text(f"7f01-7f02 r-xp 00000000 08:01 42 {libc}\n")
    assert host_pool._runtime_library.__wrapped__(str(maps)) is None
    assert host_pool._runtime_library.__wrapped__(str(tmp_path / "absent")) is None


def test_outside_a_capture_unregisters_at_once(fake_cuda):
    host_pool._unregister(7, mmap.mmap(-1, 4096))
    assert fake_cuda["cudart"].unregistered == [7] and host_pool._pending == []


def test_closing_an_unpinned_pool_touches_no_cuda():
    pool = HostPool(10_000, pin=False)
    assert not pool.pinned and pool.capacity % 4096 == 0
    pool.close()  # nothing waits: no CUDA query either


def test_alloc_counts_aligned_bytes_per_part_and_never_grows():
    """Each allocation takes whole 4 KiB pages after the last one and counts them under its part;
    a request past the capacity raises naming the part and changes nothing."""
    pool = HostPool(10 * 4096, pin=False)
    assert pool.capacity == 10 * 4096 and pool.used == 0 and pool.parts == {}
    a = pool.alloc(1, "warm")
    b = pool.alloc(4096, "rings")
    c = pool.alloc(4097, "warm")
    d = pool.alloc(0, "uploads")
    assert (a, b, c, d) == (0, 4096, 2 * 4096, 4 * 4096)
    assert pool.parts == {"warm": 4096 + 2 * 4096, "rings": 4096, "uploads": 0}
    assert pool.used == 4 * 4096 == sum(pool.parts.values())
    with pytest.raises(MemoryError, match=r"host pool full: 24577 bytes requested for promote, 24576 of 40960 left"):
        pool.alloc(6 * 4096 + 1, "promote")
    assert pool.used == 4 * 4096 and "promote" not in pool.parts
    e = pool.alloc(6 * 4096, "promote")  # exactly what is left
    assert e == 4 * 4096 and pool.used == pool.capacity and pool.parts["promote"] == 6 * 4096
    v = pool.view(c, 4097)
    assert v.numel() == 4097 and v.data_ptr() == pool.slab.data_ptr() + c
    pool.close()


def test_a_managers_host_pool_parts_are_what_it_holds(packed_factory):
    """The manager's pinned slab: the warm experts' blobs, a ring buffer per staging slot for disk
    reads, the upload buffers; the parts sum to what is used, each warm expert inside ``warm``."""
    import tiers
    from tiers.api import manager_of

    cfg = {"tiers": {"gpu": {"fraction": 0.25, "staging_slots": 2}, "cpu": {"fraction": 0.4}, "nvme": {"precision": "int8"}}}
    mgr = manager_of(tiers.load(packed_factory("mixtral"), cfg, device="cpu", progress=False))
    host, m = mgr.host, mgr.manifest
    assert sum(host.parts.values()) == host.used <= host.capacity
    assert host.parts["warm"] == sum(m.blob(k, "int8").stride for k in mgr.placement.warm)
    staging = sum(len(p.staging) for p in mgr.pools)
    assert host.parts["rings"] == staging * max(m.layers[L].blobs["int8"].stride for L in m.layers)
    assert host.parts["uploads"] == mgr.uploads.BUFFERS * -(-mgr.uploads._bufs[0].numel() * 8 // 4096) * 4096  # each buffer in whole pages
    for k in mgr.placement.warm:
        assert 0 <= mgr.table[k].host_offset < host.parts["warm"]
    mgr.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_pool_finalized_in_a_capture_is_unregistered_after_it():
    pool = HostPool(1 << 20, pin=True)
    slab, ptr, nbytes = pool.slab, pool.slab.data_ptr(), pool.capacity
    x = torch.zeros(4, device="cuda")
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        g.capture_begin(capture_error_mode="thread_local")
        try:
            x.add_(1)
            pool._unpin()  # what the collector would run here
        finally:
            g.capture_end()  # raises if CUDA saw an unregistration in the capture
    torch.cuda.current_stream().wait_stream(side)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, torch.ones(4, device="cuda"))
    assert [p for p, _ in host_pool._pending] == [ptr]
    other = HostPool(4096, pin=True)  # a new pool releases what waited
    assert host_pool._pending == []
    # the range is free to register again: it was unregistered, its pages still mapped
    assert int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) == 0
    assert int(torch.cuda.cudart().cudaHostUnregister(ptr)) == 0
    other.close()
    del slab


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_graphs_capture_with_the_collector_off():
    from tiers.graphs.graph_cache import GraphCache

    graphs = GraphCache(torch.device("cuda"), enabled=True)
    seen = []

    def step(a):
        seen.append(gc.isenabled())
        return a * 2

    a = torch.arange(4.0, device="cuda")
    for _ in range(3):  # eager, capture, replay
        out = graphs.run("k", [], step, (a,))
    assert torch.equal(out, a * 2) and graphs.captured == 1 and graphs.failed == 0
    assert seen == [True, False]  # the eager call with it on, the capture with it off
    assert gc.isenabled()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_refused_registration_leaves_the_next_kernel_alone():
    """Registering a pool's slab a second time is refused (CUDA error 712) and reported as our
    error; the thread's next kernels run, with no CUDA error of that refusal left for torch's
    launch check to find."""
    pool = HostPool(1 << 20, pin=True)
    assert host_pool._runtime_library() is not None  # torch's runtime is mapped: the error can be cleared
    with pytest.raises(RuntimeError, match="CUDA error 712"):
        host_pool.pin_host(pool.slab)
    y = torch.arange(4.0, device="cuda") * 2  # torch checks the runtime's last error after the launch
    torch.cuda.synchronize()
    assert torch.equal(y.cpu(), torch.arange(4.0) * 2)
    assert host_pool.reset_last_error() == 0
    pool.close()
