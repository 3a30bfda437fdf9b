"""The tier manager: one engine that serves experts to the experts forward from three tiers.

Owns: the residency table, the GPU slot pools, the pinned host pool, the disk store and the
staging path between them, plus the stream and event discipline:

- a miss claims a staging slot (the cache policy's victim among slots nobody holds), the copy
  stream waits on that slot's last-read event, and the expert's blob goes host -> device in one
  copy on the copy stream (from the pinned pool, or from disk through a pinned ring buffer):
  straight into the slot when lossless, else into the slot's transit row, which a dequant
  stream turns into the slot's weights while the copy stream moves on to the next blob; the
  ready event is recorded after the last of these;
- the compute stream waits on the ready event only right before the expert's first kernel;
- after the expert's kernels are queued the slot's last-read event is recorded on the compute
  stream, and the slot may be reused only after that.

Streams and events come from ``torch.get_device_module(device)`` (``torch.cpu`` supplies working
stubs), through an injectable ``Streams`` object, so CPU tests exercise the same code.
"""
from __future__ import annotations

import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

import quant
from loader.blob import BLOB_ALIGN, align
from loader.layout import ExpertKey
from loader.packed import Manifest
from tiers.config import TiersConfig
from tiers.disk_store import DiskStore
from tiers.host_pool import HostPool, assert_pinned
from tiers.cache import LruSlots, make_cache
from tiers.policy import Placement
from tiers.prefetch import Prefetcher
from tiers.rebalance import Rebalancer
from tiers.residency import Home, Op, Residency, ResidencyTable
from tiers.slots import SlotPool
from tiers.stats import StatsCollector, TierStats


class Streams:
    """Streams and events of one device; tests pass a recording fake with the same methods."""

    def __init__(self, device: torch.device):
        self.device = device
        self.module = torch.get_device_module(device)

    def new_stream(self) -> Any:
        return self.module.Stream(device=self.device) if self.device.type == "cuda" else self.module.Stream()

    def current(self) -> Any:
        return self.module.current_stream(self.device) if self.device.type == "cuda" else self.module.current_stream()

    def event(self, timing: bool = False) -> Any:
        return self.module.Event(enable_timing=timing) if self.device.type == "cuda" else self.module.Event()

    def use(self, stream: Any):
        return self.module.stream(stream)


@dataclass(frozen=True)
class Handle:
    """A held slot: the expert's weights, valid until released."""

    key: ExpertKey
    pool: SlotPool
    slot: int

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return self.pool.tensors(self.slot)


