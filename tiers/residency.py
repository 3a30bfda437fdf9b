"""The residency table: where every expert lives, changed only through ``transition``.

Owns: one ``dict[ExpertKey, Residency]`` and the single pure transition function over it.
Invariants: an expert's home tier (gpu, cpu or nvme) holds it for good; at most one GPU slot
holds it; a hot (pinned) expert is never evicted; every other change of state is one of the
edges in ``_EDGES`` or raises ``IllegalTransition``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from loader.layout import ExpertKey


class Home(str, Enum):
    GPU = "gpu"
    CPU = "cpu"
    NVME = "nvme"


class SlotState(str, Enum):
    ABSENT = "absent"  # in no GPU slot
    LOADING = "loading"  # a slot is being filled; its ready event has not been waited on yet
    READY = "ready"  # in a slot, and the compute stream is ordered after its load


class Op(str, Enum):
    PLACE_HOT = "place_hot"  # load time: pin into a hot slot
    STAGE = "stage"  # a copy into a staging slot was issued
    READY = "ready"  # the compute stream now waits on that copy
    EVICT = "evict"  # the staging slot was given to another expert


class IllegalTransition(RuntimeError):
    pass


@dataclass(frozen=True)
class Residency:
    home: Home
    host_offset: int | None = None  # byte offset in the host pool when home is cpu
    slot: int | None = None  # GPU slot index in its group's pool
    state: SlotState = SlotState.ABSENT
    pinned: bool = False  # hot: never evicted


_EDGES = {
    (SlotState.ABSENT, Op.PLACE_HOT): SlotState.READY,
    (SlotState.ABSENT, Op.STAGE): SlotState.LOADING,
    (SlotState.LOADING, Op.READY): SlotState.READY,
    (SlotState.READY, Op.EVICT): SlotState.ABSENT,
    (SlotState.LOADING, Op.EVICT): SlotState.ABSENT,
}


def transition(r: Residency, op: Op, slot: int | None = None) -> Residency:
    """The one way a Residency changes. Pure: returns the new value."""
    nxt = _EDGES.get((r.state, op))
    if nxt is None:
        raise IllegalTransition(f"{op.value} is not allowed from state {r.state.value}")
    if op is Op.EVICT and r.pinned:
        raise IllegalTransition("a hot (pinned) expert is never evicted")
    if op in (Op.PLACE_HOT, Op.STAGE):
        if slot is None:
            raise IllegalTransition(f"{op.value} needs a slot")
        return replace(r, slot=slot, state=nxt, pinned=op is Op.PLACE_HOT)
    if op is Op.EVICT:
        return replace(r, slot=None, state=nxt)
    return replace(r, state=nxt)


class ResidencyTable:
    def __init__(self, initial: dict[ExpertKey, Residency]):
        self._table = dict(initial)

    def __getitem__(self, key: ExpertKey) -> Residency:
        return self._table[key]

    def __len__(self) -> int:
        return len(self._table)

    def items(self):
        return self._table.items()

    def apply(self, key: ExpertKey, op: Op, slot: int | None = None) -> Residency:
        try:
            new = transition(self._table[key], op, slot)
        except IllegalTransition as e:
            raise IllegalTransition(f"{key}: {e}") from None
        self._table[key] = new
        return new

    def counts(self) -> dict[str, int]:
        out = {h.value: 0 for h in Home}
        for r in self._table.values():
            out[r.home.value] += 1
        return out
