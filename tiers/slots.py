"""Holding experts in GPU slots for a layer call: hits, misses staged into the cache's victims, waits, releases.

Owns the serving side of the slot rule, through the table's transitions: a lookup holds its
expert's slot (staging it first on a miss), the compute stream waits on the slot's pending
write right before the first kernel that reads it (``wait_all``), and the slot is released with
an event recorded after those kernels (``release_all``), which the next write into it waits on.
Also: the cold misses of a call read ahead in parallel, and the lookup counters.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from tiers.loader.layout import ExpertKey
from tiers.loader.packed import Manifest
from tiers.policy.slot_cache import SlotCache
from tiers.store.pools import SlotPool
from tiers.store.table import Home, Residency, Table
from tiers.transfer.read_ahead import ReadAhead
from tiers.transfer.staging import Staging


class Handle(NamedTuple):
    """A held slot: the expert's weights, valid until released."""

    key: ExpertKey
    pool: SlotPool
    slot: int

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return self.pool.tensors(self.slot)


class Slots:
    # A call's cold misses are read together on the reader threads when their blobs are at most
    # this large. On the H200's disk, 4.5 MiB blobs read at 1.57 GB/s four at a time against
    # 1.22 one at a time, while 168 MiB blobs, read in 8 MiB requests either way, read at 1.70
    # one at a time and 1.48 together (tools/coldread.py).
    PARALLEL_READ_BYTES = 32 << 20

    def __init__(self, manifest: Manifest, table: Table, pools: list[SlotPool], pool_of: dict[int, SlotPool], caches: list[SlotCache],
                 staging: Staging, read_ahead: ReadAhead | None, streams: Any, stats: Any):
        self.manifest, self.table, self.pools, self.pool_of, self.caches = manifest, table, pools, pool_of, caches
        self.staging, self.read_ahead, self.streams, self.stats = staging, read_ahead, streams, stats
        self.timing = staging.timing
        self.recorded: list[ExpertKey] | None = None  # set to a list to record every lookup (a routing trace)
        self.demand_reads: set[ExpertKey] = set()  # cold misses of the current call read ahead, not yet looked up

    # -- lookups -------------------------------------------------------------------------------
    def acquire(self, key: ExpertKey) -> Handle | None:
        """Hold ``key`` in a GPU slot, staging it if needed; None if every staging slot is held."""
        table, pool = self.table, self.pool_of[key.layer]
        cache = self.caches[pool.index]
        r = table[key]
        demand = key in self.demand_reads
        if demand:
            self.demand_reads.discard(key)
        if self.recorded is not None:
            self.recorded.append(key)
        if not r.hot:
            cache.access(key)
        if r.slot is not None and (pool.index, r.slot) in self.read_ahead_pending():
            self._land((pool.index, r.slot))  # its disk read is in flight: land it first
            r = table[key]
        if r.slot is not None:  # resident; or read ahead for this very call, a miss served by its home tier
            self.stats.lookup(r.home.value if demand else "gpu")
            if not r.hot:
                cache.touch(r.slot)
            table.hold(pool.index, r.slot)
            return Handle(key, pool, r.slot)
        slot = self.claim(key, r, pool)
        if slot is None:
            return None
        self.stats.lookup(r.home.value)
        table.hold(pool.index, slot)
        return Handle(key, pool, slot)

    def acquire_layer(self, layer: int, experts: list[int]) -> list[Handle] | None:
        """Hold all of ``experts`` at once (staging the misses), or None (holding nothing) if the
        misses outnumber the staging slots free now. Two or more cold misses are first read in
        parallel on the reader threads."""
        self.pump()
        self._read_cold_ahead(layer, experts)
        held: list[Handle] = []
        try:
            with self.staging.batch():
                for e in experts:
                    h = self.acquire(ExpertKey(layer, e))
                    if h is None:
                        self.release_all(held)
                        return None
                    held.append(h)
        except BaseException:  # a failed read (IntegrityError) must not leave slots held
            self.release_all(held)
            raise
        return held

    def hold_resident(self, key: ExpertKey) -> Handle:
        """Hold a resident ``key`` (no read in flight) without counting a lookup."""
        pool = self.pool_of[key.layer]
        slot = self.table[key].slot
        self.table.hold(pool.index, slot)
        return Handle(key, pool, slot)

    def claim(self, key: ExpertKey, r: Residency, pool: SlotPool, direct_ok: bool = True) -> int | None:
        """Stage ``key`` into the cache's victim slot; None when every staging slot is held. A miss
        that finds every slot held waits for this pool's read-aheads to land first. Everything that
        can fail (a disk read, a checksum) happens before the table changes."""
        cache = self.caches[pool.index]
        slot = cache.victim()
        while slot is None:
            mine = self.read_ahead.in_pool(pool.index) if self.read_ahead is not None else []
            if not mine:
                return None
            self._land(mine[0])
            slot = cache.victim()
        precision, source, src = self.staging.fetch(key, r, pool, slot)
        self.table.stage(key, pool.index, slot)
        self.staging.write(key, pool, slot, precision, source, src, direct_ok)
        cache.touch(slot)
        return slot

    def drop(self, pool: SlotPool, slot: int) -> None:
        """Empty an unheld staging slot (its expert leaves the GPU)."""
        self.table.evict(pool.index, slot)

    def reserve(self, pool: SlotPool, slot: int, by: str, compute: Any) -> None:
        """Take an unheld staging slot out of the cache for ``by``'s own writes: its expert leaves,
        and ``compute`` is ordered after a write still queued into it."""
        if self.table.occupant(pool.index, slot) is not None:
            self.table.hold(pool.index, slot)
            pending = self.table.take_ready(pool.index, slot)
            self.table.release(pool.index, slot, None)
            if pending is not None:
                compute.wait_event(pending[0])  # that write lands before the reserver's
        self.table.reserve(pool.index, slot, by)

    def unheld_staging(self, pool: SlotPool) -> int:
        """Staging slots of ``pool`` nobody holds or reserved now."""
        readers = self.table.readers(pool.index)
        return sum(1 for s in pool.staging if readers[s] == 0 and not self.table.reserved(pool.index, s))

    # -- waits and releases ----------------------------------------------------------------------
    def wait_all(self, held: list[Handle]) -> None:
        """Make the compute stream wait for every held expert's pending write, right before the
        first kernel that reads them: one wait per stream, on the latest (a stream runs in order)."""
        pending = []
        for h in held:
            p = self.table.take_ready(h.pool.index, h.slot)
            if p is not None:
                pending.append(p)
        self.wait_pending(pending)

    def wait_pending(self, pending: list[tuple[Any, Any, int]]) -> None:
        """Order the compute stream after pending writes, (event, stream, order) each: one wait per
        stream, on the latest of its events; timed as a stall on CUDA."""
        latest: dict[int, tuple[int, Any]] = {}
        for ev, stream, order in pending:
            if id(stream) not in latest or order > latest[id(stream)][0]:
                latest[id(stream)] = (order, ev)
        if not latest:
            return
        compute = self.streams.current()
        e0 = None
        if self.timing:
            e0 = self.streams.event(timing=True)
            e0.record(compute)
        for _, ev in latest.values():
            compute.wait_event(ev)  # the kernels about to be queued read these slots
        if e0 is not None:
            e1 = self.streams.event(timing=True)
            e1.record(compute)
            self.stats.timed("stall", e0, e1)

    def release_all(self, held: list[Handle]) -> None:
        """The experts' kernels are queued: one last-read event for all of them (hot slots, never
        rewritten, need none)."""
        ev = None
        for h in held:
            if self.table.is_hot_slot(h.pool.index, h.slot):
                self.table.release(h.pool.index, h.slot, None)
                continue
            if ev is None:
                ev = self.streams.event()
                ev.record(self.streams.current())
            self.table.release(h.pool.index, h.slot, ev)

    # -- read-ahead -----------------------------------------------------------------
    def read_ahead_pending(self) -> dict:
        return self.read_ahead.pending if self.read_ahead is not None else {}

    def _land(self, where: tuple[int, int]) -> None:
        self.read_ahead.land(where)

    def pump(self) -> None:
        """Queue the copies of every read-ahead that has landed; never blocks."""
        if self.read_ahead is None:
            return
        landed = self.read_ahead.landed()
        if landed:
            with self.staging.batch():
                for where in landed:
                    self._land(where)

    def drain(self) -> None:
        """Land every read-ahead, waiting for those still in flight."""
        for where in list(self.read_ahead_pending()):
            self._land(where)

    def _read_cold_ahead(self, layer: int, experts: list[int]) -> None:
        """Start the disk reads of a call's cold misses together, when there are two or more, their
        blobs are small (``PARALLEL_READ_BYTES``) and the unheld staging slots hold every expert of
        the call that is not hot (so a read-ahead never takes a slot the call itself needs)."""
        if self.read_ahead is None:
            return
        rows = [self.table[ExpertKey(layer, e)] for e in experts]
        cold = [e for e, r in zip(experts, rows) if r.slot is None and r.home is Home.NVME]
        if len(cold) < 2 or self.manifest.layers[layer].largest(self.read_ahead.precision).nbytes > self.PARALLEL_READ_BYTES:
            return
        pool = self.pool_of[layer]
        if sum(not r.hot for r in rows) > self.unheld_staging(pool):
            return
        for e in cold:
            key = ExpertKey(layer, e)
            slot = self.caches[pool.index].victim()
            if slot is None:
                return
            self.read_ahead.start(key, pool, slot)
            self.caches[pool.index].touch(slot)
            self.demand_reads.add(key)
