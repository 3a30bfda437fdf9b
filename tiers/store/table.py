"""The table: where every expert lives and what every GPU slot holds, changed only through named transitions.

Owns one record per expert (its home tier, its place in the host pool, its GPU slot, whether it
is hot) and one per GPU slot of every pool (its occupant, whether a write into it is pending,
its readers, its reservation, and the two events of the slot rule). Nothing else keeps a copy
that can drift: pools are memory only, the cache policy asks the table who sits where, and the
device-side tables of direct decode are uploads of ``hot_slot`` and ``host_offset``.

A slot's state (``state``):

- ``free``: no occupant; the cache may stage a miss into it;
- ``reserved``: taken out of the cache by a path (direct decode's slots, whose contents only the
  device knows, or a streamed call's buffers) and not yet written by it;
- ``writing``: its occupant's bytes are queued (``stage``, ``swap_hot``) and no reader has been
  ordered after them yet (``take_ready``);
- ``ready``: its occupant's bytes are in place for every reader that waits;
- ``in use``: held by one reader or more (``hold`` .. ``release``).

Slot rule: a slot is rewritten (``stage``, ``swap_hot``) or emptied (``evict``, ``reserve``) only
when no reader holds it, and the copy that rewrites it is queued after ``last_read``, the event
recorded after its last reader's kernels (the staging code waits on it). A reader waits on the
pending write (``take_ready``) before its first kernel.

Invariants (``check``): an expert sits in at most one slot and that slot names it; a hot slot
holds a hot expert whose home is gpu; an expert whose home is cpu has a host place, one whose home
is nvme none, and one whose home is gpu a place only as a quantized hot expert (its blob in the
GPU's blob pool, ``tiers.store.pools.BlobPool``: never in a hot slot); the arrays over the grid
agree with the records (``host_offset`` holds host places only). Every transition checks its preconditions and
raises ``IllegalTransition`` naming the expert or slot, changing nothing.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

import numpy as np

from tiers.loader.layout import ExpertGrid, ExpertKey


class Home(str, Enum):
    GPU = "gpu"
    CPU = "cpu"
    NVME = "nvme"


class SlotState(str, Enum):
    FREE = "free"
    RESERVED = "reserved"
    WRITING = "writing"
    READY = "ready"
    IN_USE = "in use"


class IllegalTransition(RuntimeError):
    pass


class Residency(NamedTuple):
    """Where one expert lives: its home tier, its host place (home cpu), its slot (in its layer's
    pool), hot. Immutable (a tuple: made in C on every staged expert)."""

    home: Home
    host_offset: int | None = None  # home cpu: its place in the host pool; home gpu: in the GPU's blob pool (quantized hot)
    slot: int | None = None
    hot: bool = False


@dataclass(frozen=True)
class SlotView:
    """A read-only snapshot of one slot's record."""

    pool: int
    index: int
    occupant: ExpertKey | None
    state: SlotState
    readers: int
    hot: bool
    reserved: str | None
    writing: bool  # a write is queued that no reader has been ordered after yet


Pending = tuple[Any, Any, int]  # a pending write: (ready event, the stream it was recorded on, record order)
_ORDER = itertools.count()  # the order ready events are recorded in, across pools: later on a stream covers earlier


class _Pool:
    """One pool's slot records (the table's own; nobody else writes them)."""

    __slots__ = ("occupant", "writing", "readers", "reserved", "hot", "ready", "last_read", "pending", "by")

    def __init__(self, n: int):
        self.occupant: list[ExpertKey | None] = [None] * n
        self.writing = [False] * n
        self.readers = [0] * n
        self.reserved: list[str | None] = [None] * n
        self.hot = [False] * n
        self.ready: list[Pending | None] = [None] * n
        self.last_read: list[Any | None] = [None] * n
        self.pending: set[int] = set()  # slots whose ready event nobody has waited on yet
        self.by: dict[str, list[int]] = {}  # reserver -> its slots, ascending (an index of ``reserved``)


