"""Lookahead prefetch and read-ahead of cold experts, as a mixin of the tier manager.

Owns: staging predicted experts of later layers into staging slots nobody holds (never holding
them, never evicting its own work), reading prefetched cold experts on reader threads into the
slot's pinned ring buffer and queuing their copies once the read has landed, and the prefetch
accuracy counters. Invariant: a slot whose read is in flight is held (nobody may take it) until
``_complete`` lands or undoes it; a failed read-ahead changes nothing a demand read relies on.
"""
from __future__ import annotations

from tiers.loader.layout import ExpertKey
from tiers.cache import LruSlots
from tiers.disk_store import IntegrityError
from tiers.residency import Home, Op
from tiers.slots import SlotPool


class Prefetcher:
    """Mixed into ``TierManager``: uses its table, pools, caches, disk, host ring and ``_stage``."""

    def prefetch(self, layer: int, experts: list[int], limit: int | None = None, direct: bool = True) -> int:
        """Stage predicted experts of a later layer into staging slots nobody holds, without holding
        them: a later lookup finds them resident (or still loading, and waits on their event).
        Stages at most as many as there are unheld staging slots (and ``limit``), so it never
        evicts its own work. ``direct=False`` reads warm ones through the copy engine even where
        direct stacks could (a long call's GEMMs need the SMs)."""
        pool = self.pool_of[layer]
        lru = self.cache[id(pool)]
        free = self.unheld_staging(pool) if limit is None else min(limit, self.unheld_staging(pool))
        issued = 0
        with self.staging():
            for e in experts:
                if issued >= free:
                    break
                key = ExpertKey(layer, e)
                r = self.table[key]
                if r.slot is not None:
                    continue
                if r.home is Home.NVME and self.reader_threads is not None:
                    if not self._read_ahead(key, pool, lru):
                        break
                elif self._claim_and_stage(key, r, pool, lru, direct) is None:
                    break
                self.prefetched[key] = src_bytes = self.manifest.ref(key, self._precision_of(r)).nbytes
                self.stats_.prefetch_issued += 1
                self.stats_.prefetch_bytes += src_bytes
                issued += 1
        return issued

    def _read_ahead(self, key: ExpertKey, pool: SlotPool, lru: LruSlots) -> bool:
        """Claim a slot for a cold ``key`` and read its blob on a reader thread; the copy up is
        queued when the read lands (``pump`` or the next lookup of ``key``)."""
        slot = lru.victim(pool.readers)
        if slot is None:
            return False
        precision = self.cfg.nvme.precision
        src = self._ring(pool, slot, self.manifest.ref(key, precision).nbytes)
        self._evict_owner(pool, slot)
        pool.owner[slot] = key
        self.table.apply(key, Op.STAGE, slot)
        lru.assign(slot, key)
        pool.hold(slot)  # the reader thread owns the ring buffer; nobody may take the slot meanwhile
        self.pending[(id(pool), slot)] = (self.reader_threads.submit(self.disk.read, key, precision, src), key, precision, src, pool)
        self.stats_.async_reads += 1
        return True

    def _complete(self, ring_key: tuple[int, int]) -> None:
        """Land one read-ahead: queue its copy up, or undo it if the read failed (a later demand
        read of the expert raises the error where it is needed)."""
        future, key, precision, src, pool = self.pending.pop(ring_key)
        slot = ring_key[1]
        try:
            future.result()
        except IntegrityError:
            pool.end_read(slot, None, record=False)
            self.table.apply(key, Op.EVICT)
            pool.owner[slot] = None
            self.prefetched.pop(key, None)
            self.stats_.async_read_errors += 1
            return
        pool.end_read(slot, None, record=False)
        self._stage(key, pool, slot, precision, "nvme", src)

    def drain(self) -> None:
        """Land every read-ahead, waiting for those still in flight."""
        for ring_key in list(self.pending):
            self._complete(ring_key)

    def pump(self) -> None:
        """Queue the copies of every read-ahead that has landed; never blocks."""
        landed = [k for k, v in self.pending.items() if v[0].done()]
        if landed:
            with self.staging():
                for ring_key in landed:
                    self._complete(ring_key)

    def note_prediction(self, layer: int, experts: list[int]) -> None:
        """The experts predicted for ``layer``'s next call, the likeliest first (the order a
        read-ahead stages them in)."""
        self.predicted[layer] = list(experts)

    def note_used(self, layer: int, experts: list[int]) -> None:
        """Score the prediction made for this layer: accuracy = |predicted & used| / |used|."""
        self.score_prediction(self.predicted.pop(layer, None), experts)

    def score_prediction(self, predicted: list[int] | None, experts: list[int]) -> None:
        """Count a layer call's prediction (None: it had none) against the experts it used."""
        if predicted is not None:
            self.stats_.prefetch_correct += len(set(predicted).intersection(experts))
            self.stats_.prefetch_used_total += len(experts)

