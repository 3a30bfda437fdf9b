"""The rebalancer: carrying a plan out in the background, between layer calls, without stalling the compute stream.

Owns the promotion buffers, the spare warm places, and the reads, copies and swaps in flight:

- to hot: the newcomer's packed blob (gpu precision) is read on a rebalance thread into a pinned
  promotion buffer, and the outgoing expert's cpu blob into a spare warm place. Once both have
  landed and nobody holds the outgoing expert's hot slot, the copy stream waits on an event
  recorded on the compute stream (kernels already queued may still read the slot), the outgoing
  expert becomes warm at the spare place (never a disk read on the serving path), and the
  newcomer is copied into the same slot (``Table.swap_hot``), so slot addresses never change. The
  newcomer's old warm place becomes the spare; a newcomer from disk instead cools the least used
  warm expert, whose place becomes the spare, so the warm set keeps its size;
- to warm: the host bytes of the outgoing warm expert (or a free place) are taken first (the
  outgoing expert lives on disk again), then the thread waits for every copy queued so far on
  the copy stream (one may read those bytes) and reads the newcomer's blob into them; it becomes
  warm only when its read has landed.

Invariants: no bytes are overwritten while a queued copy or kernel may read them; every expert
always has a home it can be served from (nvme until its new bytes have landed); the hot set
keeps its slot count and the warm set its places, so both budgets hold; layers whose experts are
all hot are left alone.
"""
from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiers import quant
from tiers.config import Rebalance
from tiers.loader.layout import ExpertKey
from tiers.policy.rebalance import GroupState, Move, RoutingWindow, _least, plan_moves
from tiers.store.disk_store import IntegrityError
from tiers.store.table import Home


@dataclass
class _HotRead:
    future: Future  # the newcomer's gpu blob -> promotion buffer
    buffer: int
    replaces: ExpertKey
    spare: int  # host offset the outgoing expert's cpu blob is read into
    out_future: Future


