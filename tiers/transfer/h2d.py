"""Host-to-device copies in batches: many copies from pinned host memory, one driver call.

Owns: the CUDA driver's batched asynchronous copy (``cuMemcpyBatchAsync``, CUDA 12.8 and
later), reached through ``ctypes`` because torch has none. Invariant: each copy is exact
(bytes, no conversion) and the batch is queued on the stream given, like as many non_blocking
``copy_`` calls from pinned memory; without the driver's batches, for tensors off CUDA, or on
the legacy default stream (which batches refuse), it is done one copy at a time with ``copy_``,
with the same result.

Why: a streamed part queues a copy per expert tensor (bf16: into its slot of each slab) or per
run of blobs (INT8: into transit rows), and each ``copy_`` from pinned memory costs the host
its own dispatch. On the H200 host a part of 8 or 16 Qwen3-30B-A3B bf16 experts took 33-36 us
of host time per expert as two ``copy_`` calls each, and 5.9-7.2 us per expert as one batch, at
the same copy rate (``experiments/results/h2d_probe.json``); the host's time per part is what a
prefill that waits for its routing spends between its layers.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading

import torch


class _Location(ctypes.Structure):
    """The driver's ``CUmemLocation``."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _BatchAttrs(ctypes.Structure):
    """The driver's ``CUmemcpyAttributes``: how a batch's copies read their sources."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Location), ("dstLocHint", _Location), ("flags", ctypes.c_uint)]


_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: the sources are read in stream order
_LOC_DEVICE, _LOC_HOST = 1, 2  # CUmemLocationType


class _Driver:
    """The driver library's entry points, loaded once; ``None`` where there is no CUDA driver."""

    def __init__(self, lib: ctypes.CDLL):
        # CUDA 13's entry point has no failure index; 12.8's (the first with batches) has one
        # before the stream. Older drivers have neither: AttributeError, no driver batches.
        self.batch, self.batch_fail_index = getattr(lib, "cuMemcpyBatchAsync_v2", None), False
        if self.batch is None:
            self.batch, self.batch_fail_index = lib.cuMemcpyBatchAsync, True
        p = ctypes.POINTER
        self.batch.argtypes = [p(ctypes.c_uint64), p(ctypes.c_uint64), p(ctypes.c_size_t), ctypes.c_size_t, p(_BatchAttrs),
                               p(ctypes.c_size_t), ctypes.c_size_t] + ([p(ctypes.c_size_t)] if self.batch_fail_index else []) + [ctypes.c_void_p]
        self.batch.restype = ctypes.c_int
        self.get_context = lib.cuCtxGetCurrent
        self.get_context.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self.get_context.restype = ctypes.c_int
        self.error_name = lib.cuGetErrorName
        self.error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.error_name.restype = ctypes.c_int
        self.params = threading.local()  # per thread: the batches' attributes, and whether its context is bound

    def has_context(self) -> bool:
        """Whether this thread has a current context (one that never used CUDA has none)."""
        ctx = ctypes.c_void_p()
        return self.get_context(ctypes.byref(ctx)) == 0 and bool(ctx.value)

    def name(self, rc: int) -> str:
        s = ctypes.c_char_p()
        return s.value.decode() if self.error_name(rc, ctypes.byref(s)) == 0 and s.value else f"error {rc}"


_driver: _Driver | None = None
_loaded = False
_lock = threading.Lock()


def driver() -> _Driver | None:
    """The CUDA driver's batch copy entry point, or None without one (no CUDA, or a driver before 12.8)."""
    global _driver, _loaded
    if not _loaded:
        with _lock:
            if not _loaded:
                try:
                    _driver = _Driver(ctypes.CDLL("libcuda.so.1"))
                except (OSError, AttributeError):
                    _driver = None
                _loaded = True
    return _driver


def copy_batch(dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream: torch.cuda.Stream | None = None) -> None:
    """Copy each ``srcs[i]`` into ``dsts[i]`` (equal shapes and dtypes, each contiguous): host
    sources into CUDA destinations are one driver call for the whole batch, queued on ``stream``
    (default: the current one) without waiting, its copies in any order among themselves, so
    no two may overlap; the sources must be pinned and stay unchanged until the stream has run
    them. Anything else, a driver without batches, or the legacy default stream (which batches
    refuse) copies with ``copy_`` one by one, on ``stream``."""
    device = dsts[0].device if dsts else None
    host_to_device = device is not None and device.type == "cuda"  # every copy from the host into this one device
    for d, s in zip(dsts, srcs, strict=True):
        if d.shape != s.shape or d.dtype != s.dtype or not (d.is_contiguous() and s.is_contiguous()):
            raise ValueError(f"batched copy: {tuple(s.shape)} {s.dtype} into {tuple(d.shape)} {d.dtype}, both must be contiguous")
        host_to_device = host_to_device and d.device == device and s.device.type == "cpu"
    if not dsts:
        return
    drv = driver() if host_to_device else None
    if drv is not None:
        stream = stream if stream is not None else torch.cuda.current_stream(device)
        if stream.cuda_stream != 0:  # not the legacy default stream, which the driver's batches refuse
            _queue_batch(drv, [d.data_ptr() for d in dsts], [s.data_ptr() for s in srcs],
                         [d.numel() * d.element_size() for d in dsts], stream.cuda_stream, device)
            return
    on = stream if stream is not None and device.type == "cuda" else None
    with torch.cuda.stream(on) if on is not None else contextlib.nullcontext():
        for d, s in zip(dsts, srcs):
            d.copy_(s, non_blocking=True)


def _queue_batch(drv: _Driver, dsts: list[int], srcs: list[int], sizes: list[int], handle: int, device: torch.device) -> None:
    """One ``cuMemcpyBatchAsync`` of host ``srcs`` into device ``dsts`` on stream ``handle``."""
    n = len(dsts)
    attrs = getattr(drv.params, "batch_attrs", None)
    if attrs is None or attrs.dstLocHint.id != (device.index or 0):
        attrs = drv.params.batch_attrs = _BatchAttrs(_ORDER_STREAM, _Location(_LOC_HOST, 0), _Location(_LOC_DEVICE, device.index or 0), 0)
    args = [(ctypes.c_uint64 * n)(*dsts), (ctypes.c_uint64 * n)(*srcs), (ctypes.c_size_t * n)(*sizes), n, ctypes.byref(attrs),
            (ctypes.c_size_t * 1)(0), 1]
    failed = ctypes.c_size_t(0)
    tail = [ctypes.byref(failed), handle] if drv.batch_fail_index else [handle]
    if not getattr(drv.params, "bound", False):  # once per thread: one new to CUDA has no context for the driver
        if not drv.has_context():
            torch.cuda.set_device(device)  # makes the device's primary context current
        drv.params.bound = True
    rc = drv.batch(*args, *tail)
    if rc != 0:
        raise RuntimeError(f"batched copy of {n} copies ({sum(sizes)} bytes) failed: {drv.name(rc)}")
