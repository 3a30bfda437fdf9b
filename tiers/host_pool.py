"""Warm tier: one bounded host slab, pinned once, holding experts in their transfer form.

Owns: the slab, its bump allocator (4 KiB aligned), pinning, and the one host-to-device copy
helper. Invariants: the slab never grows (``used <= capacity``); it is an anonymous mmap of its
own pages (page aligned, shared with no other allocation) pinned with a single
``cudaHostRegister`` (about 10x faster than ``torch.empty(pin_memory=True)``, which also rounds
up to powers of two), and unregistered before its pages are unmapped, when the pool is closed or
collected; without CUDA pinning is skipped in ``pin_host`` and nowhere else.
"""
from __future__ import annotations

import mmap
import weakref

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