class Rebalancer:
    """Carries plans out on a manager (``tiers.manager.Manager``: its table, pools, host pool, disk,
    streams, staging and slots). Called on the serving thread only; reads run on its own threads."""

    # Pinned promotion buffers (hot promotions in flight at once), each with a spare warm place
    # per pool: as many as fit PROMOTION_BYTES, at least MIN_BUFFERS, at most max_moves.
    # Why: a rebalance promotes at most one expert per free buffer, so with two the hot set of the
    # bench's skewed trace was still climbing after 800 tokens (every 8 tokens, Qwen3's counts on
    # the CPU: experiments/hot_converge.py, experiments/results/hot_converge-qwen3_moe-*.json); small experts
    # cost little to buffer, large ones (Mixtral-8x7B: 336 MiB in bf16) keep two.
    MIN_BUFFERS = 2
    PROMOTION_BYTES = 64 << 20

    @classmethod
    def buffer_count(cls, manifest: Any, cfg: Any) -> int:
        """How many promotion buffers (and spares per pool) a manager with ``cfg`` holds."""
        fit = cls.PROMOTION_BYTES // max(1, cls.largest_blob(manifest, cfg.gpu.precision, manifest.layers))
        return max(cls.MIN_BUFFERS, min(cfg.rebalance.max_moves, fit))

    @classmethod
    def buffer_bytes(cls, manifest: Any, cfg: Any, placement: Any) -> int:
        """Host bytes for the promotion buffers. Hot slots are refilled straight from them, so a
        lossy gpu precision (which would need a transit buffer of its own) keeps the hot set as
        loaded: 0, as without hot experts."""
        gp, cp = cfg.gpu.precision, cfg.cpu.precision
        if not cfg.rebalance.every_tokens or not placement.hot or not quant.get_scheme(gp).lossless:
            return 0
        n = cls.buffer_count(manifest, cfg)
        return n * cls.largest_blob(manifest, gp, manifest.layers) + n * sum(cls.largest_blob(manifest, cp, g.layers) for g in placement.groups)

    @staticmethod
    def largest_blob(manifest: Any, precision: str, layers: Iterable[int]) -> int:
        """Bytes of the largest ``precision`` blob among ``layers``: one promotion buffer or spare place."""
        return max(manifest.layers[L].largest(precision).stride for L in layers)

    def __init__(self, mgr: Any, cfg: Rebalance, *, threads: int):
        self.mgr, self.cfg = mgr, cfg
        self.grid = mgr.table.grid
        self.window = RoutingWindow(self.grid, cfg.every_tokens, cfg.window)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="tiers-rebalance") if threads else None
        self.hot_moves = self.buffer_bytes(mgr.manifest, mgr.cfg, mgr.placement) > 0
        self.buffers, self.spares = [], {p.index: [] for p in mgr.pools}  # spares: per pool, free warm places for demotions
        keys_of = {p.index: [k for k in mgr.manifest.keys if mgr.pool_of[k.layer] is p] for p in mgr.pools}
        if self.hot_moves:
            size = self.largest_blob(mgr.manifest, mgr.cfg.gpu.precision, mgr.manifest.layers)
            n = self.buffer_count(mgr.manifest, mgr.cfg)
            self.buffers = [mgr.host.view(mgr.host.alloc(size, "promotion"), size) for _ in range(n)]
            for p in mgr.pools:
                place = self.largest_blob(mgr.manifest, mgr.cfg.cpu.precision, {k.layer for k in keys_of[p.index]})
                self.spares[p.index] = [mgr.host.alloc(place, "spares") for _ in range(n)]
        self.buffer_busy: list[Any | None] = [None] * len(self.buffers)
        self.hot_reads: dict[ExpertKey, _HotRead] = {}
        self.warm_reads: dict[ExpertKey, tuple[Future, int]] = {}
        # demoted experts being copied from the spare place they were read into to the place their
        # promoted counterpart left: expert -> (copy, spare place, that place)
        self.relocations: dict[ExpertKey, tuple[Future, int, int]] = {}
        self.free_places: dict[int, list[int]] = {p.index: [] for p in mgr.pools}
        self.counts = {"rebalances": 0, "promoted_hot": 0, "promoted_warm": 0, "read_errors": 0}
        # per pool: its experts, and those the rebalancer may move (the static layers are fixed at load)
        self._pool_mask = {p.index: self.grid.mask(keys_of[p.index]) for p in mgr.pools}
        self._movable_mask = {p.index: self.grid.mask(k for k in keys_of[p.index] if self.movable(k.layer)) for p in mgr.pools}

    # -- accounting ---------------------------------------------------------------------------
    def movable(self, layer: int) -> bool:
        return not self.mgr.resident.qualifies(layer)

    def open_token(self, tokens: int) -> None:
        """A token's first pooled layer call begins: land whatever has finished, count the tokens,
        and when an interval closes plan and issue a rebalance. Swaps land only here, between two
        layer calls, never inside one."""
        self.land()
        if self.window.tokens + tokens >= self.window.every:  # the interval closes
            self._count_direct()
        freq = self.window.add_tokens(tokens)
        if freq is not None:
            self.rebalance(freq)

    def count(self, keys: list[ExpertKey]) -> None:
        """A layer call's lookups."""
        if keys:
            self.window.count(keys)

    def _count_direct(self) -> None:
        """Add direct decode's device counts since the last take (one sync, only if a direct call ran)."""
        usage = self.mgr.direct.take_usage()
        if usage is not None:
            self.window.add(usage)

    # -- planning -----------------------------------------------------------------------------
    def rebalance(self, freq: np.ndarray) -> list[Move]:
        """Plan and issue moves by ``freq``, uses per cell of the table's grid."""
        mgr = self.mgr
        self.counts["rebalances"] += 1
        busy = self._busy()
        issued = []
        for pool in mgr.pools:
            keys = self._movable_mask[pool.index]
            state = GroupState(grid=self.grid, keys=keys, hot=keys & mgr.table.hot_mask, warm=keys & mgr.table.warm_mask,
                               free_places=len(self.free_places[pool.index]), busy=busy)
            for move in plan_moves(freq, state, max_moves=self.cfg.max_moves):
                if self._issue(move, pool):
                    issued.append(move)
        return issued

    def _busy(self) -> np.ndarray:
        """Experts a move may not touch now (a mask over the grid): those with a rebalance read in
        flight, the hot experts promotions will replace, and those with a read-ahead in flight."""
        busy = set(self.hot_reads) | set(self.warm_reads) | set(self.relocations) | {r.replaces for r in self.hot_reads.values()}
        return self.grid.mask(busy | {v[1] for v in self.mgr.slots.read_ahead_pending().values()})

    def _issue(self, move: Move, pool: Any) -> bool:
        mgr = self.mgr
        if move.to is Home.GPU:
            if not self.hot_moves:
                return False
            # a buffer is free once no read fills it and its last promotion's copy up has read it;
            # a copy up still queued is not waited for (it is queued behind every copy before it,
            # a prefill's reads among them): the move waits for a later rebalance instead
            reading = {r.buffer for r in self.hot_reads.values()}
            free = [i for i in range(len(self.buffers))
                    if i not in reading and (self.buffer_busy[i] is None or self.buffer_busy[i].query())]
            spares = self.spares[pool.index]
            if not free or not spares:
                return False
            i = free[0]
            self.buffer_busy[i] = None
            spare = spares.pop()
            out = self._read_into_place(move.replaces, spare)
            self.hot_reads[move.key] = _HotRead(self._submit(mgr.disk.read, move.key, mgr.cfg.gpu.precision, self.buffers[i]), i,
                                                move.replaces, spare, out)
            return True
        if move.replaces is not None:
            r = mgr.table[move.replaces]
            if r.home is not Home.CPU:
                return False
            offset = r.host_offset
            mgr.table.cool(move.replaces)  # from now on it is served from disk
        elif self.free_places[pool.index]:
            offset = self.free_places[pool.index].pop()
        else:
            return False
        self.warm_reads[move.key] = (self._read_into_place(move.key, offset), offset)
        return True

    def _read_into_place(self, key: ExpertKey, offset: int) -> Future:
        """Read ``key``'s cpu blob into the host pool at ``offset`` on a rebalance thread, once every
        read of host memory queued so far is done: the copy stream's copies and direct stacks, and
        the compute stream's direct decode kernels (one may still read the old bytes there)."""
        mgr = self.mgr
        cp = mgr.cfg.cpu.precision
        return self._submit(self._read_after, self._host_fence(), key, cp, mgr.host.view(offset, mgr.manifest.ref(key, cp).nbytes))

    def _host_fence(self) -> Any:
        """An event past every read of host memory queued so far: the copy stream's copies and
        direct stacks, and (the copy stream made to wait for it) the compute stream's direct decode
        kernels."""
        mgr = self.mgr
        compute = mgr.streams.event()
        compute.record(mgr.streams.current())
        mgr.staging.copy_stream.wait_event(compute)
        # Waited for on a rebalance thread, behind a prefill's reads at times: a blocking event,
        # so that thread sleeps. On the H200 a default event's wait spun 84-87% of a core for as
        # long as it waited, a blocking one's 1% (experiments/results/spin_probe.json).
        fence = mgr.streams.event(blocking=True)
        fence.record(mgr.staging.copy_stream)
        return fence

    def _relocate(self, key: ExpertKey, spare: int, place: int) -> None:
        """Copy warm ``key``'s blob from ``spare`` to ``place`` on a rebalance thread, once nothing
        reads ``place`` any more; it moves there when the copy is landed. A layer's warm experts
        were placed side by side at load, and a streamed part copies each run of them that lies
        back to back with one copy: were every demoted expert left in the spare it was read into,
        each swap would split two runs (a model of 12 layers of 128 experts went from one run
        per layer to 15-31 after 156 swaps, ``experiments/hot_layout.py``)."""
        mgr = self.mgr
        nbytes = mgr.manifest.ref(key, mgr.cfg.cpu.precision).nbytes
        copy = self._submit(self._copy_after, self._host_fence(), mgr.host.view(spare, nbytes), mgr.host.view(place, nbytes))
        self.relocations[key] = (copy, spare, place)

    @staticmethod
    def _copy_after(fence: Any, src, dst) -> None:
        fence.synchronize()
        dst.copy_(src)

    def _submit(self, fn, *args) -> Future:
        if self.pool is not None:
            return self.pool.submit(fn, *args)
        f: Future = Future()  # no threads: read on the serving thread
        try:
            f.set_result(fn(*args))
        except Exception as e:  # surfaces when the read is landed
            f.set_exception(e)
        return f

    def _read_after(self, fence: Any, key: ExpertKey, precision: str, dst) -> None:
        fence.synchronize()
        self.mgr.disk.read(key, precision, dst)

    # -- landing ------------------------------------------------------------------------------
    def land(self, wait: bool = False) -> None:
        """Finish every read that has landed (all of them, waiting, with ``wait``)."""
        for key, (future, offset) in list(self.warm_reads.items()):
            if wait or future.done():
                del self.warm_reads[key]
                self._finish_warm(key, future, offset)
        for key, read in list(self.hot_reads.items()):
            if wait or (read.future.done() and read.out_future.done()):
                if self._finish_hot(key, read):
                    del self.hot_reads[key]
        for key, (copy, spare, place) in list(self.relocations.items()):
            if wait or copy.done():
                del self.relocations[key]
                self._finish_relocation(key, copy, spare, place)

    def _finish_relocation(self, key: ExpertKey, copy: Future, spare: int, place: int) -> None:
        """``key`` moves to ``place`` and its spare is free again (reads of it still queued land
        first: a spare is only read into after a fence); if the copy failed it stays, and
        ``place`` becomes the spare. The expert was busy meanwhile, so it is still warm in the spare."""
        mgr = self.mgr
        spares = self.spares[mgr.pool_of[key.layer].index]
        if copy.exception() is not None:
            spares.append(place)
            return
        mgr.table.move(key, place)
        spares.append(spare)

    def _finish_warm(self, key: ExpertKey, future: Future, offset: int) -> None:
        mgr = self.mgr
        places = self.free_places[mgr.pool_of[key.layer].index]
        try:
            future.result()
        except IntegrityError:
            self.counts["read_errors"] += 1
            places.append(offset)
            return
        r = mgr.table[key]
        if r.hot or r.home is not Home.NVME:  # promoted to hot meanwhile: the place stays free
            places.append(offset)
            return
        mgr.table.warm(key, offset)
        self.counts["promoted_warm"] += 1

    def _finish_hot(self, key: ExpertKey, read: _HotRead) -> bool:
        """Swap ``key`` into the hot slot of ``read.replaces``. False: retry later (held now)."""
        mgr = self.mgr
        pool, table = mgr.pool_of[key.layer], mgr.table
        spares = self.spares[pool.index]
        try:
            read.future.result()
        except IntegrityError:
            read.out_future.exception()  # let the other read finish before its place is reused
            self.counts["read_errors"] += 1
            spares.append(read.spare)
            return True
        out_ok = read.out_future.exception() is None
        slot = table[read.replaces].slot
        if table.readers(pool.index)[slot] > 0:
            return False
        r = table[key]
        if r.slot is not None:  # cached in a staging slot (or still loading into one): give it up
            if (pool.index, r.slot) in mgr.slots.read_ahead_pending():
                mgr.slots._land((pool.index, r.slot))
            if table.readers(pool.index)[r.slot] > 0 or table.reserved(pool.index, r.slot):
                return False
            mgr.slots.drop(pool, r.slot)
            r = table[key]
        freed = r.host_offset
        fork = mgr.streams.event()
        fork.record(mgr.streams.current())  # kernels queued so far may still read the outgoing expert
        mgr.staging.copy_stream.wait_event(fork)
        table.swap_hot(key, pool.index, slot)
        if out_ok:  # its cpu blob is in place already: it is served from the host pool from now on
            table.warm(read.replaces, read.spare)
        else:
            self.counts["read_errors"] += 1
            spares.append(read.spare)
        gp = mgr.cfg.gpu.precision
        src = self.buffers[read.buffer][: mgr.manifest.ref(key, gp).nbytes]
        with mgr.staging.batch():
            mgr.staging.write(key, pool, slot, gp, "rebalance", src)
        self.buffer_busy[read.buffer] = table.ready_event(pool.index, slot)  # the buffer is read until the write is done
        if freed is not None:
            if out_ok:  # the demoted expert takes the place the promoted one left
                self._relocate(read.replaces, read.spare, freed)
            else:
                spares.append(freed)
        elif out_ok:  # the warm set grew by one: cool its least used expert to keep the cpu budget
            warm = _least(self.window.frequency(), table.warm_mask & self._pool_mask[pool.index] & ~self._busy(), 1)
            if warm:
                coldest = self.grid.key(warm[0])
                spares.append(table[coldest].host_offset)
                table.cool(coldest)
        self.counts["promoted_hot"] += 1
        return True

    def routing_counts(self) -> tuple[dict[int, list[int]], int]:
        """Lookups per expert over the window so far (direct decode's device counts taken in), per
        layer the rebalancer counts (static layers are not counted), and the tokens they span."""
        self._count_direct()
        freq, g = self.window.frequency(), self.grid
        layers = [L for L in g.layers if self.movable(L)]
        counts = {L: freq[g.row[L] * g.width : g.row[L] * g.width + g.experts[L]].tolist() for L in layers}
        return counts, sum(self.window.spans)

    def report(self) -> dict[str, int]:
        return dict(self.counts) | {"in_flight": len(self.hot_reads) + len(self.warm_reads)}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None  # what landing still queues (a relocation) runs here
        self.land(wait=True)
