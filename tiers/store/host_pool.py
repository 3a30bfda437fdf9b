"""Warm tier: one bounded host slab, pinned once, holding experts in their transfer form.

Owns: the slab, its bump allocator (4 KiB aligned), pinning, and the one host-to-device copy
helper. Invariants: the slab never grows (``used <= capacity``); it is an anonymous mmap of its
own pages (page aligned, shared with no other allocation) pinned with a single
``cudaHostRegister`` (about 10x faster than ``torch.empty(pin_memory=True)``, which also rounds
up to powers of two), and unregistered before its pages are unmapped, when the pool is closed or
collected; without CUDA pinning is skipped in ``pin_host`` and nowhere else.

A pool collected while its thread captures a CUDA graph (the collector runs wherever Python
allocates) cannot unregister then: CUDA refuses the call in a capture, and the capture fails. Its
unregistration waits, with the mapping kept, until the next pool is made or closed outside a
capture (``release_pending``): were the pages unmapped while registered, a later mapping at that
address could not be registered (CUDA error 712, the registration already there).

A registration or unregistration that CUDA refuses is reported by this module (an error, or a
warning with the mapping kept), and the CUDA runtime's last error it left is cleared
(``reset_last_error``): torch checks that error after each kernel launch, and would fail the
thread's next kernel with it.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import weakref

import torch

from tiers.loader.blob import BLOB_ALIGN, align


def mapped_path(fragment: str, maps_path: str = "/proc/self/maps") -> str | None:
    """The path of a file this process has mapped whose path holds ``fragment`` (the path
    column of ``maps_path``), or None where none is or the maps cannot be read (not Linux)."""
    try:
        with open(maps_path) as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fragment in fields[5]:
                    return fields[5].strip()
    except OSError:
        pass
    return None


@functools.cache
def _runtime_library(maps_path: str = "/proc/self/maps") -> ctypes.CDLL | None:
    """The CUDA runtime library this process has mapped (torch's: the same instance, whose last
    error torch checks), or None where none is (not Linux, or a runtime linked statically)."""
    path = mapped_path("/libcudart.so", maps_path)
    try:
        return ctypes.CDLL(path) if path is not None else None
    except OSError:
        return None


def reset_last_error() -> int:
    """Clear the CUDA runtime's last error on this thread; returns the error it held (-1 where the
    runtime cannot be reached). A runtime call that fails leaves its error there, and torch
    checks it after each kernel launch: a registration refused here, reported as our own error,
    would otherwise fail the thread's next kernel with it."""
    lib = _runtime_library()
    return int(lib.cudaGetLastError()) if lib is not None else -1


def pin_host(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory in place. Returns False (and does nothing) without CUDA."""
    if not torch.cuda.is_available() or t.numel() == 0:
        return False
    rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
    if rc != 0:
        reset_last_error()
        why = " (part of the range is registered already)" if rc == 712 else ""
        raise RuntimeError(f"cudaHostRegister of {t.numel() * t.element_size()} bytes failed with CUDA error {rc}{why}")
    return True


log = logging.getLogger(__name__)

# (address, mapping) of collected pools whose unregistration waits: the mapping stays until it is done
_pending: list[tuple[int, mmap.mmap]] = []


def _unregister(ptr: int, mapping: mmap.mmap) -> None:
    """Unregister ``ptr``, or, while this thread's current stream captures a graph, keep
    ``mapping`` (so its pages stay mapped) until ``release_pending``."""
    if torch.cuda.is_current_stream_capturing():
        _pending.append((ptr, mapping))
        return
    rc = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if rc != 0:
        reset_last_error()
        log.warning("cudaHostUnregister of a host pool failed with CUDA error %d; its mapping is kept", rc)
        _pending.append((ptr, mapping))


def release_pending() -> int:
    """Unregister the collected pools whose unregistration waited (outside a capture; their
    mappings go after); returns how many are left waiting."""
    if _pending and not torch.cuda.is_current_stream_capturing():
        waiting = []
        while _pending:  # one at a time: a finalizer on another thread may append meanwhile
            waiting.append(_pending.pop())
        for ptr, mapping in waiting:
            _unregister(ptr, mapping)
    return len(_pending)


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
        if pin:
            release_pending()
        self.pinned = pin_host(self.slab) if pin else False
        # Unregister before the mapping goes away, whether close() is called or not (the finalizer
        # holds the mapping: it outlives the registration).
        self._unpin = weakref.finalize(self, _unregister, self.slab.data_ptr(), self._map) if self.pinned else None
        self.used = 0
        self.parts: dict[str, int] = {}  # bytes allocated per part

    def alloc(self, nbytes: int, part: str) -> int:
        """``nbytes`` (4 KiB aligned) for ``part`` (what they hold: counted in ``parts``); their offset."""
        offset = self.used
        end = offset + align(nbytes, BLOB_ALIGN)
        if end > self.capacity:
            raise MemoryError(f"host pool full: {nbytes} bytes requested for {part}, {self.capacity - offset} of {self.capacity} left")
        self.used = end
        self.parts[part] = self.parts.get(part, 0) + end - offset
        return offset

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.slab[offset : offset + nbytes]

    def close(self) -> None:
        if self._unpin is not None:
            self._unpin()
            self.pinned = False
        release_pending()
