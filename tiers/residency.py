"""The residency table: where every expert lives, changed only through ``transition``.

Owns: one ``dict[ExpertKey, Residency]`` and the single pure transition function over it, and
read-only arrays over the table's ``ExpertGrid`` kept up to date by ``apply`` (hot and warm
masks, hot slots, host offsets).
Invariants: at most one GPU slot holds an expert; a hot (pinned) expert is never evicted, its
home is gpu and it has a slot; an expert's home is cpu exactly when it has a host offset; homes
change only through the rebalancer's four ops (promote / demote between nvme-or-cpu and gpu,
warm / cool between nvme and cpu), and a warm expert's host offset also through its fifth,
move; every change is one of the edges below or raises ``IllegalTransition``.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from tiers.loader.layout import ExpertGrid, ExpertKey


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
    PROMOTE = "promote"  # rebalancer: an expert in no slot becomes hot, its copy into a hot slot issued
    DEMOTE = "demote"  # rebalancer: a hot expert gives its slot up and lives on disk (nvme) again
    WARM = "warm"  # rebalancer: an nvme expert's blob landed in the host pool at ``offset``
    COOL = "cool"  # rebalancer: a warm expert's host bytes are given to another; it lives on disk
    MOVE = "move"  # rebalancer: a warm expert's blob was copied to another place in the host pool, ``offset``


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
    (SlotState.ABSENT, Op.PROMOTE): SlotState.LOADING,
    (SlotState.LOADING, Op.DEMOTE): SlotState.ABSENT,
    (SlotState.READY, Op.DEMOTE): SlotState.ABSENT,
}
_HOME_OPS = {Op.WARM: Home.NVME, Op.COOL: Home.CPU, Op.MOVE: Home.CPU}  # op -> the home it starts from (slot state unchanged)
_KEEP = object()


def replace(r: Residency, *, home=_KEEP, host_offset=_KEEP, slot=_KEEP, state=_KEEP, pinned=_KEEP) -> Residency:
    """``dataclasses.replace`` for this one class, without its per-call field introspection (it is
    on the path of every staged expert)."""
    return Residency(
        r.home if home is _KEEP else home,
        r.host_offset if host_offset is _KEEP else host_offset,
        r.slot if slot is _KEEP else slot,
        r.state if state is _KEEP else state,
        r.pinned if pinned is _KEEP else pinned,
    )


def transition(r: Residency, op: Op, slot: int | None = None, offset: int | None = None) -> Residency:
    """The one way a Residency changes. Pure: returns the new value."""
    if op in _HOME_OPS:
        if r.pinned:
            raise IllegalTransition(f"{op.value}: a hot (pinned) expert lives on the gpu; demote it first")
        if r.home is not _HOME_OPS[op]:
            raise IllegalTransition(f"{op.value} needs home {_HOME_OPS[op].value}, not {r.home.value}")
        if op in (Op.WARM, Op.MOVE):
            if offset is None:
                raise IllegalTransition(f"{op.value} needs a host offset")
            return replace(r, home=Home.CPU, host_offset=offset)
        return replace(r, home=Home.NVME, host_offset=None)
    nxt = _EDGES.get((r.state, op))
    if nxt is None:
        raise IllegalTransition(f"{op.value} is not allowed from state {r.state.value}")
    if op is Op.EVICT and r.pinned:
        raise IllegalTransition("a hot (pinned) expert is never evicted")
    if op is Op.PROMOTE:
        if r.pinned:
            raise IllegalTransition("promote: the expert is hot already")
        if slot is None:
            raise IllegalTransition("promote needs a slot")
        return replace(r, home=Home.GPU, host_offset=None, slot=slot, state=nxt, pinned=True)
    if op is Op.DEMOTE:
        if not r.pinned:
            raise IllegalTransition("demote: only a hot (pinned) expert is demoted")
        return replace(r, home=Home.NVME, host_offset=None, slot=None, state=nxt, pinned=False)
    if op is Op.PLACE_HOT and r.home is not Home.GPU:
        raise IllegalTransition(f"place_hot: the expert's home is {r.home.value}; only gpu-home experts are placed hot at load")
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
        # bumped whenever an expert's home, host place or pinning changes (the rebalancer's ops):
        # copies of the table kept elsewhere (the device-side tables of direct decode) compare it
        self.homes_version = 0
        self.layer_versions: dict[int, int] = {}  # ... and per layer (absent: 0)
        # arrays over ``grid``, kept up to date by apply: the hot (pinned) and warm (cpu-home)
        # experts as bool masks (the rebalancer plans over them), each hot expert's slot and each
        # warm expert's host offset, -1 elsewhere (direct decode's device tables are copies of
        # those). Read only
        self.grid = ExpertGrid.of(self._table)
        self.hot_mask = np.zeros(self.grid.size, dtype=bool)
        self.warm_mask = np.zeros(self.grid.size, dtype=bool)
        self.hot_slot = np.full(self.grid.size, -1, dtype=np.int64)
        self.host_offset = np.full(self.grid.size, -1, dtype=np.int64)
        for k, r in self._table.items():
            self._set_cells(self.grid.index(k), r)

    def __getitem__(self, key: ExpertKey) -> Residency:
        return self._table[key]

    def __len__(self) -> int:
        return len(self._table)

    def items(self):
        return self._table.items()

    def apply(self, key: ExpertKey, op: Op, slot: int | None = None, offset: int | None = None) -> Residency:
        try:
            new = transition(self._table[key], op, slot, offset)
        except IllegalTransition as e:
            raise IllegalTransition(f"{key}: {e}") from None
        old = self._table[key]
        if (old.home, old.host_offset, old.pinned) != (new.home, new.host_offset, new.pinned):
            self.homes_version += 1
            self.layer_versions[key.layer] = self.layer_versions.get(key.layer, 0) + 1
            self._set_cells(self.grid.index(key), new)
        self._table[key] = new
        return new

    def _set_cells(self, i: int, r: Residency) -> None:
        self.hot_mask[i], self.warm_mask[i] = r.pinned, r.home is Home.CPU
        self.hot_slot[i] = r.slot if r.pinned else -1
        self.host_offset[i] = r.host_offset if r.home is Home.CPU else -1

    def counts(self) -> dict[str, int]:
        out = {h.value: 0 for h in Home}
        for r in self._table.values():
            out[r.home.value] += 1
        return out
