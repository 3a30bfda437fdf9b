"""Warm tier: one bounded host slab, pinned once, holding experts in their transfer form.

Owns: the slab, its bump allocator (4 KiB aligned), pinning, and the one host-to-device copy
helper. Invariants: the slab never grows (``used <= capacity``); memory is pinned with a single
``cudaHostRegister`` of the existing allocation (about 10x faster than
``torch.empty(pin_memory=True)``, which also rounds up to powers of two); without CUDA pinning
is skipped in ``pin_host`` and nowhere else.
"""
from __future__ import annotations

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


def unpin_host(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def assert_pinned(src: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        assert src.is_pinned(), (
            "non_blocking=True H2D copy from non-pinned memory causes a stream synchronization "
            "and runs at pageable speed; stage through the pinned host pool"
        )


def copy_h2d_async(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Queue ``dst.copy_(src)`` on the current stream without a host sync."""
    assert_pinned(src, dst.device)
    dst.copy_(src, non_blocking=True)


class HostPool:
    def __init__(self, capacity: int, *, pin: bool):
        self.capacity = align(capacity, BLOB_ALIGN)
        # One allocation; pages are touched by the registration or the first write.
        self.slab = torch.empty(self.capacity, dtype=torch.uint8)  # [capacity]
        self.pinned = pin_host(self.slab) if pin else False
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
        if self.pinned:
            unpin_host(self.slab)
            self.pinned = False
