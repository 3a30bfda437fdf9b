"""Small index uploads without a host sync: a ring of pinned buffers in the host pool.

Owns: ``BUFFERS`` pinned int64 buffers (with int32 and numpy views of each), used round robin, and
the event after the copy that last read each one. A buffer is refilled only after that copy ran
(``BUFFERS`` calls back: long done), so the host never writes pinned bytes a queued copy may read.
Why pinned: a ``non_blocking`` copy from pageable memory makes the host wait for the stream.
"""
from __future__ import annotations

from typing import Any

import torch

from tiers.store.host_pool import HostPool, assert_pinned


class Uploads:
    BUFFERS = 16

    def __init__(self, host: HostPool, streams: Any, device: torch.device, length: int):
        """``length``: int64 entries per buffer (the longest upload, as int64)."""
        self.host, self.streams, self.device = host, streams, device
        n = length * 8
        self._bufs = [host.view(host.alloc(n, "uploads"), n).view(torch.int64) for _ in range(self.BUFFERS)]
        self._views = {torch.int64: self._bufs, torch.int32: [b.view(torch.int32) for b in self._bufs]}
        self._arrays = {dt: [b.numpy() for b in bs] for dt, bs in self._views.items()}  # filling one from a list is one call
        self._read: list[Any | None] = [None] * self.BUFFERS
        self._events = [streams.event() for _ in range(self.BUFFERS)]  # re-recorded: each is synced before reuse
        self._next = 0

    @property
    def room(self) -> int:
        """int32 entries one upload holds."""
        return self._arrays[torch.int32][0].shape[0]

    def slot_map(self, num_experts: int, n_slots: int, experts: list[int], slots: list[int]) -> torch.Tensor:
        """An int64 [num_experts + 1] map expert -> slot on the device (unlisted experts and the
        sentinel id ``num_experts`` -> ``n_slots``)."""
        i = self._buffer()
        arr = self._arrays[torch.int64][i]
        arr[: num_experts + 1] = n_slots
        arr[experts] = slots
        return self._upload(self._bufs[i][: num_experts + 1], i)

    def ints(self, values: list[int], dtype: torch.dtype = torch.int32, on: Any | None = None) -> torch.Tensor:
        """``values`` as an int32 (or int64) tensor on the device; ``on``: as for ``int_lists``,
        except that the caller orders its readers."""
        i = self._buffer()
        n = len(values)
        self._arrays[dtype][i][:n] = values
        return self._upload(self._views[dtype][i][:n], i, on=on)

    def pinned(self, values: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """``values`` in the next pinned buffer, for a kernel that reads host memory itself: the
        view, and the buffer's index (the caller marks its reader with ``read_by``)."""
        i = self._buffer()
        self._arrays[dtype][i][: len(values)] = values
        return self._views[dtype][i][: len(values)], i

    def int_lists(self, lists: list[list[int]], on: Any | None = None) -> list[torch.Tensor]:
        """Each list as an int32 tensor on the device, packed into as few uploads as the buffers hold.

        ``on``: a stream to upload on instead of the current one, which then waits for the
        uploads. A small upload that reaches the copy engine while a large read runs waits for
        that read: on the H200 a whole-layer call's plan, uploaded on the compute stream after the
        layer's attention, landed only when the read of the call's part 1 had ended, 0.7-1.5 ms
        later. Queued on the copy stream before the parts, it lands right after the previous
        layer's reads instead."""
        room, out, i = self.room, [], 0
        while i < len(lists):
            j, n = i + 1, len(lists[i])
            while j < len(lists) and n + len(lists[j]) <= room:
                n += len(lists[j])
                j += 1
            up = self.ints([v for vs in lists[i:j] for v in vs], on=on)
            at = 0
            for vs in lists[i:j]:
                out.append(up[at : at + len(vs)])
                at += len(vs)
            i = j
        if on is not None:
            done = self.streams.event()
            done.record(on)
            self.streams.current().wait_event(done)
        return out

    def read_by(self, i: int, stream: Any) -> None:
        """Buffer ``i`` is read by what is queued on ``stream`` so far: it is refilled after that."""
        done = self._events[i]
        done.record(stream)
        self._read[i] = done

    def _buffer(self) -> int:
        i = self._next
        self._next = (i + 1) % self.BUFFERS
        if self._read[i] is not None:
            self._read[i].synchronize()  # the copy that last read this buffer (BUFFERS uploads ago: long done)
        return i

    def _upload(self, host: torch.Tensor, i: int, on: Any | None = None) -> torch.Tensor:
        """``host`` (pinned buffer ``i``) copied to the device on the current stream, or on ``on``:
        allocated there and marked as used by the current stream, so its memory is not handed out
        again before the current stream's readers ran."""
        if self.device.type != "cuda":
            return host.clone()  # no copy to make: the caller must not alias the ring
        if not self.host.pinned:
            assert_pinned(host, self.device)
        if on is None:
            dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            dev.copy_(host, non_blocking=True)
            self.read_by(i, self.streams.current())
            return dev
        reader = self.streams.current()
        with self.streams.use(on):
            dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            dev.copy_(host, non_blocking=True)
        self.read_by(i, on)
        dev.record_stream(reader)
        return dev
