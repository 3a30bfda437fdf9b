"""The tier manager: one engine that serves experts to the experts forward from three tiers.

Owns: the residency table, the GPU slot pools, the pinned host pool, the disk store and the
staging path between them, plus the stream and event discipline:

- a miss claims a staging slot (the cache policy's victim among slots nobody holds), the copy
  stream waits on that slot's last-read event, and the expert's blob goes host -> device in one
  copy on the copy stream (from the pinned pool, or from disk through a pinned ring buffer):
  straight into the slot when lossless, else into the next row of a ring of transit rows, which
  a dequant stream turns into the slot's weights while the copy stream moves on to the next
  blob; the ready event is recorded after the last of these;
- the misses of one layer call form a staging batch (``staging``): each copy is queued as soon
  as its miss is claimed, but small lossy experts are dequantized a stack at a time (up to
  ``STACK_EXPERTS`` after one wait, sharing one ready event; one launch per tensor when their
  slots are in a row), so the host's work per miss is little more than its copy and bookkeeping;
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
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from tiers import quant
from tiers.loader.blob import BLOB_ALIGN, align
from tiers.loader.layout import ExpertKey
from tiers.loader.packed import Manifest
from tiers.config import TiersConfig
from tiers.direct import DirectDecoder
from tiers.graphs import DecodeGraphs
from tiers.streamed import StreamedCalls
from tiers.disk_store import DiskStore
from tiers.host_pool import HostPool, assert_pinned
from tiers.h2d import copy_batch
from tiers.host_compute import COPY_BYTES_PER_S, HostCompute
from tiers.cache import LruSlots, make_cache
from tiers import policy
from tiers.policy import Placement
from tiers.prefetch import Prefetcher
from tiers.rebalance import Rebalancer
from tiers.residency import Home, Op, Residency, ResidencyTable
from tiers.slots import SlotPool
from tiers.stats import StatsCollector, TierStats


class Streams:
    """Streams and events of one device; tests pass a recording fake with the same methods.

    On CUDA, ``current`` and ``use`` run on every staged expert, so they skip what
    ``torch.cuda.current_stream`` and ``torch.cuda.stream`` do on each call (resolve the device,
    build a new ``Stream`` object inside a device guard): the current stream is looked up by id
    among the streams seen before, and ``use`` sets and restores it with ``torch.cuda.set_stream``."""

    def __init__(self, device: torch.device):
        self.device = device
        self.module = torch.get_device_module(device)
        self.cuda = device.type == "cuda"
        self.index = device.index if device.index is not None else (torch.cuda.current_device() if self.cuda else 0)
        self._seen: dict[int, Any] = {}  # stream id -> its Stream object

    def new_stream(self) -> Any:
        return self.module.Stream(device=self.device) if self.cuda else self.module.Stream()

    def current(self) -> Any:
        if not self.cuda:
            return self.module.current_stream()
        sid = torch._C._cuda_getCurrentStream(self.index)[0]
        stream = self._seen.get(sid)
        if stream is None:
            stream = self._seen[sid] = self.module.current_stream(self.device)
        return stream

    def event(self, timing: bool = False, blocking: bool = False) -> Any:
        """A new event; ``blocking``: a thread that waits for it sleeps until it fires (CUDA's
        blocking sync) rather than spinning a core, for waits off the serving thread."""
        return self.module.Event(enable_timing=timing, blocking=blocking) if self.cuda else self.module.Event()

    def use(self, stream: Any):
        if self.cuda and torch.cuda.current_device() == self.index:
            return _Use(self, stream)
        return self.module.stream(stream)  # the CPU, or another device current: the general context


class _Use:
    """``with streams.use(s)``: ``s`` is the current stream inside, the previous one after."""

    __slots__ = ("streams", "stream", "prev")

    def __init__(self, streams: Streams, stream: Any):
        self.streams, self.stream = streams, stream

    def __enter__(self) -> None:
        self.prev = self.streams.current()
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc) -> None:
        torch.cuda.set_stream(self.prev)


@dataclass(frozen=True)
class Handle:
    """A held slot: the expert's weights, valid until released."""

    key: ExpertKey
    pool: SlotPool
    slot: int

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return self.pool.tensors(self.slot)


@dataclass
class _Stack:
    """Lossy copies into consecutive transit rows of one pool, to be dequantized together; or
    (``starts`` set) small experts the GPU reads straight from the host pool, in one launch."""

    pool: SlotPool
    blob: Any
    precision: str
    row: int  # the first transit row (-1 for a direct stack)
    slots: list[int]
    starts: list[int] | None = None  # a direct stack: each expert's offset in the host pool


@dataclass
class _Batch:
    """Writes staged since a batch opened (see ``TierManager.staging``)."""

    start: Any = None  # timing event recorded before the first copy
    staged: set = field(default_factory=set)  # (pool id, slot) written in this batch
    waited: list = field(default_factory=list)  # events the copy stream already waits on
    copied: dict = field(default_factory=dict)  # pool id -> (pool, slots written by the copy stream alone)
    groups: dict[int, _Stack] = field(default_factory=dict)  # pool id -> its open stack
    rings: list = field(default_factory=list)  # (pool id, slot) whose ring buffer a copy reads
    last: Any = None  # the latest ready event issued


