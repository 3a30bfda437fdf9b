"""Direct reads: the GPU decodes experts straight out of the pinned pool.

Owns: direct stacks (the staging path's small misses, decoded in place from host memory in one
launch per stack on the copy stream instead of a copy each plus a dequantization), and direct
decode: the device-side residency tables of the layers that qualify, the staging slots reserved
for their misses while a decode stage runs, and the counters of what they served. A mixin of
the tier manager, like ``Prefetcher``.

Why: in a decode step the host-routed path must bring each layer's picks to the host (one sync
per layer) and stage every miss with a handful of host operations, so the GPU idles while
Python works, layer after layer. Here a layer call stays on the device: one launch of
``quant.direct.fetch`` looks each pick up in the layer's table (expert -> hot slot, or its
offset in the pinned pool), decodes the misses from host memory into reserved slots over PCIe,
and writes every pick's slot id, which transformers' ``batched_mm`` decode forward then uses as
its expert ids. Nothing syncs, so the host queues the next layers while the GPU reads.

A layer qualifies when each of its experts is hot or warm (none on disk: the GPU cannot read a
file) in a precision ``quant.direct`` decodes, its experts are at most ``DECODE_BYTES`` in
transfer form (unbounded by default), and no routing trace is being recorded. Where the
host-routed path would copy the pool's experts with the copy engine (above ``STACK_BYTES``), a
stage runs direct only while the last stage's layer calls missed fewer than
``DIRECT_MISS_BYTES`` on average: the copy engine reads faster than the SMs, which wins when
most calls miss. With the rebalancer on, direct calls count their picks per
expert on the device; the rebalancer takes those counts (one sync) when an interval closes,
and when its swaps land the tables are rebuilt and the compute stream waits for the copies
into the promoted experts' hot slots. Other layers keep the host-routed path, in the
same step.

The reserved slots are a cache kept on the device (``quant.direct.SlotCache``): a pick whose
expert a reserved slot still holds from an earlier step is read there, and a miss evicts the
slot whose expert's layer comes back last (Belady's choice when every layer runs once per step),
decided by a one-program kernel before the decode launch. The host never learns what they hold.

Slot rule: at ``begin_decode`` the manager holds staging slots of each pool with a qualifying
layer (after their pending writes, their owners evicted), so the host-routed path and its cache
never touch them: all of them when every layer of the pool runs direct, else the last
``staging // 2``; the slot cache over them starts empty. Every direct write and read is on the
compute stream, in order. A call that cannot run direct in a pool whose staging slots are all
reserved gives them back first (``_release``), and the pool's layers run host-routed until the
next stage; ``end_decode`` gives the rest back, with a last-read event recorded on the compute
stream.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tiers.quant import direct


@dataclass
class _DirectLayer:
    starts: torch.Tensor  # int64 [E]: each warm expert's offset in the host pool (0 for hot ones)
    resident: torch.Tensor  # int32 [E]: each hot expert's slot, -1 for the rest
    tensors: direct.DirectExpert
    pool: Any
    counts: torch.Tensor  # int64 [3]: the pool's resident, decoded and cached picks (shared by its layers)
    usage: torch.Tensor | None  # int64 [E]: picks per expert, for the rebalancer (None without one)
    step_counts: torch.Tensor  # int64 [3]: the same, for calls inside a step graph (whose reads are not timed)


@dataclass
class _Reserved:
    slots: list[int]
    cache: direct.SlotCache  # what the slots hold, kept and decided on the device
    every: bool  # the slots are all the pool's staging slots: the host-routed path has none


class DirectDecoder:
    """Mixed into ``TierManager``: uses its table, pools, host pool, streams and stats."""

    # The largest transfer form direct decode reads (None: any size one launch holds). Unbounded
    # since the reserved slots cache their misses: Mixtral-8x7B's 168 MiB INT8 experts, read this
    # way, took 18.1 ms per 6-layer token against the host-routed path's 21.1 in one run
    # (bench/results/decode_split-mixtral-slotcache.json); without the cache they had moved 36%
    # more bytes and taken 24.3 against 19.3 (decode_split-mixtral.json).
    DECODE_BYTES: int | None = None
    # Where the host-routed path stages with the copy engine (experts above STACK_BYTES), a decode
    # stage runs direct only while the pool's decode layer calls missed fewer bytes than this on
    # average in the last stage that made any (the first runs direct). Read by the SMs, Mixtral's
    # 168 MiB experts cost more device time than copied: in one run the host-routed path was
    # 6-12% faster per token in arms that missed 1.2-1.7 experts per layer call, direct 14% faster
    # in the one that missed 0.46 (bench/results/decode_split-mixtral-hostlarge.json,
    # -slotcache.json; the misses per call from bench-mixtral-run32.md's hit rates).
    DIRECT_MISS_BYTES = 128 << 20

    def _init_direct(self, enabled: bool) -> None:
        # on by config, on a GPU with Triton and a pinned pool (tests switch them on for the CPU reference)
        self.direct_reads = enabled and self.device.type == "cuda" and self.host.pinned and direct.kernel_available()
        self.direct_decode = self.direct_reads
        self._direct_tensors: dict[tuple[int, str], direct.DirectExpert | None] = {}
        # a direct stack's picks are 0..k-1, none resident; its ids and counts go to scratch
        n = self.STACK_EXPERTS
        self._stack_picks = torch.arange(n, dtype=torch.int64, device=self.device)
        self._stack_resident = torch.full((n,), -1, dtype=torch.int32, device=self.device)
        self._stack_ids = torch.empty(n, dtype=torch.int64, device=self.device)
        self._stack_counts = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._direct_layers: dict[int, _DirectLayer] | None = None  # built at the first decode stage
        self._direct_version = -1  # the residency table's homes_version the tables were built at
        self._direct_built_at: dict[int, int] = {}  # layer -> the table's layer version its tables were built at
        # the device tables of every layer, [layers, width] over the residency table's grid (built
        # at the first decode stage), their pinned host copies, and the last upload's event
        self._table_starts: torch.Tensor | None = None  # int64: each warm expert's host offset, 0 for hot ones
        self._table_resident: torch.Tensor | None = None  # int32: each hot expert's slot, -1 for the rest
        self._table_host: tuple[torch.Tensor, torch.Tensor] | None = None
        self._table_copied: Any | None = None
        self._reserved: dict[int, _Reserved] = {}  # pool id -> its reserved slots, while a decode stage runs
        # (pool id, slots) -> the slot cache over them, kept across decode stages: the decode graphs keep its tensors
        self._slot_caches: dict[tuple[int, tuple[int, ...]], direct.SlotCache] = {}
        # pool id -> int64 [6]: resident, decoded and cached picks of direct calls, then the same of
        # those inside step graphs (``tiers.step_graph``), whose reads are not timed
        self._direct_counts: dict[int, torch.Tensor] = {}
        self._direct_miss_bytes: dict[int, int] = {}  # pool id -> transfer-form bytes a decoded pick reads
        # picks per expert of every layer, counted on the device for the rebalancer (fetched once per
        # interval), laid out as the residency table's grid: one row per layer
        grid = self.table.grid
        self._usage = torch.zeros((len(grid.layers), grid.width), dtype=torch.int64, device=self.device) if self.rebalancer else None
        self._usage_pending = False  # a direct call may have counted picks since the last take
        # the decode stage's layer calls and the bytes their misses read, per pool: host-routed ones
        # counted as they stage, direct ones from the device counters (read when the stage ends);
        # the last stage's mean per call decides the next stage's path (``DIRECT_MISS_BYTES``)
        self._stage_calls: dict[int, int] = {}
        self._stage_bytes: dict[int, int] = {}
        self._stage_counts: dict[int, torch.Tensor] = {}  # pool id -> the device counters at the stage's start
        self.decode_miss_bytes: dict[int, float] = {}  # pool id -> the last stage's mean miss bytes per layer call
        self.host_routed_pools: set[int] = set()  # pools this stage keeps off direct decode

    def direct_tensors(self, pool: Any, blob: Any) -> direct.DirectExpert | None:
        """How ``quant.direct`` decodes ``blob`` into ``pool``'s slabs; None when the GPU cannot
        read it in place (a precision it does not decode, or an expert too large for one launch).
        Which reads use it is for the callers: direct stacks take small experts only."""
        key = (id(pool), blob.precision)
        if key not in self._direct_tensors:
            tensors = None
            if direct.supported(blob.precision):
                offset = {(f.tensor, f.spec.name): f.offset for f in blob.fields}
                data, scale = direct.FIELDS[blob.precision]
                tensors = direct.DirectExpert(direct.DirectTensor(pool.slabs[name], offset[(name, data)], scale and offset[(name, scale)])
                                              for name, _ in blob.shapes)
                if not direct.fits(tensors):
                    tensors = None
            self._direct_tensors[key] = tensors
        return self._direct_tensors[key]

    def fetch_stack(self, pool: Any, blob: Any, starts: list[int], slots: list[int]) -> Any:
        """Decode the blobs at ``starts`` in the host pool into ``slots`` in one launch on the copy
        stream, which the slots' last reads were ordered before; returns the ready event. The
        offsets and slots go through a pinned ring buffer the kernel reads in place."""
        k = len(slots)
        buf, i = self._pinned_ints(starts + slots, torch.int64)
        with self.streams.use(self.copy_stream):
            direct.fetch(self.host.slab, buf[:k], self._stack_resident, self._stack_picks[:k], buf[k:],
                         self._stack_ids[:k], self._stack_counts, self.direct_tensors(pool, blob))
        self._read_by(i, self.copy_stream)
        ready = self.streams.event(timing=self.timing)
        ready.record(self.copy_stream)
        self.stats_.direct_stacks += 1
        return ready

    def _build_direct(self) -> dict[int, _DirectLayer]:
        """The direct tables of every layer that qualifies (not static, its cpu precision decoded in
        place, every expert hot or warm). A layer whose experts kept their homes since the last
        build keeps its tables; when any layer's changed, every layer's row of the device tables
        is rewritten at once (``_upload_direct_tables``). The tables are rows of two tensors
        allocated once, so their addresses never change and the decode graphs keep them."""
        out: dict[int, _DirectLayer] = {}
        precision = self.cfg.cpu.precision
        built = self._direct_layers or {}
        t = self.table
        changed = False
        for layer, entry in self.manifest.layers.items():
            blob = entry.blobs.get(precision)
            pool = self.pool_of[layer]
            if (layer in self.static_maps or blob is None or self.direct_tensors(pool, blob) is None
                    or (self.DECODE_BYTES is not None and blob.nbytes > self.DECODE_BYTES)):
                continue
            version = t.layer_versions.get(layer, 0)
            if layer in built and self._direct_built_at[layer] == version:
                out[layer] = built[layer]  # no expert of the layer changed home since
                continue
            row, n = t.grid.row[layer], entry.layout.num_experts
            first = row * t.grid.width
            if not (t.hot_mask[first:first + n] | t.warm_mask[first:first + n]).all():
                continue
            self._direct_built_at[layer] = version
            changed = True
            if layer in built:
                out[layer] = built[layer]
                continue
            if self._table_starts is None:
                rows, width = len(t.grid.layers), t.grid.width
                self._table_starts = torch.zeros((rows, width), dtype=torch.int64, device=self.device)
                self._table_resident = torch.full((rows, width), -1, dtype=torch.int32, device=self.device)
            counts = self._direct_counts.setdefault(id(pool), torch.zeros(6, dtype=torch.int64, device=self.device))
            self._direct_miss_bytes[id(pool)] = blob.nbytes
            usage = None if self._usage is None else self._usage[row, :n]
            out[layer] = _DirectLayer(self._table_starts[row, :n], self._table_resident[row, :n], self.direct_tensors(pool, blob),
                                      pool, counts[:3], usage, counts[3:])
        if changed:
            self._upload_direct_tables()
        self._direct_version = t.homes_version
        return out

    def _upload_direct_tables(self) -> None:
        """Rewrite every row of the device tables from the residency table's arrays (each warm
        expert's host offset, 0 for hot ones; each hot expert's slot, -1 for the rest) with one
        copy each from pinned memory, queued on the current stream (the compute stream, where
        every direct call reads them: the calls queued earlier read the old values, later ones the
        new). Rows of layers that do not qualify are written too, and never read."""
        t = self.table
        if self._table_host is None:
            pin = self.device.type == "cuda"
            self._table_host = (torch.empty(t.grid.size, dtype=torch.int64, pin_memory=pin),
                                torch.empty(t.grid.size, dtype=torch.int32, pin_memory=pin))
        elif self._table_copied is not None:
            self._table_copied.synchronize()  # the last upload has read the pinned copies
        starts, resident = self._table_host
        starts.numpy()[:] = np.where(t.hot_mask, 0, t.host_offset)
        resident.numpy()[:] = t.hot_slot
        self._table_starts.view(-1).copy_(starts, non_blocking=True)
        self._table_resident.view(-1).copy_(resident, non_blocking=True)
        self._table_copied = self.streams.event()
        self._table_copied.record(self.streams.current())

    def _refresh_direct(self) -> None:
        """The rebalancer moved experts: rebuild the tables, and order the compute stream after the
        copies into hot slots that promotions queued (a direct call reads hot slots without holding them)."""
        self._direct_layers = self._build_direct()
        compute = self.streams.current()
        for pool in self.pools:
            hot = self.hot_count[id(pool)]
            for s in [s for s in pool.pending_ready if s < hot and pool.readers[s] == 0]:
                pool.hold(s)
                pool.wait_ready(s, compute)
                pool.end_read_at(s, None)

    def take_direct_usage(self) -> np.ndarray | None:
        """Picks per expert counted by direct calls since the last take, per cell of the residency
        table's grid (one sync), then zeroed; None when direct calls count nothing, or none ran
        since the last take: then there is nothing to read, and no sync. Why: an interval that
        only long prompts closed waited for the device at its rebalance, which after a prefill's
        last layer means for that layer's reads and kernels, and the rest of the counting then ran
        with the device idle (in bench-qwen3_moe-run44.json the marked 50% skewed prefill ended
        with the host and the device at the same instant, its tail 8 ms longer than run 42's)."""
        if self._usage is None or self._direct_layers is None or not self._usage_pending:
            return None
        taken = self._usage.reshape(-1).to("cpu", copy=True).numpy()
        self._usage.zero_()
        self._usage_pending = False
        return taken

    def begin_decode(self) -> None:
        """A decode stage begins: reserve slots for the qualifying layers' misses, each pool's as a
        slot cache emptied on the device. A pool every one of whose layers runs direct (static
        layers aside) gives it all its staging slots; else half, the rest for the host-routed path."""
        if not self.direct_decode or self.recorded is not None or self._reserved:
            return
        if self._direct_layers is None or self._direct_version != self.table.homes_version:
            self._direct_layers = self._build_direct()
        if not self._direct_layers:
            return
        self.drain()  # read-aheads hold slots until they land
        compute = self.streams.current()
        grid = self.table.grid
        self.host_routed_pools = {pid for pid, mean in self.decode_miss_bytes.items()
                                  if mean >= self.DIRECT_MISS_BYTES and self._direct_miss_bytes.get(pid, 0) > self.STACK_BYTES}
        for pool in {id(d.pool): d.pool for d in self._direct_layers.values()}.values():
            if id(pool) in self.host_routed_pools:
                continue
            self._stage_counts[id(pool)] = self._direct_counts[id(pool)].clone()
            staging = pool.n_slots - self.hot_count[id(pool)]
            every = all(L in self._direct_layers for L in self.manifest.layers if self.pool_of[L] is pool and L not in self.static_maps)
            n = staging if every else staging // 2
            if n == 0:
                continue
            slots = list(range(pool.n_slots - n, pool.n_slots))
            for s in slots:
                assert pool.readers[s] == 0, f"slot {s} is held between forwards"
                self.reserve_slot(pool, s, compute)
            cache = self._slot_caches.get((id(pool), tuple(slots)))
            if cache is None:  # the same slots get the same cache each decode stage: the decode graphs keep it
                cache = self._slot_caches[(id(pool), tuple(slots))] = direct.SlotCache.new(slots, len(grid.layers), grid.width, self.device)
            cache.clear()  # the slots' contents are the host-routed path's leftovers
            self._reserved[id(pool)] = _Reserved(slots, cache, every)

    def end_decode(self) -> None:
        """The decode stage ended: the reserved slots go back, read last by what is queued now, and
        each pool's mean miss bytes per decode layer call are kept for the next stage's choice
        (one sync, for the direct calls' device counters)."""
        for pool in self.pools:
            self._release(pool)
        if self._stage_counts:  # every pool's decoded picks this stage, read with one sync
            pids = list(self._stage_counts)
            decoded = torch.stack([(self._direct_counts[pid] - self._stage_counts[pid])[1::3].sum() for pid in pids]).tolist()
            for pid, n in zip(pids, decoded):
                self._stage_bytes[pid] = self._stage_bytes.get(pid, 0) + max(n, 0) * self._direct_miss_bytes[pid]
        self._stage_counts.clear()
        for pid, calls in self._stage_calls.items():
            if calls:
                self.decode_miss_bytes[pid] = self._stage_bytes.get(pid, 0) / calls
        self._stage_calls.clear()
        self._stage_bytes.clear()

    def note_decode_call(self, pool: Any) -> None:
        """Count a decode-stage layer call of ``pool``."""
        self._stage_calls[id(pool)] = self._stage_calls.get(id(pool), 0) + 1

    def note_decode_read(self, pool: Any, nbytes: int) -> None:
        """Count ``nbytes`` that a decode-stage call of ``pool`` read for its misses (host-routed)."""
        self._stage_bytes[id(pool)] = self._stage_bytes.get(id(pool), 0) + nbytes

    def _release(self, pool: Any) -> None:
        """``pool``'s reserved slots (if any) go back to the host-routed path, read last by what is
        queued now on the compute stream; its layers run host-routed until the next decode stage."""
        r = self._reserved.pop(id(pool), None)
        if r is None:
            return
        ev = self.streams.event()
        ev.record(self.streams.current())
        for s in r.slots:
            pool.end_read_at(s, ev)

    def direct_ready(self, layer: int, picks: int) -> bool:
        """True when this layer call (``picks`` = tokens x top-k) runs direct. A call that cannot
        (its layer does not qualify, or more picks than reserved slots), in a pool whose reserved
        slots are all its staging slots, first gives them back: the host-routed path needs some."""
        if not self._reserved:
            return False
        if self.direct_ok(layer, picks):
            return True
        self._leave_direct(self.pool_of[layer])
        return False

    def direct_ok(self, layer: int, picks: int) -> bool:
        """Whether a call of ``picks`` picks at ``layer`` can run direct now (no side effect):
        its layer qualifies and its pool reserved slots for at least that many misses."""
        r = self._reserved.get(id(self.pool_of[layer])) if self._reserved else None
        return r is not None and self._direct_layers is not None and layer in self._direct_layers and picks <= len(r.slots)

    def _leave_direct(self, pool: Any) -> None:
        """A call of ``pool`` takes the host-routed path: if its reserved slots are all the pool's
        staging slots, they go back first (``_release``), since that path needs some."""
        r = self._reserved.get(id(pool))
        if r is not None and r.every:
            self._release(pool)

    def fetch_direct(self, layer: int, top_k_index: torch.Tensor) -> torch.Tensor | None:
        """The slot of each pick (int64, shaped as ``top_k_index``), with every miss decoded into
        a reserved slot; queued on the current stream, no sync, as a decode graph where those are
        on (the result is then the graph's static output, rewritten by this layer's next call). With a rebalancer the call is
        noted first (its swaps land at the first layer): if that leaves this layer unqualified (an
        expert went to disk), None, and the caller runs the host-routed path for this call, whose
        routing the rebalancer has yet to count (``begin_call(..., noted=True)``)."""
        if self.rebalancer is not None:
            self.rebalancer.note_call(layer, [], top_k_index.shape[0], first=self.opens_token(layer))
            if self._direct_version != self.table.homes_version:
                self._refresh_direct()
        d = self._direct_layers.get(layer)
        if d is None:
            self._leave_direct(self.pool_of[layer])
            return None
        start = None
        if self.timing:
            start = self.streams.event(timing=True)
            start.record(self.streams.current())
        ids = self._fetch_slots(d, layer, top_k_index, d.counts)
        self.note_direct_call(layer)
        if start is not None:
            end = self.streams.event(timing=True)
            end.record(self.streams.current())
            self.stats_.timed("stage", start, end)
        return ids

    def step_bound(self) -> list[torch.Tensor]:
        """The tensors a step graph's direct calls bind that can change between decode stages: each
        pool's reserved slots' cache (which slots a stage reserves depends on whether every layer of
        the pool runs direct). What else they read (the slabs, the direct tables, the counters, the
        host pool) is allocated once."""
        out = []
        for pool in self.pools:
            r = self._reserved.get(id(pool))
            if r is not None:
                out += [r.cache.slots, r.cache.owner, r.cache.stamp, r.cache.clock, r.cache.dst]
        return out

    def step_fetch(self, layer: int, top_k_index: torch.Tensor) -> torch.Tensor:
        """``fetch_direct``'s device work alone, for a call inside a step graph: the step's runner
        did the host's part for every layer before the graph ran (``note_direct_call``), and the
        call counts its picks apart, since no timing event spans its reads."""
        d = self._direct_layers[layer]
        return self._fetch_slots(d, layer, top_k_index, d.step_counts)

    def note_direct_call(self, layer: int) -> None:
        """The host's part of a direct call at ``layer`` besides the rebalancer's: its counts."""
        self._usage_pending = True
        self.stats_.direct_calls += 1
        self.note_decode_call(self.pool_of[layer])

    def _fetch_slots(self, d: _DirectLayer, layer: int, top_k_index: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Queue the fetch of ``top_k_index``'s picks at ``layer`` (a decode graph where those are
        on), its picks counted in ``counts``; the slot of each pick, shaped as ``top_k_index``."""
        flat = top_k_index.reshape(-1)
        cache, row = self._reserved[id(d.pool)].cache, self.table.grid.row[layer]
        src = self.host.slab
        starts, resident, usage, tensors = d.starts, d.resident, d.usage, d.tensors

        def step(picks: torch.Tensor) -> torch.Tensor:  # reads and writes only ``bound`` besides its input
            ids = torch.empty(picks.shape, dtype=torch.int64, device=picks.device)
            direct.fetch_cached(src, starts, resident, picks, cache, row, ids, counts, tensors, usage)
            return ids

        bound = (src, starts, resident, cache.slots, cache.owner, cache.stamp, cache.clock, cache.dst, counts, usage,
                 *(t.out for t in tensors))
        ids = self.graphs.run(("fetch", layer), bound, step, (flat,), fresh=False)
        return ids.view(top_k_index.shape)

    def direct_served(self) -> tuple[int, int, int, int]:
        """(gpu hits, cpu hits, bytes read, of those the bytes read inside step graphs, which no
        timing event spans) of direct calls since the last reset (syncs)."""
        hits = misses = moved = untimed = 0
        for pid, counts in self._direct_counts.items():
            h, m, c, sh, sm, sc = counts.tolist()
            per = self._direct_miss_bytes[pid]
            hits, misses, moved, untimed = hits + h + c + sh + sc, misses + m + sm, moved + (m + sm) * per, untimed + sm * per
        return hits, misses, moved, untimed

    def reset_direct(self) -> None:
        for c in self._direct_counts.values():
            c.zero_()
        for c in self._stage_counts.values():  # a stage running: its start moves with the counters
            c.zero_()
