"""Warm tier: one bounded host slab, pinned once, holding experts in their transfer form.

Owns: the slab, its bump allocator (4 KiB aligned), pinning, and the one host-to-device copy
helper. Invariants: the slab never grows (``used <= capacity``); it is an anonymous mmap of its
own pages (page aligned, shared with no other allocation) pinned with a single
``cudaHostRegister`` (about 10x faster than ``torch.empty(pin_memory=True)``, which also rounds
up to powers of two), and unregistered before its pages are unmapped, when the pool is closed or
collected; without CUDA pinning is skipped in ``pin_host`` and nowhere else.
"""
from __future__ import annotations

import ctypes
import mmap
import sys
import weakref
from typing import Any

import torch

from loader.blob import BLOB_ALIGN, align


def pin_host(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory in place. Returns False (and does nothing) without CUDA."""
    if not torch.cuda.is_available() or t.numel() == 0:
        return False
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister of {t.numel() * t.element_size()} bytes failed with CUDA error {int(rc)}")
    return True


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def assert_pinned(src: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        assert src.is_pinned(), (
            "non_blocking=True H2D copy from non-pinned memory causes a stream synchronization "
            "and runs at pageable speed; stage through the pinned host pool"
        )


class HostPool:
    def __init__(self, capacity: int, *, pin: bool):
        self.capacity = max(align(capacity, BLOB_ALIGN), BLOB_ALIGN)
        # One anonymous mapping of our own pages: a registration can never overlap memory that
        # malloc later hands to someone else.
        self._map = mmap.mmap(-1, self.capacity)
        self.slab = torch.frombuffer(self._map, dtype=torch.uint8)  # [capacity]
        self.pinned = pin_host(self.slab) if pin else False
        # Unregister before the mapping goes away, whether close() is called or not.
        self._unpin = weakref.finalize(self, _unregister, self.slab.data_ptr()) if self.pinned else None
        self.used = 0

    def alloc(self, nbytes: int) -> int:
        offset = self.used
        end = offset + align(nbytes, BLOB_ALIGN)
        if end > self.capacity:
            raise MemoryError(f"host pool full: {nbytes} bytes requested, {self.capacity - offset} of {self.capacity} left")
        self.used = end
        return offset

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.slab[offset : offset + nbytes]

    def close(self) -> None:
        if self._unpin is not None:
            self._unpin()
            self.pinned = False


class RawCopy:
    """Host-to-device copies queued with ``cudaMemcpyAsync`` of the CUDA runtime torch has loaded,
    on an explicit stream. On a slow host ATen's ``copy_`` (dispatch, checks, the caching host
    allocator's bookkeeping, and the stream switch around it) costs more host time than queuing
    a small expert's copy should; this costs one foreign call. For sources in a registered slab
    only (the caller keeps them alive until the copy has run). ``load`` verifies one copy and
    returns None wherever it cannot be used (no CUDA, not Linux, a runtime not found)."""

    HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice

    def __init__(self, fn: Any):
        self._fn = fn

    @classmethod
    def load(cls, device: torch.device) -> RawCopy | None:
        if device.type != "cuda" or not torch.cuda.is_available() or not sys.platform.startswith("linux"):
            return None
        torch.cuda.init()
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "/libcudart.so" in line), None)
        if path is None:  # a runtime linked statically into torch: nothing to call
            return None
        try:
            fn = ctypes.CDLL(path).cudaMemcpyAsync
        except (OSError, AttributeError):
            return None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        raw = cls(fn)
        return raw if raw._works(device) else None

    def __call__(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """Queue ``nbytes`` from host address ``src`` to device address ``dst`` on ``stream``."""
        rc = self._fn(dst, src, nbytes, self.HOST_TO_DEVICE, stream.cuda_stream)
        if rc != 0:
            raise RuntimeError(f"cudaMemcpyAsync of {nbytes} bytes failed with CUDA error {rc}")

    def _works(self, device: torch.device) -> bool:
        with torch.cuda.device(device):
            src = torch.arange(1 << 12, dtype=torch.int32).pin_memory()
            dst = torch.zeros(1 << 12, dtype=torch.int32, device=device)
            stream = torch.cuda.Stream(device)
            try:
                self(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(), stream)
            except RuntimeError:
                return False
            stream.synchronize()
            return torch.equal(dst.cpu(), src)