class TierManager(Prefetcher, DirectDecoder, StreamedCalls):
    MAPS = 16  # pinned index buffers in the ring (slot maps, host-routed decode indices)
    LOAD_THREADS = 8  # reader threads at load time (pread and the first read's CRC32 release the GIL)
    HOST_ROUTED_ROWS = 64  # a layer call with at most this many (token, pick) rows brings its picks to the host
    # A stack: lossy copies of small experts (transfer form at most STACK_BYTES) whose
    # dequantizations wait on one landed event and share one ready event, at most STACK_EXPERTS of
    # them. A stack is dequantized once its last copy has landed, so a short one keeps the copy
    # engine ahead: the stacks before the last overlap later copies. Larger experts stack alone,
    # their dequantization overlapping the next copy (their copies outlast the host's work), and
    # go up one tensor at a time, each dequantized once its own copy has landed, so only the last
    # tensor's dequantization follows a layer call's last copy (Mixtral-8x7B INT8: the down
    # projection, 0.25 of the 0.75 ms an expert takes to dequantize on an H200).
    STACK_EXPERTS = 4
    STACK_BYTES = policy.STACK_BYTES  # the placement sizes the transit rows by the same bound
    STACK_VIEWS = 4096  # stacks' views kept at most (keyed by first row, first slot and length)
    # A layer call's cold misses are read together on the reader threads when their blobs are at
    # most this large. On the H200's disk (tools/coldread.py in bench/results/*-run6.md), 4.5 MiB
    # blobs read at 1.57 GB/s four at a time against 1.22 one at a time, while 168 MiB blobs, read
    # in 8 MiB requests either way, read at 1.70 one at a time and 1.48 together.
    PARALLEL_READ_BYTES = 32 << 20
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
        self.next_row: dict[int, int] = {}  # per pool: the transit row the next lossy copy goes to (a ring)
        self.stack_limit: dict[int, int] = {}  # per pool: experts one stacked dequantization may take
        self._batch: _Batch | None = None  # the open staging batch
        self._warm_views: dict[tuple[int, int], torch.Tensor] = {}  # (host offset, bytes) -> that view of the pool
        self._transit_views: dict[tuple[int, int, int, int], torch.Tensor] = {}  # (pool id, row, bytes, rows) -> those rows' first bytes
        self._view_cache: dict[tuple, dict] = {}  # (blob layout, address, device, shape) -> prepared field views
        self._stack_view_cache: dict[tuple, tuple[dict, dict]] = {}  # (pool id, blob layout, row, first slot, k) -> a stack's views
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
        self.predicted: dict[int, list[int]] = {}  # layer -> experts predicted for its next call, likeliest first

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
            self.cache[id(pool)] = make_cache(cfg.gpu.cache, range(g.hot, g.n_slots), decay=cfg.gpu.lfu_decay, layers=g.layers,
                                              experts=layout.num_experts)
            self.hot_count[id(pool)] = g.hot
            self.transit[id(pool)] = torch.empty((g.transit_rows, g.transit_bytes), dtype=torch.uint8, device=device)
            self.next_row[id(pool)] = 0
            lossy_bytes = max((manifest.layers[L].blobs[p].nbytes for L in g.layers for p in (cfg.cpu.precision, cfg.nvme.precision)
                               if not quant.get_scheme(p).lossless and p in manifest.layers[L].blobs), default=0)
            # a stack's copies take consecutive rows: only a row per staging slot stacks
            stacks = lossy_bytes <= self.STACK_BYTES and g.transit_rows >= g.staging
            self.stack_limit[id(pool)] = min(g.staging, self.STACK_EXPERTS) if stacks else 1
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
        # ... as int32 too, and numpy views of both: filling one from a list is one call
        self._maps_of = {torch.int64: self.maps, torch.int32: [m.view(torch.int32) for m in self.maps]}
        self._arrays_of = {dt: [m.numpy() for m in ms] for dt, ms in self._maps_of.items()}
        self.map_copied: list[Any | None] = [None] * self.MAPS
        self._map_events = [self.streams.event() for _ in range(self.MAPS)]  # re-recorded: each is synced before reuse
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
        self.disk = DiskStore(manifest, sorted(needed), verify=verify, read_threads=1, direct_io=cfg.nvme.direct_io)

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
        # ... with each call's distinct experts marked in a row of its layer's marks first, summed
        # into _static_hits when the rows run out or the stats are read (``_fold_static``)
        self._static_marks: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._static_row: dict[int, int] = {}
        self.first_layer = min((L for L in manifest.layers if L not in self.static_maps), default=None)
        # a step graph's runner noted this token's first layer call already, then ran the forward
        # eagerly after all: that call must not open the token again (``opens_token``)
        self._token_noted = False
        self.in_step = False  # inside a whole decode step run as one graph (``tiers.step_graph``)
        self.steps: Any = None  # the model's step graphs (``tiers.step_graph.install``), if any
        # after a long forward's call at this layer is queued, its earlier whole-layer calls count
        # (``settle_after``); None: only at the next call that waits, at stats, or once too many wait
        self.settle_layer = max((L for L in manifest.layers if L not in self.static_maps), default=None)
        self.rebalancer = (
            Rebalancer(self, cfg.rebalance, threads=min(2, cfg.nvme.reader_threads)) if rebalancing else None
        )
        self._init_direct(cfg.cpu.direct_reads)
        # tiers.cpu.compute: decode calls route on the host, so that their warm misses can be
        # computed there (direct decode never brings its picks back)
        self.host_compute: HostCompute | None = None  # made at the first call it can take (its hidden size and dtype)
        if cfg.cpu.compute:
            self.direct_decode = False
        # generate's decode stage replays direct and static layers' experts calls as CUDA graphs
        self.graphs = DecodeGraphs(device, cfg.gpu.decode_graphs and device.type == "cuda")
        self.streamed_calls = True  # long calls of warm misses stream part by part (tiers.streamed)
        self.stream_direct = False  # ... through the copy engine, not direct stacks
        self.stream_ahead = False  # ... and then stage the next layer's first warm experts (slower in the H200 prefill A/Bs)
        self.whole_calls = True  # ... and the longest read their whole layer without a sync (tiers.streamed)
        # ... whose plan and per-window kernels replay as CUDA graphs where a call's shapes recur
        self.whole_graphs = DecodeGraphs(device, cfg.gpu.prefill_graphs and device.type == "cuda")
        self.whole_outs: dict[tuple, torch.Tensor] = {}  # their summed outputs' buffers, by shape (the last two)
        self.unsettled: deque = deque()  # whole-layer calls not yet counted, in call order
        self.used_share: dict[int, float] = {}  # per layer: the share of its warm experts its last long call used
        self.last_parts: dict[int, dict[int, int]] = {}  # per pool: slot -> the last part of the last streamed call that used it

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
    def begin_call(self, layer: int, experts: list[int], tokens: int, noted: bool = False) -> None:
        """A layer call with ``tokens`` tokens routed to ``experts`` begins: tell the cache policy
        (it forecasts by layer order) and the rebalancer (it counts routing per rolling window;
        ``noted``: the call was already noted there, by a direct call that fell back)."""
        keys = [ExpertKey(layer, e) for e in experts]
        self.cache[id(self.pool_of[layer])].visit(layer, keys)
        if self.decoding:
            self.note_decode_call(self.pool_of[layer])
        if self.rebalancer is not None:
            self.rebalancer.note_call(layer, keys, tokens, first=not noted and self.opens_token(layer))

    def opens_token(self, layer: int) -> bool:
        """Whether a call at ``layer`` opens its token for the rebalancer (the first pooled layer),
        unless ``begin_step`` opened it already."""
        if layer != self.first_layer:
            return False
        noted, self._token_noted = self._token_noted, False
        return not noted

    def begin_step(self, top_k: int) -> bool:
        """A one-token decode step is about to run as one graph (``tiers.step_graph``), whose
        experts calls do only their device work: do the host's part of every layer's call now (the
        rebalancer's token, landing its swaps; each call's counts). True when every MoE layer's
        call can run inside the graph: its experts all hot (static), or a direct call. Otherwise
        the step runs eagerly, its calls counting themselves, and the token stays opened."""
        self.settle()
        opened = self.rebalancer is not None and self.first_layer is not None
        if opened:
            self.rebalancer.note_call(self.first_layer, [], 1, first=True)
            if self._direct_layers is not None and self._direct_version != self.table.homes_version:
                self._refresh_direct()
        layers = self.manifest.layers
        if not all(L in self.static_maps or self.direct_ok(L, top_k) for L in layers):
            self._token_noted = opened
            return False
        for L in layers:
            if L in self.static_maps:
                self._static_host_hits += top_k  # what ``count_static`` counts for one token
            else:
                self.note_direct_call(L)
        return True

    def reserve_slot(self, pool: SlotPool, slot: int, compute: Any) -> None:
        """Take an unheld staging slot out of the cache for a caller's own writes: its expert
        leaves the GPU, the slot is held, and ``compute`` is ordered after a write still queued
        into it (that write lands before the caller's)."""
        if pool.owner[slot] is not None:
            self.drop_staged(pool, slot)  # before the hold: only an unheld slot is emptied
        pool.hold(slot)
        pool.wait_ready(slot, compute)

    def drop_staged(self, pool: SlotPool, slot: int) -> None:
        """Empty an unheld staging slot (its expert leaves the GPU); the cache offers it first."""
        assert pool.readers[slot] == 0, f"slot {slot} is emptied while held"
        self._evict_owner(pool, slot)
        pool.owner[slot] = None
        self.cache[id(pool)].forget(slot)

    def hold_resident(self, key: ExpertKey) -> Handle:
        """Hold a resident ``key`` (no read in flight) without counting a lookup: for a whole-layer
        call, whose lookups are counted when it is settled."""
        slot = self.table[key].slot
        pool = self.pool_of[key.layer]
        pool.hold(slot)
        return Handle(key, pool, slot)

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

    def _claim_and_stage(self, key: ExpertKey, r: Residency, pool: SlotPool, lru: LruSlots, direct: bool = True) -> int | None:
        """Take the policy's victim among unheld staging slots and stage ``key`` into it. A demand
        miss that finds every slot held waits for this pool's read-aheads to land first.
        ``direct``: as for ``_queue_read``."""
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
        self._stage(key, pool, slot, precision, source, src, direct=direct)
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
            return precision, "cpu", self._warm_view(r.host_offset, nbytes)
        src = self._ring(pool, slot, nbytes)
        self.disk.read(key, precision, src)
        return precision, "nvme", src

    def _warm_view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The host pool's bytes ``[offset, offset + nbytes)`` (a view made once per place)."""
        view = self._warm_views.get((offset, nbytes))
        if view is None:
            view = self._warm_views[(offset, nbytes)] = self.host.view(offset, nbytes)
        return view

    @contextmanager
    def staging(self) -> Iterator[None]:
        """Batch the writes staged inside: each copy is queued at once, but the lossy ones'
        dequantizations run a stack at a time (``STACK_EXPERTS``) and the slots of a stack share
        one ready event, issued when the stack is full or the batch closes. Readers wait on a
        slot only after the batch closed. Nested uses join the outer batch."""
        if self._batch is not None:
            yield
            return
        self._batch = _Batch()
        try:
            yield
        finally:
            batch, self._batch = self._batch, None
            self._close(batch)  # also after an exception: the writes queued so far need their events

    def _stage(self, key: ExpertKey, pool: SlotPool, slot: int, precision: str, source: str, src: torch.Tensor, direct: bool = True) -> Any:
        """Queue ``src`` (pinned) -> slot on the copy stream. ``source`` names the bytes in the stats:
        cpu, nvme, or rebalance (a hot promotion); ``direct``: as for ``_queue_read``. Inside
        ``staging()`` the write joins the batch and None is returned; alone, it is a batch of one
        and its ready event is returned."""
        if self._batch is None:
            with self.staging():
                self._stage(key, pool, slot, precision, source, src, direct=direct)
            return pool.ready[slot]
        b = self._batch
        if (id(pool), slot) in b.staged:  # rewritten within the batch: what is queued for it closes first
            self._close(b)
            b = self._batch = _Batch()
        b.staged.add((id(pool), slot))
        pool.begin_write(slot, key, self.copy_stream, waited=b.waited)
        self._queue_read(b, key, pool, slot, precision, source, src, direct=direct)
        return None

    def _queue_read(self, b: _Batch, key: ExpertKey, pool: SlotPool, slot: int, precision: str, source: str, src: torch.Tensor,
                    direct: bool = True) -> None:
        """Queue the read of ``key``'s blob (``src``, pinned) into ``slot`` within batch ``b``: a
        direct stack's entry (``direct`` and the pool's direct reads allow it), or a copy (and a
        dequantization when lossy). The caller has ordered the copy stream after the slot's last read."""
        t0 = self.clock()
        blob = self.manifest.blob(key, precision)
        if self._reads_direct(pool, blob, direct):
            self._stage_direct(b, pool, slot, blob, src)
        else:
            self._stage_copy(b, pool, slot, blob, quant.get_scheme(precision), src)
        if source == "nvme":
            b.rings.append((id(pool), slot))
        self._count_staged(pool, source, src.numel(), t0)

    def _reads_direct(self, pool: SlotPool, blob: Any, direct: bool) -> bool:
        """Whether a read of ``blob`` into ``pool`` goes through a direct stack: asked for
        (``direct``), the pool's direct reads on, and the blob a small one (``STACK_BYTES``) that
        ``quant.direct`` decodes."""
        return direct and self.direct_reads and blob.nbytes <= self.STACK_BYTES and self.direct_tensors(pool, blob) is not None

    def _count_read(self, source: str, nbytes: int, t0: float) -> None:
        """Count bytes read up from ``source``, and the staging time since ``t0``."""
        self.stats_.bytes_moved[source] = self.stats_.bytes_moved.get(source, 0) + nbytes
        self._count_time(t0)

    def _count_time(self, t0: float) -> None:
        """On the CPU, where copies run as they are queued, add the time since ``t0`` on the clock
        to the staging time (on a GPU, events time the batches instead)."""
        if not self.timing:
            self.stats_.stage_seconds += self.clock() - t0

    def _mark_start(self, b: _Batch) -> None:
        """With timing, an event on the copy stream before the batch's first read."""
        if self.timing and b.start is None:
            b.start = self.streams.event(timing=True)
            b.start.record(self.copy_stream)

    def _after_row(self, b: _Batch, pid: int, row: int) -> None:
        """Order the copy stream after the last dequantization from a transit row (once per batch):
        it must have read the row before a copy rewrites it."""
        done = self.transit_done.get((pid, row))
        if done is not None and not any(done is w for w in b.waited):
            self.copy_stream.wait_event(done)
            b.waited.append(done)

    def _stage_direct(self, b: _Batch, pool: SlotPool, slot: int, blob: Any, src: torch.Tensor) -> None:
        """Join the pool's open direct stack (the GPU will read ``src`` in place, on the copy
        stream, so every read of host memory stays ordered there)."""
        self._mark_start(b)
        g = b.groups.get(id(pool))
        if g is not None and (g.starts is None or g.precision != blob.precision or len(g.slots) >= self.STACK_EXPERTS):
            self._dequantize(b, b.groups.pop(id(pool)))
            g = None
        if g is None:
            g = b.groups[id(pool)] = _Stack(pool, blob, blob.precision, -1, [], [])
        g.slots.append(slot)
        g.starts.append(src.data_ptr() - self.host.slab.data_ptr())

    def _stage_copy(self, b: _Batch, pool: SlotPool, slot: int, blob: Any, scheme: Any, src: torch.Tensor) -> None:
        """Queue the copy up: into the slot when lossless, else into the next transit row."""
        precision = blob.precision
        if not scheme.lossless:
            g = b.groups.get(id(pool))
            row = self.next_row[id(pool)]
            if g is not None and (g.precision != precision or row != g.row + len(g.slots) or len(g.slots) >= self.stack_limit[id(pool)]):
                self._dequantize(b, b.groups.pop(id(pool)))  # the open stack cannot grow: dequantize it now
            self.next_row[id(pool)] = (row + 1) % len(self.transit[id(pool)])
            if self.stack_limit[id(pool)] < 2 and len(blob.shapes) > 1:
                self._stage_by_tensor(b, pool, slot, blob, scheme, src, row)
                return
        with self.streams.use(self.copy_stream):
            self._mark_start(b)
            self._check_pinned(src)
            if scheme.lossless:
                blob.dequantize_views(self._views(blob, src), pool.tensors(slot))  # the H2D copies land straight in the slot
                b.copied.setdefault(id(pool), (pool, []))[1].append(slot)
            else:
                self._after_row(b, id(pool), row)
                self._transit_row(id(pool), row, src.numel()).copy_(src, non_blocking=True)
        if not scheme.lossless:
            g = b.groups.get(id(pool))
            if g is None:
                g = b.groups[id(pool)] = _Stack(pool, blob, precision, row, [])
            g.slots.append(slot)
            if self.stack_limit[id(pool)] < 2:
                # experts too large to stack: this one's dequantization overlaps the next one's copy
                self._dequantize(b, b.groups.pop(id(pool)))

    def _stage_by_tensor(self, b: _Batch, pool: SlotPool, slot: int, blob: Any, scheme: Any, src: torch.Tensor, row: int) -> None:
        """A lossy expert too large to stack: one copy per tensor into transit row ``row``, each
        tensor dequantized into the slot on the dequant stream once its own copy has landed, so
        the first tensors' dequantizations overlap the later copies; one ready event."""
        pid = id(pool)
        buf = self._transit_row(pid, row, blob.nbytes)
        views, out = self._views(blob, buf), pool.tensors(slot)
        with self.streams.use(self.copy_stream):
            self._mark_start(b)
            self._check_pinned(src)
            self._after_row(b, pid, row)
        for name, lo, hi in blob.tensor_spans:
            with self.streams.use(self.copy_stream):
                buf[lo:hi].copy_(src[lo:hi], non_blocking=True)
            landed = self.streams.event()
            landed.record(self.copy_stream)
            with self.streams.use(self.dequant_stream):
                self.dequant_stream.wait_event(landed)
                scheme.dequantize(views[name], out=out[name])
        with self.streams.use(self.dequant_stream):
            ready = self.streams.event(timing=self.timing)
            ready.record(self.dequant_stream)
        self._dequantized(b, pool, [slot], row, ready)

    def _dequantized(self, b: _Batch, pool: SlotPool, slots: list[int], row: int, ready: Any) -> None:
        """``slots`` were dequantized from transit rows ``row, row + 1, ...`` before ``ready`` (on the
        dequant stream): their ready event, and the rows' last reader."""
        pool.written(slots, self.dequant_stream, ready)
        for r in range(row, row + len(slots)):
            self.transit_done[(id(pool), r)] = ready
        b.last = ready

    def _stage_copy_run(self, b: _Batch, pool: SlotPool, blob: Any, slots: list[int], srcs: list[torch.Tensor]) -> None:
        """Lossy copies of one blob layout into ``slots`` as a single stack: consecutive transit
        rows, one copy per run of sources that lie back to back in the host pool (a layer's warm
        experts are placed in expert order, a row apart), then one stacked dequantization. For a
        streamed part, whose slots' last reads the copy stream already waits on."""
        pid, k = id(pool), len(slots)
        rows_n = len(self.transit[pid])
        assert 0 < k <= rows_n, f"{k} copies for {rows_n} transit rows"
        row0 = self.next_row[pid] if self.next_row[pid] + k <= rows_n else 0
        self.next_row[pid] = (row0 + k) % rows_n
        width = self.transit[pid].shape[1]
        t0 = self.clock()
        with self.streams.use(self.copy_stream):
            self._mark_start(b)
            for r in range(row0, row0 + k):
                self._after_row(b, pid, r)
            dsts, runs = [], []
            i = 0
            while i < k:
                j = i + 1
                while j < k and srcs[j].data_ptr() == srcs[i].data_ptr() + (j - i) * width:
                    j += 1
                nbytes = (j - i - 1) * width + srcs[j - 1].numel()
                src = srcs[i] if j == i + 1 else self._warm_view(srcs[i].data_ptr() - self.host.slab.data_ptr(), nbytes)
                self._check_pinned(src)
                dsts.append(self._transit_row(pid, row0 + i, nbytes, rows=j - i))
                runs.append(src)
                i = j
            if self.BATCHED_COPIES:
                copy_batch(dsts, runs, self.copy_stream)  # one driver call for the part's runs
            else:  # a copy per run (A/B runs)
                for dst, src in zip(dsts, runs):
                    dst.copy_(src, non_blocking=True)
        self._count_staged(pool, "cpu", sum(src.numel() for src in srcs), t0)
        self._dequantize(b, _Stack(pool, blob, blob.precision, row0, list(slots)))

    def _stage_copy_batch(self, b: _Batch, pool: SlotPool, blob: Any, slots: list[int], srcs: list[torch.Tensor]) -> None:
        """Lossless copies of one blob layout (``srcs``, warm places) straight into ``slots``, every
        tensor of every expert, as one batch (``tiers.h2d``). For a streamed part, whose slots'
        last reads the copy stream already waits on; the batch's end event is their ready event,
        as for ``_stage_copy``'s."""
        t0 = self.clock()
        dsts, views = [], []
        for slot, src in zip(slots, srcs):
            self._check_pinned(src)
            out = pool.tensors(slot)
            for name, q in self._views(blob, src).items():  # lossless: one field per tensor, the slot's dtype and shape
                dsts.append(out[name])
                views.append(q.data["data"])
        with self.streams.use(self.copy_stream):
            self._mark_start(b)
            copy_batch(dsts, views, self.copy_stream)
        b.copied.setdefault(id(pool), (pool, []))[1].extend(slots)
        self._count_staged(pool, "cpu", sum(src.numel() for src in srcs), t0)

    def _count_staged(self, pool: SlotPool, source: str, nbytes: int, t0: float) -> None:
        """Count ``nbytes`` staged into ``pool`` from ``source`` (one read, or a batch of them):
        the bytes moved, the staging time since ``t0``, and in the decode stage the pool's decode
        reads."""
        if self.decoding:
            self.note_decode_read(pool, nbytes)
        self._count_read(source, nbytes, t0)

    def _dequantize(self, b: _Batch, g: _Stack) -> None:
        """Dequantize a stack of copies (consecutive transit rows of one pool) into their slots on the
        dequant stream, after the copies land; one ready event for all of them. Each run of slots
        in a row is one launch per tensor (a streamed part's slots skip those of experts already
        cached in its buffer), a lone slot one per tensor of its own. A direct stack is one
        ``fetch_stack`` launch on the copy stream instead."""
        pool, k = g.pool, len(g.slots)
        t0 = self.clock()
        if g.starts is not None:
            ready = self.fetch_stack(pool, g.blob, g.starts, g.slots)
            pool.written(g.slots, self.copy_stream, ready)
            b.last = ready
            self._count_time(t0)
            return
        landed = self.streams.event()
        landed.record(self.copy_stream)
        scheme = quant.get_scheme(g.precision)
        with self.streams.use(self.dequant_stream):
            self.dequant_stream.wait_event(landed)
            i = 0
            while i < k:  # each run of slots in a row (its transit rows are in a row too)
                j = i + 1
                while j < k and g.slots[j] == g.slots[i] + (j - i):
                    j += 1
                if j - i > 1 and scheme.stacks:
                    # one launch per tensor, from the stacked transit rows into that row of the slabs
                    views, out = self._stack_views(pool, g.blob, g.row + i, g.slots[i], j - i)
                    for name, q in views.items():
                        scheme.dequantize(q, out=out[name])
                else:
                    for r in range(i, j):
                        out = pool.tensors(g.slots[r])
                        for name, q in self._views(g.blob, self._transit_row(id(pool), g.row + r, g.blob.nbytes)).items():
                            scheme.dequantize(q, out=out[name])
                i = j
            ready = self.streams.event(timing=self.timing)
            ready.record(self.dequant_stream)
        self._dequantized(b, pool, g.slots, g.row, ready)
        self._count_time(t0)

    def _stack_views(self, pool: SlotPool, blob: Any, row: int, s0: int, k: int) -> tuple[dict, dict]:
        """A stack's quantized views of transit rows ``[row, row + k)`` and its slabs' slots
        ``[s0, s0 + k)`` (made once per place: both are fixed buffers)."""
        key = (id(pool), id(blob), row, s0, k)
        got = self._stack_view_cache.get(key)
        if got is None:
            if len(self._stack_view_cache) >= self.STACK_VIEWS:
                self._stack_view_cache.clear()
            rows = self.transit[id(pool)][row : row + k, : blob.nbytes]  # [k, bytes]
            got = self._stack_view_cache[key] = (self._views(blob, rows), {n: slab[s0 : s0 + k] for n, slab in pool.slabs.items()})
        return got

    def _transit_row(self, pid: int, row: int, nbytes: int, rows: int = 1) -> torch.Tensor:
        """The first ``nbytes`` of transit rows ``[row, row + rows)``, flat (a view made once: a
        streamed part's copy run otherwise made three view ops per copy on the host)."""
        key = (pid, row, nbytes, rows)
        view = self._transit_views.get(key)
        if view is None:
            view = self._transit_views[key] = self.transit[pid][row : row + rows].view(-1)[:nbytes]
        return view

    def _close(self, b: _Batch) -> None:
        """Issue a batch's pending dequantizations and ready events; mark its ring buffers busy."""
        for g in list(b.groups.values()):
            self._dequantize(b, g)
        b.groups.clear()
        if b.copied or b.rings:
            end = self.streams.event(timing=self.timing)
            end.record(self.copy_stream)  # after every copy of the batch
            for pool, slots in b.copied.values():
                pool.written(slots, self.copy_stream, end)
            for ring in b.rings:
                self.ring_busy[ring] = end  # the host must not refill these buffers before their copies ran
            if b.last is None:  # else the span ends at the last dequantization
                b.last = end
        if self.timing and b.start is not None:
            self.stats_.timed("stage", b.start, b.last)  # the batch's span, copies and dequantizations

    def slot_map(self, layer: int, experts: list[int], slots: list[int]) -> torch.Tensor:
        """An int64 [num_experts + 1] map expert -> slot on the device (unlisted experts and the
        sentinel id ``num_experts`` -> ``n_slots``), copied without a host sync."""
        pool = self.pool_of[layer]
        n = self.manifest.layers[layer].layout.num_experts
        i = self._ring_buffer()
        arr = self._arrays_of[torch.int64][i]
        arr[: n + 1] = pool.n_slots
        arr[experts] = slots
        return self._upload(self.maps[i][: n + 1], i)

    def upload_ints(self, values: list[int], dtype: torch.dtype = torch.int32, on: Any | None = None) -> torch.Tensor:
        """``values`` as an int32 (or int64) tensor on the device, through the pinned ring (no host
        sync); ``on``: as for ``upload_int_lists``, except that the caller orders its readers."""
        return self._upload(*self._pinned_ints(values, dtype), on=on)

    def upload_int_lists(self, lists: list[list[int]], on: Any | None = None) -> list[torch.Tensor]:
        """Each list as an int32 tensor on the device, packed into as few uploads as the pinned
        buffers hold (each list must fit one, as for ``upload_ints``).

        ``on``: a stream to upload on instead of the current one, which then waits for the
        uploads. A small upload that reaches the copy engine while a large read runs waits for
        that read: on the H200 a whole-layer call's plan, uploaded on the compute stream after the
        layer's attention, landed only when the read of the call's part 1 had ended, 0.7-1.5 ms
        later, and part 0's kernels and part 2's reads waited behind it
        (``prefill_split-qwen3_moe-buffers.json``'s timelines). Queued on the copy stream before
        the parts, it lands right after the previous layer's reads instead."""
        room = self._arrays_of[torch.int32][0].shape[0]
        out: list[torch.Tensor] = []
        i = 0
        while i < len(lists):
            j, n = i + 1, len(lists[i])
            while j < len(lists) and n + len(lists[j]) <= room:
                n += len(lists[j])
                j += 1
            up = self.upload_ints([v for vs in lists[i:j] for v in vs], on=on)
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

    def _pinned_ints(self, values: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """``values`` in the next pinned buffer of the ring: that buffer's view, and its index (the
        caller records who reads it with ``_read_by``)."""
        i = self._ring_buffer()
        n = len(values)
        self._arrays_of[dtype][i][:n] = values
        return self._maps_of[dtype][i][:n], i

    def _read_by(self, i: int, stream: Any) -> None:
        """The pinned buffer ``i`` is read by what is queued on ``stream`` so far: it is refilled after that."""
        done = self._map_events[i]
        done.record(stream)
        self.map_copied[i] = done

    def _ring_buffer(self) -> int:
        """The next pinned buffer of the ring, once the copy that last read it has run."""
        i = self.next_map
        self.next_map = (i + 1) % self.MAPS
        if self.map_copied[i] is not None:
            self.map_copied[i].synchronize()  # the copy that last read this buffer (16 calls ago: long done)
        return i

    def _upload(self, host: torch.Tensor, i: int, on: Any | None = None) -> torch.Tensor:
        """``host`` (pinned buffer ``i`` of the ring) copied to the device on the current stream, or
        on ``on``: allocated there and marked as used by the current stream, so its memory is not
        handed out again before the current stream's readers ran."""
        if self.device.type != "cuda":
            return host.clone()  # no copy to make: the caller must not alias the ring
        self._check_pinned(host)
        if on is None:
            dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            dev.copy_(host, non_blocking=True)
            self._read_by(i, self.streams.current())
            return dev
        reader = self.streams.current()
        with self.streams.use(on):
            dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            dev.copy_(host, non_blocking=True)
        self._read_by(i, on)
        dev.record_stream(reader)
        return dev

    def _check_pinned(self, src: torch.Tensor) -> None:
        """Every H2D source is a view of the host pool: pinned when the pool is, checked per copy otherwise."""
        if not self.host.pinned:
            assert_pinned(src, self.device)

    def _views(self, blob: Any, buf: torch.Tensor) -> dict:
        """``blob.views(buf)``, made once per (blob layout, address, shape): transit rows, ring buffers
        and warm places are fixed buffers, and a view depends only on those."""
        key = (id(blob), buf.data_ptr(), buf.device, buf.shape)
        views = self._view_cache.get(key)
        if views is None:
            scheme = quant.get_scheme(blob.precision)
            views = self._view_cache[key] = {n: scheme.prepare(q) for n, q in blob.views(buf).items()}
        return views

    def wait(self, h: Handle) -> None:
        """Make the compute stream wait for ``h``'s copy; call right before its first kernel."""
        self.wait_all([h])

    def wait_all(self, held: list[Handle]) -> None:
        """Make the compute stream wait for every held expert's pending copy, right before the first
        kernel that reads them. Per stream one wait suffices, on the latest of those ready events:
        a stream runs in order, so it also covers the earlier ones."""
        pending = []
        for h in held:
            p = h.pool.take_ready(h.slot)
            if p is not None:
                pending.append(p)
                self.table.apply(h.key, Op.READY)
        self._wait_latest(pending)

    def _wait_latest(self, pending: list[tuple[Any, Any, int]]) -> None:
        """Order the compute stream after pending writes, (event, stream, record order) each: one
        wait per stream, on the latest of its events."""
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
        marks = self._static_marks.get(layer)
        if marks is None:
            n = self.manifest.layers[layer].layout.num_experts
            slab = torch.zeros(self.STATIC_MARK_ROWS, n + 1, dtype=torch.bool, device=top_k_index.device)  # column n: the sentinel
            marks = self._static_marks[layer] = (slab, list(slab.unbind(0)))
        r = self._static_row.get(layer, 0)
        marks[1][r].index_fill_(0, top_k_index.reshape(-1), True)  # one kernel per call
        self._static_row[layer] = r + 1
        if r + 1 == self.STATIC_MARK_ROWS:
            self._fold_static(layer)

    # A prefill's static layer call costs one kernel launch to count (its row's marks) instead of
    # a buffer's fill, the marks and a sum each time: on a host-bound prefill each launch shows
    STATIC_MARK_ROWS = 64

    def _fold_static(self, layer: int | None = None) -> None:
        """Add the marked rows of ``layer`` (every layer: None) to the device count, and clear them."""
        for L in [layer] if layer is not None else list(self._static_marks):
            slab, _ = self._static_marks[L]
            if self._static_row.get(L, 0):
                self._static_hits += slab[: self._static_row[L], :-1].sum()
                slab.zero_()
                self._static_row[L] = 0

    def acquire_layer(self, layer: int, experts: list[int]) -> list[Handle] | None:
        """Hold all of ``experts`` at once (staging the misses), or None (holding nothing) if the
        misses outnumber the staging slots free now. Two or more cold misses are first read in
        parallel on the reader threads; each one's copy is queued when its turn comes."""
        self.pump()
        self._read_cold_ahead(layer, experts)
        held: list[Handle] = []
        try:
            with self.staging():
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
        never takes a slot the call itself needs), and their blobs are small (``PARALLEL_READ_BYTES``).
        One blob at a time on the compute thread leaves the disk idle between small reads."""
        if self.reader_threads is None:
            return
        rows = [self.table[ExpertKey(layer, e)] for e in experts]
        cold = [e for e, r in zip(experts, rows) if r.slot is None and r.home is Home.NVME]
        if len(cold) < 2 or self.manifest.layers[layer].blobs[self.cfg.nvme.precision].nbytes > self.PARALLEL_READ_BYTES:
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

    # -- host compute (tiers.cpu.compute) ---------------------------------------------------
    def host_compute_for(self, hidden_states: torch.Tensor, top_k: int) -> HostCompute | None:
        """The host compute worker when this call may use it (generate's decode stage, one
        token, ``tiers.cpu.compute`` on), else None."""
        if not self.cfg.cpu.compute or not self.decoding or hidden_states.shape[0] != 1:
            return None
        hc = self.host_compute
        if hc is None or hc.x.shape[1] != hidden_states.shape[1] or hc.x.dtype != hidden_states.dtype or hc.w.shape[1] < top_k:
            if hc is not None:
                hc.close()
            hc = self.host_compute = HostCompute(hidden_states.shape[1], hidden_states.dtype, self.device, top_k,
                                                 self.cfg.cpu.compute_threads)
        return hc

    def host_picks(self, layer: int, picks: list[int]) -> list[int]:
        """The positions among one token's ``picks`` that the host computes: warm experts in no GPU
        slot, split with the call's other misses (copied up) by ``HostCompute.decide``."""
        hc = self.host_compute
        positions, sizes, busy = [], [], 0.0
        for pos, e in enumerate(picks):
            key = ExpertKey(layer, e)
            r = self.table[key]
            if r.slot is not None:  # hot, cached, or being read into a slot
                continue
            nbytes = self.manifest.ref(key, self._precision_of(r)).nbytes
            if r.home is Home.CPU:
                positions.append(pos)
                sizes.append(nbytes)
            else:
                busy += nbytes / COPY_BYTES_PER_S
        chosen = hc.decide(sizes, busy)
        return [p for p, c in zip(positions, chosen) if c]

    def host_views(self, layer: int, expert: int) -> tuple[dict, int]:
        """A warm expert's prepared field views in the host pool, and its bytes; counted as a
        lookup the cpu tier served (it moves nothing)."""
        key = ExpertKey(layer, expert)
        r = self.table[key]
        assert r.home is Home.CPU and r.slot is None, f"{key} is not a warm miss"
        precision = self.cfg.cpu.precision
        blob = self.manifest.blob(key, precision)
        pool = self.pool_of[layer]
        self.cache[id(pool)].access(key)
        if self.recorded is not None:
            self.recorded.append(key)
        self.stats_.lookup("cpu")
        return self._views(blob, self._warm_view(r.host_offset, blob.nbytes)), blob.nbytes

    # -- reporting -------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Start counting afresh: the collector's counters and the static layers' hits."""
        self.settle()  # calls made before count before
        self.stats_.reset()
        self._fold_static()
        self._static_hits.zero_()
        self._static_host_hits = 0
        self.reset_direct()
        if self.host_compute is not None:
            self.host_compute.reset()
        self.graphs.reset_counts()
        self.whole_graphs.reset_counts()
        if self.steps is not None:
            self.steps.reset_counts()

    def stats(self) -> TierStats:
        self.settle()
        self.stats_.resolve()
        self._fold_static()
        static = int(self._static_hits.item()) + self._static_host_hits
        direct_gpu, direct_cpu, direct_bytes, untimed = self.direct_served()
        m = self.manifest
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
            hits=self.stats_.hits | {"gpu": self.stats_.hits["gpu"] + static + direct_gpu, "cpu": self.stats_.hits["cpu"] + direct_cpu},
            misses=self.stats_.misses | {"gpu": self.stats_.misses["gpu"] + direct_cpu},
            bytes_moved=self.stats_.bytes_moved | {"cpu": self.stats_.bytes_moved.get("cpu", 0) + direct_bytes},
            stage_seconds=self.stats_.stage_seconds,
            stall_seconds=self.stats_.stall_seconds,
            untimed_bytes=untimed,
            gpu_slots={"hot": hot, "staging": staging, "cached": cached},
            prefetch=self.stats_.prefetch_report(),
            direct={"on": int(self.direct_reads or self.direct_decode), "decode_calls": self.stats_.direct_calls, "stacks": self.stats_.direct_stacks},
            streamed={"calls": self.stats_.streamed_calls, "parts": self.stats_.streamed_parts, "whole": self.stats_.whole_calls,
                      "unused": self.stats_.unused_reads, "unused_bytes": self.stats_.unused_bytes},
            memory=memory,
            device=str(self.device),
            rebalance=self.rebalancer.report() if self.rebalancer is not None else {},
            graphs=self.graphs.counts(),
            whole_graphs=self.whole_graphs.counts(),
            step_graphs=self.steps.report() if self.steps is not None else {"on": 0},
            host_compute=self.host_compute.report() if self.host_compute is not None else {"on": int(self.cfg.cpu.compute)},
        )

    def close(self) -> None:
        self.settle()
        if self.rebalancer is not None:
            self.rebalancer.close()
        if self.host_compute is not None:
            self.host_compute.close()
        if self.reader_threads is not None:
            self.reader_threads.shutdown(wait=True)
            self.drain()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.host.close()
        self.disk.close()
