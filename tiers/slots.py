"""GPU slot pool: static expert buffers allocated once, keyed by (dtype, shape, stride).

Owns: the slabs (one tensor ``[n_slots, *shape]`` per expert tensor name) and, per slot, its
owner, its reader count and two events. Slot ``i`` is the i-th row of every slab, so its
addresses never change and CUDA graphs that read it stay valid.

Slot rule: a slot is written only when no reader holds it on the host side (``readers == 0``)
and after the copy stream has waited on ``last_read[i]``, the event recorded on the compute
stream when its last reader's kernels had been queued. A reader waits on ``ready[i]`` (recorded
on the copy stream after the write) before its first kernel reads the slot.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from tiers.loader.layout import ExpertKey, ExpertLayout


class SlotPool:
    def __init__(
        self,
        layout: ExpertLayout,
        n_slots: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        event_factory: Callable[[], Any],
    ):
        self.layout = layout
        self.n_slots = n_slots
        self.dtype = dtype
        self._event = event_factory
        self.slabs = {
            t.name: torch.empty((n_slots, *t.shape), dtype=dtype, device=device) for t in layout.tensors
        }  # name -> [n_slots, *shape]
        self._rows = [{name: slab[i] for name, slab in self.slabs.items()} for i in range(n_slots)]  # slot -> its views
        self.owner: list[ExpertKey | None] = [None] * n_slots
        self.readers = [0] * n_slots
        self.last_read: list[Any | None] = [None] * n_slots
        self.ready: list[Any | None] = [None] * n_slots
        self.ready_on: list[tuple[Any, int] | None] = [None] * n_slots  # (stream, record order) of each pending ready event
        self.pending_ready: set[int] = set()  # the slots whose ready event is pending (not None). Read only

    @property
    def key(self) -> tuple:
        """The (dtype, shape, stride) signature slots of this pool are interchangeable under."""
        return tuple((n, self.dtype, tuple(s.shape[1:]), tuple(s.stride()[1:])) for n, s in self.slabs.items())

    @property
    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.slabs.values())

    def tensors(self, slot: int) -> dict[str, torch.Tensor]:
        return self._rows[slot]

    def begin_write(self, slot: int, key: ExpertKey, copy_stream: Any, waited: list | None = None) -> None:
        """``key`` becomes the slot's owner; the copy stream is ordered after the slot's last read.
        ``waited``: events the copy stream already waits on (a batch of writes shares one last-read
        event per layer call), extended with the one waited here."""
        assert self.readers[slot] == 0, f"slot {slot} (owner {self.owner[slot]}) is rewritten while {self.readers[slot]} readers hold it"
        ev = self.last_read[slot]
        if ev is not None and not (waited is not None and any(ev is w for w in waited)):
            # The compute stream may still be running kernels that read the old expert:
            # order the copy after them.
            copy_stream.wait_event(ev)
            if waited is not None:
                waited.append(ev)
        self.owner[slot] = key

    def end_write(self, slot: int, copy_stream: Any, event: Any | None = None) -> Any:
        ev = event if event is not None else self._event()
        ev.record(copy_stream)
        self.written([slot], copy_stream, ev)
        return ev

    def written(self, slots: list[int], stream: Any, event: Any) -> None:
        """The writes of ``slots`` were queued on ``stream`` before ``event`` was recorded there:
        it is their ready event (one event for a batch of writes)."""
        order = next(_RECORDS)
        for slot in slots:
            self.ready[slot] = event
            self.ready_on[slot] = (stream, order)
        self.pending_ready.update(slots)

    def hold(self, slot: int) -> None:
        """A reader takes the slot: from now until ``end_read`` it cannot be rewritten."""
        self.readers[slot] += 1

    def wait_ready(self, slot: int, compute_stream: Any) -> bool:
        """Order the compute stream after a pending write of the slot. True if it had to wait."""
        pending = self.take_ready(slot)
        if pending is None:
            return False
        # Kernels about to be queued read this slot: they must not start before its copy lands.
        compute_stream.wait_event(pending[0])
        return True

    def take_ready(self, slot: int) -> tuple[Any, Any, int] | None:
        """The slot's pending write as (event, stream, record order), now the caller's to wait on; None if none."""
        assert self.readers[slot] > 0, f"slot {slot} is waited on without being held"
        ev = self.ready[slot]
        if ev is None:
            return None
        self.ready[slot] = None
        self.pending_ready.discard(slot)
        stream, order = self.ready_on[slot]
        return ev, stream, order

    def end_read_at(self, slot: int, event: Any | None) -> None:
        """Give the slot back; ``event`` (already recorded after its reader's kernels, shared by the
        slots released together) becomes its last read, or None for a hold that queued no kernel."""
        assert self.readers[slot] > 0, f"slot {slot} released more often than held"
        self.readers[slot] -= 1
        if event is not None:
            self.last_read[slot] = event

    def end_read(self, slot: int, compute_stream: Any, *, record: bool = True) -> None:
        """Give the slot back. ``record=False`` is for holds that queued no kernel reading the slot:
        hot slots (never rewritten) and a read-ahead's hold while its disk read is in flight."""
        ev = None
        if record:
            ev = self._event()
            ev.record(compute_stream)
        self.end_read_at(slot, ev)

_RECORDS = itertools.count()  # the order ready events are recorded in, across pools: later on a stream covers earlier
