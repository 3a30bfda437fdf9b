"""Read-ahead of cold experts: disk reads on reader threads into staging slots' pinned ring buffers.

Owns the reader threads and the reads in flight. A read-ahead stages its expert in the table
(``Table.stage``) and holds the slot while its thread reads, so nobody takes the slot or its ring
buffer; when the read lands its copy up is queued (``land``), or, if it failed, the slot is
emptied and a later demand read of the expert raises the error where it is needed. Why: one
blob at a time on the serving thread leaves the disk idle between small reads (on the H200's
disk, 4.5 MiB blobs read at 1.57 GB/s four at a time against 1.22 one at a time,
``tools/coldread.py``).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from tiers.loader.layout import ExpertKey
from tiers.store.disk_store import DiskStore, IntegrityError
from tiers.store.pools import SlotPool
from tiers.store.table import Table
from tiers.transfer.staging import Staging


class ReadAhead:
    THREADS = 4

    def __init__(self, table: Table, disk: DiskStore, staging: Staging, stats: Any, precision: str):
        self.table, self.disk, self.staging, self.stats, self.precision = table, disk, staging, stats, precision
        self.threads = ThreadPoolExecutor(self.THREADS, thread_name_prefix="tiers-read")
        self.pending: dict[tuple[int, int], tuple[Future, ExpertKey, torch.Tensor, SlotPool]] = {}  # (pool, slot) -> its read

    def start(self, key: ExpertKey, pool: SlotPool, slot: int) -> None:
        """Stage cold ``key`` into ``slot`` (the cache's victim) and read its blob on a thread."""
        src = self.staging.ring_buffer(pool.index, slot, self.disk.manifest.ref(key, self.precision).nbytes)
        self.table.stage(key, pool.index, slot)
        self.table.hold(pool.index, slot)  # the reader thread owns the ring buffer: nobody may take the slot meanwhile
        self.pending[(pool.index, slot)] = (self.threads.submit(self.disk.read, key, self.precision, src), key, src, pool)
        self.stats.async_reads += 1

    def land(self, where: tuple[int, int]) -> None:
        """Land one read: queue its copy up; if it failed, empty the slot (a demand read raises the error)."""
        future, key, src, pool = self.pending.pop(where)
        slot = where[1]
        try:
            future.result()
        except IntegrityError:
            self.table.release(pool.index, slot, None)
            self.table.evict(pool.index, slot)
            self.stats.async_read_errors += 1
            return
        self.table.release(pool.index, slot, None)
        self.staging.write(key, pool, slot, self.precision, "nvme", src)

    def in_pool(self, pool: int) -> list[tuple[int, int]]:
        return [w for w in self.pending if w[0] == pool]

    def landed(self) -> list[tuple[int, int]]:
        """The reads that have finished (never blocks)."""
        return [w for w, v in self.pending.items() if v[0].done()]

    def close(self) -> None:
        self.threads.shutdown(wait=True)