class TierManager(Prefetcher):
    MAPS = 16  # pinned index buffers in the ring (slot maps, host-routed decode indices)
    LOAD_THREADS = 8  # reader threads at load time (pread and the first read's CRC32 release the GIL)
    HOST_ROUTED_ROWS = 64  # a layer call with at most this many (token, pick) rows brings its picks to the host
    def __init__(
        self,
        manifest: Manifest,
        cfg: TiersConfig,
        placement: Placement,
        *,
        device: torch.device,
        streams: Streams | None = None,
        clock: Callable[[], float] = time.perf_counter,
        verify: str = "first",
        progress: bool = True,
    ):
        self.manifest, self.cfg, self.placement = manifest, cfg, placement
        self.device = device
        self.dtype = torch.bfloat16
        self.streams = streams or Streams(device)
        self.clock = clock
        self.timing = device.type == "cuda"
        self.copy_stream = self.streams.new_stream()
        lossy = not all(quant.get_scheme(p).lossless for p in (cfg.cpu.precision, cfg.nvme.precision))
        self.dequant_stream = self.streams.new_stream() if lossy else self.copy_stream
        self.transit_done: dict[tuple[int, int], Any] = {}  # transit row -> its last dequantization's end
        self._view_cache: dict[tuple, dict] = {}  # (blob layout, address, device) -> field views
        self.stats_ = StatsCollector()
        # generate's decode stage (see integration.load): True while it runs, when this device
        # follows transformers' switch from grouped_mm to batched_mm for decode (not on the CPU)
        self.decoding = False
        self.batched_decode = device.type != "cpu"
        self.recorded: list[ExpertKey] | None = None  # set to a list to record every lookup (a routing trace)
        self.prefetched: dict[ExpertKey, int] = {}  # staged ahead and not yet used -> bytes
        self.demand_reads: set[ExpertKey] = set()  # cold misses of the current call read in parallel, not yet looked up
        # Prefetched cold experts are read on reader threads; their slot is held until the read lands.
        rebalancing = cfg.rebalance.every_tokens > 0 and len(placement.hot) < len(manifest.keys)
        if rebalancing:
            for key, p in (("tiers.gpu.precision", cfg.gpu.precision), ("tiers.cpu.precision", cfg.cpu.precision), ("tiers.nvme.precision", cfg.nvme.precision)):
                if p not in manifest.precisions:
                    raise ValueError(f"tiers.rebalance: moving experts between tiers needs {key} {p!r} packed in {str(manifest.root)!r} "
                                     f"(packed: {list(manifest.precisions)}); re-pack, or set tiers.rebalance.every_tokens: 0")
        self.reader_threads = (
            ThreadPoolExecutor(cfg.nvme.reader_threads, thread_name_prefix="tiers-read")
            if (placement.cold or rebalancing) and cfg.nvme.reader_threads else None
        )
        self.pending: dict[tuple[int, int], tuple[Future, ExpertKey, str, torch.Tensor, SlotPool]] = {}
        self.predicted: dict[int, set[int]] = {}  # layer -> experts predicted for its next call

        # -- GPU: one slot pool per expert signature; hot slots first, staging slots after.
        self.pool_of: dict[int, SlotPool] = {}
        self.cache: dict[int, LruSlots] = {}  # per pool: the staging-slot policy (LRU or LFU)
        self.transit: dict[int, torch.Tensor] = {}
        self.hot_count: dict[int, int] = {}
        self.keys_of: dict[int, list[ExpertKey]] = {}  # per pool: the experts it serves
        self.pools: list[SlotPool] = []
        for g in placement.groups:
            layout = manifest.layers[g.layers[0]].layout
            pool = SlotPool(layout, g.n_slots, device=device, dtype=self.dtype, event_factory=self.streams.event)
            self.pools.append(pool)
            self.cache[id(pool)] = make_cache(cfg.gpu.cache, range(g.hot, g.n_slots), decay=cfg.gpu.lfu_decay, layers=g.layers)
            self.hot_count[id(pool)] = g.hot
            self.transit[id(pool)] = torch.empty((g.staging, g.transit_bytes), dtype=torch.uint8, device=device)
            for L in g.layers:
                self.pool_of[L] = pool
            self.keys_of[id(pool)] = [k for k in manifest.keys if k.layer in g.layers]

        # -- Host: the warm pool, one pinned ring buffer per staging slot for disk reads (rebalancing
        # may send any expert to disk), and the rebalancer's promotion buffers.
        warm_bytes = sum(manifest.blob(k, cfg.cpu.precision).stride for k in placement.warm)
        self.ring_bytes: dict[int, int] = {}
        if placement.cold or rebalancing:
            for g in placement.groups:
                pool = self.pool_of[g.layers[0]]
                self.ring_bytes[id(pool)] = max(manifest.layers[L].blobs[cfg.nvme.precision].stride for L in g.layers)
        ring_total = sum(self.ring_bytes[id(p)] * (p.n_slots - self.hot_count[id(p)]) for p in self.pools if id(p) in self.ring_bytes)
        promote_bytes = Rebalancer.buffer_bytes(manifest, cfg, placement) if rebalancing else 0
        # int64 entries per ring buffer: a slot map [E+1], or a host-routed call's int32 indices
        # (4 per row, plus an offset per slot of its pool)
        map_len = max(max(e.layout.num_experts for e in manifest.layers.values()) + 1,
                      (4 * self.HOST_ROUTED_ROWS + max(g.n_slots for g in placement.groups) + 1) // 2 + 1)
        self.host = HostPool(warm_bytes + ring_total + promote_bytes + self.MAPS * align(map_len * 8, BLOB_ALIGN), pin=device.type == "cuda")
        self.warm_bytes = warm_bytes
        # Pinned expert -> slot maps for the grouped forward, used round robin: a non_blocking copy
        # from pageable memory would make the host wait for the compute stream to drain first.
        self.maps = [self.host.view(self.host.alloc(map_len * 8), map_len * 8).view(torch.int64) for _ in range(self.MAPS)]
        self.map_copied: list[Any | None] = [None] * self.MAPS
        self.next_map = 0
        self.ring: dict[tuple[int, int], torch.Tensor] = {}
        self.ring_busy: dict[tuple[int, int], Any] = {}
        for p in self.pools:
            if id(p) in self.ring_bytes:
                for s in range(self.hot_count[id(p)], p.n_slots):
                    off = self.host.alloc(self.ring_bytes[id(p)])
                    self.ring[(id(p), s)] = self.host.view(off, self.ring_bytes[id(p)])

        needed = {cfg.gpu.precision} if placement.hot else set()
        needed |= {cfg.cpu.precision} if placement.warm else set()
        needed |= {cfg.nvme.precision} if placement.cold else set()
        if rebalancing:  # any expert may move to any tier
            needed |= {cfg.gpu.precision, cfg.cpu.precision, cfg.nvme.precision}
        # one chunk thread: the CRC of a first read overlaps the rest of it (tools/coldread.py measured more threads slower)
        self.disk = DiskStore(manifest, sorted(needed), verify=verify, read_threads=1)

        # The initial table: every expert's home, and each warm expert's place in the host pool.
        initial = {k: Residency(home=Home.GPU) for k in placement.hot}
        initial |= {k: Residency(home=Home.CPU, host_offset=self.host.alloc(manifest.ref(k, cfg.cpu.precision).nbytes)) for k in placement.warm}
        initial |= {k: Residency(home=Home.NVME) for k in placement.cold}
        self.table = ResidencyTable(initial)
        self._load(progress)
        # Layers whose every expert is hot need no routing on the host: a fixed expert -> slot map
        # on the device (sentinel: one past the last slot) lets them run without a sync.
        self.static_maps: dict[int, torch.Tensor] = {}
        self.static_views: dict[int, dict[str, torch.Tensor]] = {}  # ... and when its slots are in a row, that row of the slabs
        for L, entry in manifest.layers.items():
            keys = [ExpertKey(L, e) for e in range(entry.layout.num_experts)]
            if all(self.table[k].pinned for k in keys):
                pool = self.pool_of[L]
                slots = [self.table[k].slot for k in keys]
                self.static_maps[L] = torch.tensor(slots + [pool.n_slots], dtype=torch.long, device=device)
                if slots == list(range(slots[0], slots[0] + len(slots))):
                    # expert e is slab row slots[0] + e: the layer runs on views with its own expert
                    # ids, exactly as the untiered module (no id map, grouped_mm over its own experts)
                    self.static_views[L] = {n: slab[slots[0] : slots[0] + len(slots)] for n, slab in pool.slabs.items()}
        self._static_hits = torch.zeros((), dtype=torch.long, device=device)  # lookups on static layers, counted on the device
        self._static_host_hits = 0  # ... and those of one-token calls, counted on the host
        self.first_layer = min((L for L in manifest.layers if L not in self.static_maps), default=None)
        self.rebalancer = (
            Rebalancer(self, cfg.rebalance, threads=min(2, cfg.nvme.reader_threads)) if rebalancing else None
        )

    # -- load time -----------------------------------------------------------------------
    def _load(self, progress: bool) -> None:
        """Read every hot expert into its slot and every warm one into its place in the pinned pool.
        Reads (and their first-read checksums) run on ``LOAD_THREADS`` threads; hot experts are read
        ahead into a few scratch buffers while this thread copies the previous ones up, in order."""
        bar = tqdm(total=len(self.placement.hot) + len(self.placement.warm), desc="loading experts", unit="expert", disable=not progress)
        next_hot: dict[int, int] = {id(p): 0 for p in self.pools}
        gp, cp = self.cfg.gpu.precision, self.cfg.cpu.precision
        hot = list(self.placement.hot)
        threads = max(1, min(self.LOAD_THREADS, os.cpu_count() or 1))
        with ThreadPoolExecutor(threads, thread_name_prefix="tiers-load") as pool_:
            if hot:
                ahead = min(4, threads, len(hot))  # scratch buffers in flight: bounded host memory
                size = max(self.manifest.ref(k, gp).nbytes for k in hot)
                scratch = [torch.empty(size, dtype=torch.uint8) for _ in range(ahead)]
                reads = {i: pool_.submit(self.disk.read, hot[i], gp, scratch[i]) for i in range(ahead)}
                for i, key in enumerate(hot):
                    reads.pop(i).result()
                    pool = self.pool_of[key.layer]
                    slot = next_hot[id(pool)]
                    next_hot[id(pool)] += 1
                    nbytes = self.manifest.ref(key, gp).nbytes
                    buf = scratch[i % ahead][:nbytes]
                    src = buf if quant.get_scheme(gp).lossless else buf.to(self.device)
                    pool.owner[slot] = key
                    # a copy from pageable memory returns once the bytes are taken: the buffer is free again
                    self.manifest.blob(key, gp).dequantize_into(src, pool.tensors(slot))
                    self.table.apply(key, Op.PLACE_HOT, slot)
                    if i + ahead < len(hot):
                        reads[i + ahead] = pool_.submit(self.disk.read, hot[i + ahead], gp, scratch[i % ahead])
                    bar.update(1)
            warm = [pool_.submit(self.disk.read, key, cp, self.host.view(self.table[key].host_offset, self.manifest.ref(key, cp).nbytes))
                    for key in self.placement.warm]
            for f in warm:
                f.result()
                bar.update(1)
        bar.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- serving -------------------------------------------------------------------------
    def begin_call(self, layer: int, experts: list[int], tokens: int) -> None:
        """A layer call with ``tokens`` tokens routed to ``experts`` begins: tell the cache policy
        (it forecasts by layer order) and the rebalancer (it counts routing per rolling window)."""
        keys = [ExpertKey(layer, e) for e in experts]
        self.cache[id(self.pool_of[layer])].visit(layer, keys)
        if self.rebalancer is not None:
            self.rebalancer.note_call(layer, keys, tokens, first=layer == self.first_layer)

    def drop_staged(self, pool: SlotPool, slot: int) -> None:
        """Empty an unheld staging slot (its expert leaves the GPU); the cache offers it first."""
        assert pool.readers[slot] == 0, f"slot {slot} is emptied while held"
        self._evict_owner(pool, slot)
        pool.owner[slot] = None
        self.cache[id(pool)].forget(slot)

    def try_acquire(self, key: ExpertKey) -> Handle | None:
        """Hold ``key`` in a GPU slot, staging it if needed. None if every staging slot is held."""
        r = self.table[key]
        pool = self.pool_of[key.layer]
        lru = self.cache[id(pool)]
        demand = key in self.demand_reads
        if demand:
            self.demand_reads.discard(key)
        if self.recorded is not None:
            self.recorded.append(key)
        if not r.pinned:
            lru.access(key)
        if r.slot is not None and (id(pool), r.slot) in self.pending:
            self._complete((id(pool), r.slot))  # its disk read is in flight: land it first
            r = self.table[key]
        if r.slot is not None:  # resident; or read ahead for this very call, a miss served by its home tier
            self.stats_.lookup(r.home.value if demand else "gpu")
            if self.prefetched.pop(key, None) is not None:
                self.stats_.prefetch_used += 1
            if not r.pinned:
                lru.touch(r.slot)
            pool.hold(r.slot)
            return Handle(key, pool, r.slot)
        slot = self._claim_and_stage(key, r, pool, lru)
        if slot is None:
            return None
        self.stats_.lookup(r.home.value)
        pool.hold(slot)
        return Handle(key, pool, slot)

    def _claim_and_stage(self, key: ExpertKey, r: Residency, pool: SlotPool, lru: LruSlots) -> int | None:
        """Take the policy's victim among unheld staging slots and stage ``key`` into it. A demand
        miss that finds every slot held waits for this pool's read-aheads to land first."""
        slot = lru.victim(pool.readers)
        while slot is None:
            mine = [k for k in self.pending if k[0] == id(pool)]
            if not mine:
                return None
            self._complete(mine[0])
            slot = lru.victim(pool.readers)
        # Everything that can fail (a disk read, a checksum) happens before any state changes, so
        # an IntegrityError leaves the slot, its owner and the residency table as they were.
        precision, source, src = self._fetch(key, r, pool, slot)
        self._evict_owner(pool, slot)
        self._stage(key, pool, slot, precision, source, src)
        self.table.apply(key, Op.STAGE, slot)
        lru.assign(slot, key)
        return slot

    def _evict_owner(self, pool: SlotPool, slot: int) -> None:
        """The slot's current expert leaves the GPU (a prefetch never used counts as waste)."""
        old = pool.owner[slot]
        if old is not None:
            self.table.apply(old, Op.EVICT)
            wasted = self.prefetched.pop(old, None)
            if wasted is not None:
                self.stats_.prefetch_wasted_bytes += wasted

    def _ring(self, pool: SlotPool, slot: int, nbytes: int) -> torch.Tensor:
        """The slot's pinned ring buffer, once no earlier copy up reads it any more."""
        busy = self.ring_busy.pop((id(pool), slot), None)
        if busy is not None:
            busy.synchronize()  # the host must not overwrite pinned bytes an earlier H2D may still read
        return self.ring[(id(pool), slot)][:nbytes]

    def _precision_of(self, r: Residency) -> str:
        return self.cfg.cpu.precision if r.home is Home.CPU else self.cfg.nvme.precision

    def _fetch(self, key: ExpertKey, r: Residency, pool: SlotPool, slot: int) -> tuple[str, str, torch.Tensor]:
        """The pinned host bytes of ``key``'s blob: a view into the pool, or a disk read into the slot's ring buffer."""
        precision = self._precision_of(r)
        nbytes = self.manifest.ref(key, precision).nbytes
        if r.home is Home.CPU:
            return precision, "cpu", self.host.view(r.host_offset, nbytes)
        src = self._ring(pool, slot, nbytes)
        self.disk.read(key, precision, src)
        return precision, "nvme", src

    def _stage(self, key: ExpertKey, pool: SlotPool, slot: int, precision: str, source: str, src: torch.Tensor) -> Any:
        """Queue ``src`` (pinned) -> slot on the copy stream; returns the slot's ready event.
        ``source`` names the bytes in the stats: cpu, nvme, or rebalance (a hot promotion)."""
        blob = self.manifest.blob(key, precision)
        lossless = quant.get_scheme(precision).lossless
        pool.begin_write(slot, key, self.copy_stream)
        t0 = self.clock()
        start = None
        with self.streams.use(self.copy_stream):
            if self.timing:
                start = self.streams.event(timing=True)
                start.record(self.copy_stream)
            if lossless:
                self._check_pinned(src)
                blob.dequantize_views(self._views(blob, src), pool.tensors(slot))  # the H2D copies land straight in the slot
                ready = pool.end_write(slot, self.copy_stream, event=self.streams.event(timing=self.timing))
            else:
                row = (id(pool), slot - self.hot_count[id(pool)])
                transit = self.transit[row[0]][row[1], : src.numel()]
                done = self.transit_done.pop(row, None)
                if done is not None:
                    self.copy_stream.wait_event(done)  # the last dequantization from this row must have read it
                self._check_pinned(src)
                transit.copy_(src, non_blocking=True)
                landed = self.streams.event()
                landed.record(self.copy_stream)
        if not lossless:
            # Dequantize on a stream of its own, so the next expert's copy up overlaps this one's
            # dequantization; ordered after the copy (and so after the slot's last read).
            with self.streams.use(self.dequant_stream):
                self.dequant_stream.wait_event(landed)
                blob.dequantize_views(self._views(blob, transit), pool.tensors(slot))
            ready = pool.end_write(slot, self.dequant_stream, event=self.streams.event(timing=self.timing))
            self.transit_done[row] = ready
        if source == "nvme":
            self.ring_busy[(id(pool), slot)] = ready
        self.stats_.bytes_moved[source] = self.stats_.bytes_moved.get(source, 0) + src.numel()
        if self.timing:
            self.stats_.timed("stage", start, ready)
        else:
            self.stats_.stage_seconds += self.clock() - t0
        return ready

    def slot_map(self, layer: int, experts: list[int], slots: list[int]) -> torch.Tensor:
        """An int64 [num_experts + 1] map expert -> slot on the device (unlisted experts and the
        sentinel id ``num_experts`` -> ``n_slots``), copied without a host sync."""
        pool = self.pool_of[layer]
        n = self.manifest.layers[layer].layout.num_experts
        host, i = self._ring_buffer()
        host = host[: n + 1]
        host.fill_(pool.n_slots)
        host[experts] = torch.tensor(slots, dtype=torch.int64)
        return self._upload(host, i)

    def upload_ints(self, values: list[int]) -> torch.Tensor:
        """``values`` as an int32 tensor on the device, through the pinned ring (no host sync)."""
        host, i = self._ring_buffer()
        host = host.view(torch.int32)[: len(values)]
        host.copy_(torch.tensor(values, dtype=torch.int32))
        return self._upload(host, i)

    def _ring_buffer(self) -> tuple[torch.Tensor, int]:
        """The next pinned buffer of the ring, once the copy that last read it has run."""
        i = self.next_map
        self.next_map = (i + 1) % self.MAPS
        if self.map_copied[i] is not None:
            self.map_copied[i].synchronize()  # the copy that last read this buffer (16 calls ago: long done)
        return self.maps[i], i

    def _upload(self, host: torch.Tensor, i: int) -> torch.Tensor:
        if self.device.type != "cuda":
            return host.clone()  # no copy to make: the caller must not alias the ring
        dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        self._check_pinned(host)
        dev.copy_(host, non_blocking=True)
        done = self.streams.event()
        done.record(self.streams.current())
        self.map_copied[i] = done
        return dev

    def _check_pinned(self, src: torch.Tensor) -> None:
        """Every H2D source is a view of the host pool: pinned when the pool is, checked per copy otherwise."""
        if not self.host.pinned:
            assert_pinned(src, self.device)

    def _views(self, blob: Any, buf: torch.Tensor) -> dict:
        """``blob.views(buf)``, made once per (blob layout, address): transit rows, ring buffers and
        warm places are fixed buffers, and a view depends only on the layout and the address."""
        key = (id(blob), buf.data_ptr(), buf.device)
        views = self._view_cache.get(key)
        if views is None:
            views = self._view_cache[key] = blob.views(buf)
        return views

    def wait(self, h: Handle) -> None:
        """Make the compute stream wait for ``h``'s copy; call right before its first kernel."""
        self.wait_all([h])

    def wait_all(self, held: list[Handle]) -> None:
        """Make the compute stream wait for every held expert's pending copy, right before the first
        kernel that reads them. Per stream one wait suffices, on the latest of those ready events:
        a stream runs in order, so it also covers the earlier ones."""
        latest: dict[int, tuple[int, Any]] = {}
        for h in held:
            pending = h.pool.take_ready(h.slot)
            if pending is None:
                continue
            ev, stream, order = pending
            if id(stream) not in latest or order > latest[id(stream)][0]:
                latest[id(stream)] = (order, ev)
            self.table.apply(h.key, Op.READY)
        if not latest:
            return
        compute = self.streams.current()
        e0 = None
        if self.timing:
            e0 = self.streams.event(timing=True)
            e0.record(compute)
        for _, ev in latest.values():
            compute.wait_event(ev)
        if e0 is not None:
            e1 = self.streams.event(timing=True)
            e1.record(compute)
            self.stats_.timed("stall", e0, e1)

    def release(self, h: Handle) -> None:
        """The expert's kernels are queued: record the last-read event; the slot may be reused after it.
        Hot slots are never rewritten, so they need no event."""
        self.release_all([h])

    def release_all(self, held: list[Handle]) -> None:
        """``release`` for experts whose kernels were queued together: one last-read event for all."""
        ev = None
        for h in held:
            if self.table[h.key].pinned:
                h.pool.end_read_at(h.slot, None)
                continue
            if ev is None:
                ev = self.streams.event()
                ev.record(self.streams.current())
            h.pool.end_read_at(h.slot, ev)

    def count_static(self, layer: int, top_k_index: torch.Tensor) -> None:
        """Count a static layer's distinct experts as gpu hits without a sync: for one token on the
        host (a router's top-k picks are distinct), for more on the device."""
        if top_k_index.shape[0] == 1:  # decode: no kernel launches on the host-bound path
            self._static_host_hits += top_k_index.shape[-1]
            return
        n = self.manifest.layers[layer].layout.num_experts
        used = torch.zeros(n + 1, dtype=torch.long, device=top_k_index.device)
        used.index_fill_(0, top_k_index.reshape(-1), 1)
        self._static_hits += used[:n].sum()

    def acquire_layer(self, layer: int, experts: list[int]) -> list[Handle] | None:
        """Hold all of ``experts`` at once (staging the misses), or None (holding nothing) if the
        misses outnumber the staging slots free now. Two or more cold misses are first read in
        parallel on the reader threads; each one's copy is queued when its turn comes."""
        self.pump()
        self._read_cold_ahead(layer, experts)
        held: list[Handle] = []
        try:
            for e in experts:
                h = self.try_acquire(ExpertKey(layer, e))
                if h is None:
                    self.release_all(held)
                    return None
                held.append(h)
        except BaseException:  # a failed read (IntegrityError) must not leave slots held
            self.release_all(held)
            raise
        return held

    def unheld_staging(self, pool: SlotPool) -> int:
        """Staging slots of ``pool`` that nobody holds now."""
        return sum(1 for s in range(self.hot_count[id(pool)], pool.n_slots) if pool.readers[s] == 0)

    def _read_cold_ahead(self, layer: int, experts: list[int]) -> None:
        """Start the disk reads of a call's cold misses together, when there are two or more and
        the unheld staging slots hold every expert of the call that is not hot (so a read-ahead
        never takes a slot the call itself needs). One blob at a time on the compute thread
        leaves the disk idle between reads: small blobs read faster several at once."""
        if self.reader_threads is None:
            return
        rows = [self.table[ExpertKey(layer, e)] for e in experts]
        cold = [e for e, r in zip(experts, rows) if r.slot is None and r.home is Home.NVME]
        if len(cold) < 2:
            return
        pool = self.pool_of[layer]
        if sum(not r.pinned for r in rows) > self.unheld_staging(pool):
            return
        lru = self.cache[id(pool)]
        for e in cold:
            key = ExpertKey(layer, e)
            if not self._read_ahead(key, pool, lru):
                return
            self.demand_reads.add(key)

    def serve_layer(self, layer: int, experts: list[int]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Yield ``(expert, weights)`` in the given order, staging ahead into free slots.

        While the caller computes one expert, the copies of the next misses (up to the number of
        staging slots) are already queued on the copy stream.
        """
        self.pump()
        pending = deque(experts)
        ready: deque[tuple[int, Handle]] = deque()
        current: Handle | None = None
        try:
            while pending or ready:
                while pending:
                    h = self.try_acquire(ExpertKey(layer, pending[0]))
                    if h is None:
                        break
                    ready.append((pending.popleft(), h))
                if not ready:
                    raise RuntimeError(f"layer {layer}: no GPU staging slot is free for expert {pending[0]}")
                e, current = ready.popleft()
                self.wait(current)
                yield e, current.tensors
                self.release(current)
                current = None
        finally:
            # The caller stopped early (an exception, or a break): give back every slot still held,
            # or those slots could never be reused.
            for h in ([current] if current is not None else []) + [h for _, h in ready]:
                self.release(h)

    # -- reporting -------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Start counting afresh: the collector's counters and the static layers' hits."""
        self.stats_.reset()
        self._static_hits.zero_()
        self._static_host_hits = 0

    def stats(self) -> TierStats:
        self.stats_.resolve()
        static = int(self._static_hits.item()) + self._static_host_hits
        m, cfg = self.manifest, self.cfg
        residency = {h.value: {"experts": 0, "bytes": 0} for h in Home}
        for k, r in self.table.items():  # where each expert lives now (the rebalancer moves them)
            size = m.layers[k.layer].layout.nbytes() if r.home is Home.GPU else m.blob(k, self._precision_of(r)).stride
            residency[r.home.value]["experts"] += 1
            residency[r.home.value]["bytes"] += size
        hot = sum(self.hot_count.values())
        staging = sum(p.n_slots for p in self.pools) - hot
        cached = sum(1 for p in self.pools for s in range(self.hot_count[id(p)], p.n_slots) if p.owner[s] is not None)
        memory = {
            "gpu_bytes": sum(p.nbytes for p in self.pools) + sum(t.numel() for t in self.transit.values()),
            "gpu_budget": self.placement.gpu_budget,
            "host_bytes": self.host.capacity,
            "host_pinned": int(self.host.pinned),
            "host_pool_bytes": self.warm_bytes,
            "host_ring_bytes": self.host.capacity - self.warm_bytes,
            "cpu_budget": self.placement.cpu_budget,
        }
        return TierStats(
            residency=residency,
            hits=self.stats_.hits | {"gpu": self.stats_.hits["gpu"] + static},
            misses=dict(self.stats_.misses),
            bytes_moved=dict(self.stats_.bytes_moved),
            stage_seconds=self.stats_.stage_seconds,
            stall_seconds=self.stats_.stall_seconds,
            gpu_slots={"hot": hot, "staging": staging, "cached": cached},
            prefetch=self.stats_.prefetch_report(),
            memory=memory,
            device=str(self.device),
            rebalance=self.rebalancer.report() if self.rebalancer is not None else {},
        )

    def close(self) -> None:
        if self.rebalancer is not None:
            self.rebalancer.close()
        if self.reader_threads is not None:
            self.reader_threads.shutdown(wait=True)
            self.drain()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.host.close()
        self.disk.close()