class Table:
    """Experts and slots of one model; ``pool_of[layer]`` is the index of the pool its experts use."""

    def __init__(self, homes: dict[ExpertKey, Residency], pool_sizes: list[int], pool_of: dict[int, int]):
        for key, r in homes.items():
            if r.slot is not None or r.hot:
                raise IllegalTransition(f"{key}: experts start in no slot (place_hot puts them in)")
            if not _placed_right(r):
                raise IllegalTransition(f"{key}: home {r.home.value} with host offset {r.host_offset}")
        self._experts = dict(homes)
        self._pools = [_Pool(n) for n in pool_sizes]
        self.pool_of = dict(pool_of)
        # bumped whenever an expert's home, host place or hotness changes: device-side copies of
        # the table (direct decode's) compare it to know when to rebuild
        self.homes_version = 0
        self.layer_versions: dict[int, int] = {}
        # arrays over the grid, kept by the transitions: hot and warm masks (the rebalancer plans
        # over them), each hot expert's slot and each warm expert's host place, -1 elsewhere
        self.grid = ExpertGrid.of(self._experts)
        self.hot_mask = np.zeros(self.grid.size, dtype=bool)
        self.warm_mask = np.zeros(self.grid.size, dtype=bool)
        self.hot_slot = np.full(self.grid.size, -1, dtype=np.int64)
        self.host_offset = np.full(self.grid.size, -1, dtype=np.int64)
        self.pool_offset = np.full(self.grid.size, -1, dtype=np.int64)  # each quantized hot expert's place in the GPU's blob pool
        for k, r in self._experts.items():
            self._cells(k, r)

    # -- reading -----------------------------------------------------------------------------
    def __getitem__(self, key: ExpertKey) -> Residency:
        return self._experts[key]

    def __len__(self) -> int:
        return len(self._experts)

    def items(self):
        return self._experts.items()

    def pool_sizes(self) -> list[int]:
        return [len(p.occupant) for p in self._pools]

    def occupant(self, pool: int, slot: int) -> ExpertKey | None:
        return self._pools[pool].occupant[slot]

    def readers(self, pool: int) -> list[int]:
        """The pool's reader counts, slot by slot (a live read-only list)."""
        return self._pools[pool].readers

    def is_hot_slot(self, pool: int, slot: int) -> bool:
        return self._pools[pool].hot[slot]

    def reserved(self, pool: int, slot: int) -> str | None:
        return self._pools[pool].reserved[slot]

    def reserved_slots(self, pool: int, by: str) -> list[int]:
        """The slots of ``pool`` that ``by`` holds reserved, ascending (read only)."""
        return self._pools[pool].by.get(by, [])

    def last_read(self, pool: int, slot: int) -> Any | None:
        return self._pools[pool].last_read[slot]

    def ready_event(self, pool: int, slot: int) -> Any | None:
        """The pending write's ready event, if any (read only: nobody is ordered after it by this)."""
        pending = self._pools[pool].ready[slot]
        return None if pending is None else pending[0]

    def pending_slots(self, pool: int) -> set[int]:
        """Slots of ``pool`` whose write nobody has waited on yet (read only)."""
        return self._pools[pool].pending

    def state(self, pool: int, slot: int) -> SlotState:
        p = self._pools[pool]
        if p.readers[slot]:
            return SlotState.IN_USE
        if p.occupant[slot] is None:
            return SlotState.RESERVED if p.reserved[slot] else SlotState.FREE
        return SlotState.WRITING if p.writing[slot] else SlotState.READY

    def slot(self, pool: int, slot: int) -> SlotView:
        p = self._pools[pool]
        return SlotView(pool, slot, p.occupant[slot], self.state(pool, slot), p.readers[slot], p.hot[slot], p.reserved[slot], p.writing[slot])

    def counts(self) -> dict[str, int]:
        out = {h.value: 0 for h in Home}
        for r in self._experts.values():
            out[r.home.value] += 1
        return out

    # -- expert homes ----------------------------------------------------------------------------
    def _set(self, key: ExpertKey, new: Residency) -> None:
        old = self._experts[key]
        self._experts[key] = new
        if (old.home, old.host_offset, old.hot, old.slot if old.hot else None) != (new.home, new.host_offset, new.hot, new.slot if new.hot else None):
            self.homes_version += 1
            self.layer_versions[key.layer] = self.layer_versions.get(key.layer, 0) + 1
            self._cells(key, new)

    def _cells(self, key: ExpertKey, r: Residency) -> None:
        i = self.grid.index(key)
        self.hot_mask[i], self.warm_mask[i] = r.hot, r.home is Home.CPU
        self.hot_slot[i] = r.slot if r.hot else -1
        self.host_offset[i] = r.host_offset if r.home is Home.CPU else -1
        self.pool_offset[i] = r.host_offset if r.home is Home.GPU and r.host_offset is not None else -1

    def warm(self, key: ExpertKey, offset: int) -> None:
        """An nvme expert's blob landed in the host pool at ``offset``: it is served from there."""
        r = self._experts[key]
        if r.hot or r.home is not Home.NVME:
            raise IllegalTransition(f"warm {key}: needs home nvme, not {'hot' if r.hot else r.home.value}")
        self._set(key, Residency(Home.CPU, offset, r.slot, False))

    def move(self, key: ExpertKey, offset: int) -> None:
        """A warm expert's blob was copied to another place in the host pool."""
        r = self._experts[key]
        if r.home is not Home.CPU:
            raise IllegalTransition(f"move {key}: needs home cpu, not {r.home.value}")
        self._set(key, Residency(Home.CPU, offset, r.slot, False))

    def cool(self, key: ExpertKey) -> None:
        """A warm expert's host bytes go to another: it is served from disk again."""
        r = self._experts[key]
        if r.home is not Home.CPU:
            raise IllegalTransition(f"cool {key}: needs home cpu, not {r.home.value}")
        self._set(key, Residency(Home.NVME, None, r.slot, False))

    # -- slots -------------------------------------------------------------------------------
    def _free_for_write(self, what: str, pool: int, slot: int, by: str | None = None, about: object = "") -> _Pool:
        """The slot's pool, when no reader holds the slot and ``by`` is its reservation (None: none);
        else ``IllegalTransition`` naming the transition ``what`` (of ``about``) and the slot."""
        p = self._pools[pool]
        if p.readers[slot] or p.reserved[slot] != by:
            what = f"{what} {about}".rstrip()
            if p.readers[slot]:
                raise IllegalTransition(f"{what}: slot {slot} of pool {pool} ({p.occupant[slot]}) is held by {p.readers[slot]} reader(s)")
            held_by = f"reserved by {p.reserved[slot]}" if p.reserved[slot] else "not reserved"
            raise IllegalTransition(f"{what}: slot {slot} of pool {pool} is {held_by}")
        return p

    def _empty(self, p: _Pool, slot: int) -> None:
        """The occupant leaves the slot (its record says so); the slot is left without one."""
        old = p.occupant[slot]
        if old is not None:
            r = self._experts[old]
            self._experts[old] = Residency(r.home, r.host_offset, None, False)
        if p.ready[slot] is not None:
            # a write nobody waited on: the next write waits on it instead (it already waited on the last read)
            p.last_read[slot] = p.ready[slot][0]
        p.occupant[slot] = None
        p.writing[slot] = False
        p.ready[slot] = None
        p.pending.discard(slot)

    def place_hot(self, key: ExpertKey, pool: int, slot: int) -> None:
        """Load time: ``key`` (home gpu) goes into a free slot for good; its bytes are in place."""
        r, p = self._experts[key], self._pools[pool]
        if r.home is not Home.GPU or r.slot is not None:
            raise IllegalTransition(f"place_hot {key}: needs home gpu and no slot, has home {r.home.value}, slot {r.slot}")
        if r.host_offset is not None:
            raise IllegalTransition(f"place_hot {key}: a quantized hot expert (its blob at {r.host_offset} of the GPU's blob pool) "
                                    f"takes no hot slot")
        if p.occupant[slot] is not None or p.hot[slot] or p.reserved[slot] or self.pool_of[key.layer] != pool:
            raise IllegalTransition(f"place_hot {key}: slot {slot} of pool {pool} is not a free slot of its pool")
        p.occupant[slot], p.hot[slot] = key, True
        self._set(key, Residency(Home.GPU, None, slot, True))

    def stage(self, key: ExpertKey, pool: int, slot: int, by: str | None = None) -> ExpertKey | None:
        """``key``'s bytes are about to be queued into ``slot`` (unheld, not hot; a reserved slot
        only by its reserver ``by``): the slot's occupant, returned, leaves it; ``key`` sits there,
        writing."""
        r = self._experts[key]
        if r.slot is not None or r.hot:
            raise IllegalTransition(f"stage {key}: it is in slot {r.slot} already")
        if self.pool_of[key.layer] != pool:
            raise IllegalTransition(f"stage {key}: pool {pool} is not its layer's")
        p = self._free_for_write("stage", pool, slot, by, key)
        if p.hot[slot]:
            raise IllegalTransition(f"stage {key}: slot {slot} of pool {pool} is hot ({p.occupant[slot]})")
        old = p.occupant[slot]
        if old is not None or p.ready[slot] is not None:
            self._empty(p, slot)
        p.occupant[slot], p.writing[slot] = key, True
        self._experts[key] = Residency(r.home, r.host_offset, slot, False)
        return old

    def written(self, pool: int, slots: list[int], event: Any, stream: Any) -> None:
        """The writes of ``slots`` were queued on ``stream`` before ``event`` was recorded there:
        it is their ready event (one for a batch of writes)."""
        p = self._pools[pool]
        order = next(_ORDER)
        for slot in slots:
            if not p.writing[slot]:
                raise IllegalTransition(f"written: slot {slot} of pool {pool} ({p.occupant[slot]}) has no write queued")
            p.ready[slot] = (event, stream, order)
            p.pending.add(slot)

    def hold(self, pool: int, slot: int) -> None:
        """A reader takes the slot: it cannot be rewritten or emptied until ``release``."""
        p = self._pools[pool]
        if p.occupant[slot] is None and not p.reserved[slot]:
            raise IllegalTransition(f"hold: slot {slot} of pool {pool} is free")
        p.readers[slot] += 1

    def take_ready(self, pool: int, slot: int) -> Pending | None:
        """A holder will order its reads after the slot's pending write: that write's (event,
        stream, order), now the caller's to wait on, or None when there is none to wait for."""
        p = self._pools[pool]
        if not p.readers[slot]:
            raise IllegalTransition(f"take_ready: slot {slot} of pool {pool} ({p.occupant[slot]}) is not held")
        pending = p.ready[slot]
        if pending is None:
            if p.writing[slot]:
                raise IllegalTransition(f"take_ready: slot {slot} of pool {pool} ({p.occupant[slot]}) has a write queued without its "
                                        "ready event yet (waited on inside the batch that queues it)")
            return None
        p.ready[slot] = None
        p.writing[slot] = False
        p.pending.discard(slot)
        return pending

    def release(self, pool: int, slot: int, last_read: Any | None) -> None:
        """A reader gives the slot back; ``last_read`` (recorded after its kernels, or None for a
        hold that queued none) is what a later write waits on."""
        p = self._pools[pool]
        if not p.readers[slot]:
            raise IllegalTransition(f"release: slot {slot} of pool {pool} is released more often than held")
        p.readers[slot] -= 1
        if last_read is not None:
            p.last_read[slot] = last_read

    # -- hold, take_ready and release over many slots of one pool, in one call (a streamed part's) -------
    def hold_many(self, pool: int, slots: list[int]) -> None:
        p = self._pools[pool]
        for slot in slots:
            if p.occupant[slot] is None and not p.reserved[slot]:
                raise IllegalTransition(f"hold: slot {slot} of pool {pool} is free")
        for slot in slots:
            p.readers[slot] += 1

    def take_ready_many(self, pool: int, slots: list[int]) -> list[Pending]:
        """``take_ready`` of each slot, all or none: the pending writes there were (Nones left out)."""
        p = self._pools[pool]
        for slot in slots:
            if not p.readers[slot] or (p.writing[slot] and p.ready[slot] is None):
                self.take_ready(pool, slot)  # raises, naming the slot, before anything changed
        take = self.take_ready
        return [w for w in (take(pool, slot) for slot in slots) if w is not None]

    def release_many(self, pool: int, slots: list[int], last_read: Any | None) -> None:
        p = self._pools[pool]
        times: dict[int, int] = {}
        for slot in slots:
            times[slot] = times.get(slot, 0) + 1
            if p.readers[slot] < times[slot]:
                raise IllegalTransition(f"release: slot {slot} of pool {pool} is released more often than held")
        for slot in slots:
            p.readers[slot] -= 1
            if last_read is not None:
                p.last_read[slot] = last_read

    def evict(self, pool: int, slot: int, by: str | None = None) -> ExpertKey | None:
        """An unheld staging slot is emptied (its occupant, returned, leaves the GPU); a reserved
        one only by its reserver ``by``."""
        p = self._free_for_write("evict", pool, slot, by)
        if p.hot[slot]:
            raise IllegalTransition(f"evict: slot {slot} of pool {pool} is hot ({p.occupant[slot]}); hot experts are never evicted")
        old = p.occupant[slot]
        self._empty(p, slot)
        return old

    def reserve(self, pool: int, slot: int, by: str, *, keep: bool = False) -> ExpertKey | None:
        """A path takes an unheld staging slot out of the cache: its occupant, returned, leaves,
        or (``keep``) stays, for the path to use where it is."""
        p = self._free_for_write("reserve by", pool, slot, None, by)
        if p.hot[slot]:
            raise IllegalTransition(f"reserve by {by}: slot {slot} of pool {pool} is hot")
        old = p.occupant[slot]
        if not keep:
            self._empty(p, slot)
        p.reserved[slot] = by
        mine = p.by.setdefault(by, [])
        mine.append(slot)
        mine.sort()
        return None if keep else old

    def unreserve(self, pool: int, slot: int, by: str, last_read: Any | None, *, keep: bool) -> None:
        """``by`` gives a reserved slot back, read last before ``last_read``: with what it staged
        into it (``keep``: the cache may hit it) or empty (the device alone knew its contents)."""
        p = self._pools[pool]
        if p.reserved[slot] != by:
            raise IllegalTransition(f"unreserve by {by}: slot {slot} of pool {pool} is reserved by {p.reserved[slot]}")
        if p.readers[slot]:
            raise IllegalTransition(f"unreserve by {by}: slot {slot} of pool {pool} is still held")
        if not keep:
            self._empty(p, slot)
        p.reserved[slot] = None
        p.by[by].remove(slot)
        if last_read is not None:
            p.last_read[slot] = last_read

    def swap_hot(self, new: ExpertKey, pool: int, slot: int) -> ExpertKey:
        """The rebalancer gives hot ``slot``'s expert's place to ``new`` (in no slot): the old one,
        returned, lives on disk; ``new`` is hot there, its copy about to be queued."""
        p = self._free_for_write("swap_hot", pool, slot, None, new)
        old, r = p.occupant[slot], self._experts[new]
        if not p.hot[slot] or old is None:
            raise IllegalTransition(f"swap_hot {new}: slot {slot} of pool {pool} is not a hot slot")
        if r.slot is not None or self.pool_of[new.layer] != pool:
            raise IllegalTransition(f"swap_hot {new}: it is in slot {r.slot} already, or of another pool")
        self._set(old, Residency(Home.NVME))
        if p.ready[slot] is not None:  # an earlier promotion's write nobody waited on: the next write waits on it
            p.last_read[slot] = p.ready[slot][0]
        p.occupant[slot], p.writing[slot], p.ready[slot] = new, True, None
        p.pending.discard(slot)
        self._set(new, Residency(Home.GPU, None, slot, True))
        return old

    # -- checking ----------------------------------------------------------------------------
    def check(self) -> None:
        """Assert every invariant of the module docstring (tests, and ``tiers.manifest``)."""
        seen: dict[tuple[int, int], ExpertKey] = {}
        for key, r in self._experts.items():
            assert _placed_right(r), f"{key}: home {r.home} with host offset {r.host_offset}"
            assert not r.hot or (r.home is Home.GPU and r.slot is not None), f"{key}: hot with home {r.home}, slot {r.slot}"
            if r.slot is not None:
                where = (self.pool_of[key.layer], r.slot)
                assert where not in seen, f"{key} and {seen[where]} both in slot {where}"
                seen[where] = key
                assert self._pools[where[0]].occupant[r.slot] == key, f"{key}: its slot {where} names {self._pools[where[0]].occupant[r.slot]}"
                assert self._pools[where[0]].hot[r.slot] == r.hot, f"{key}: hot {r.hot}, slot {where} hot {not r.hot}"
            i = self.grid.index(key)
            assert self.hot_mask[i] == r.hot and self.warm_mask[i] == (r.home is Home.CPU), f"{key}: masks disagree"
            assert self.hot_slot[i] == (r.slot if r.hot else -1) and self.host_offset[i] == (r.host_offset if r.home is Home.CPU else -1)
            assert self.pool_offset[i] == (r.host_offset if r.home is Home.GPU and r.host_offset is not None else -1)
        for pi, p in enumerate(self._pools):
            assert all(p.reserved[s] == by for by, slots in p.by.items() for s in slots), f"pool {pi}: reservation index disagrees"
            for s, key in enumerate(p.occupant):
                assert p.readers[s] >= 0
                if key is not None:
                    assert seen.get((pi, s)) == key, f"slot {(pi, s)} names {key}, which is not there"
                else:
                    assert not p.writing[s] and not p.hot[s] and s not in p.pending, f"empty slot {(pi, s)} with state"
                assert not (p.hot[s] and p.reserved[s]), f"hot slot {(pi, s)} reserved"
                assert p.reserved[s] is None or s in p.by.get(p.reserved[s], ()), f"slot {(pi, s)}: reservation index disagrees"
                assert (s in p.pending) == (p.ready[s] is not None), f"slot {(pi, s)}: pending set disagrees"
                assert p.ready[s] is None or p.writing[s], f"slot {(pi, s)}: a ready event without a write"


def _placed_right(r: Residency) -> bool:
    """Home cpu: a host place; home nvme: none; home gpu: a blob place only when quantized hot (never hot)."""
    if r.home is Home.CPU:
        return r.host_offset is not None
    if r.home is Home.NVME:
        return r.host_offset is None
    return r.host_offset is None or not r.hot
