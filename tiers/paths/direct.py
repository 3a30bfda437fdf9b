"""Direct path: a decode call whose misses the GPU reads straight from the pinned pool, with no host sync.

Owns the device-side copies of the table (per layer that qualifies: each warm expert's host
offset, each hot expert's slot), the staging slots reserved for direct calls while a decode
stage runs, kept as a cache on the device (``quant.direct.SlotCache``), and the counters of what
direct calls served.

Why: the host-routed path brings each layer's picks to the host (one sync per layer) and stages
every miss with a handful of host operations, so the GPU idles while Python works. Here one
launch of ``quant.direct.fetch_cached`` looks each pick up on the device (a hot slot, an expert a
reserved slot still holds, or a decode from host memory over PCIe into the slot whose expert's
layer comes back last) and writes every pick's slot id, which transformers' batched_mm decode
forward uses as its expert ids. Nothing syncs, so a decode step can replay as one CUDA graph.

A layer qualifies when every expert is hot, warm, or quantized hot (the GPU cannot read a file),
in a precision ``quant.direct`` decodes: the warm ones' and the quantized hot ones' must be one,
the one its ``DirectExpert`` decodes, and so must their blobs' encodings (a layer where pack kept
some of them at a higher precision, ``--min-sqnr``, runs host-routed). A quantized hot expert is
decoded from the GPU's blob pool (``quant.direct``'s second source: ``resident`` -2 and a
negative start), which moves no bytes between tiers and counts as a GPU hit; a layer whose experts
are all int4 hot decodes into no slot at all: ``quant.fused4`` multiplies by the blobs in place
(``_run_fused``), and such a layer runs direct whatever slots are reserved. Where the
host-routed path would copy a pool's experts with the copy engine (above ``STACK_BYTES``), a
stage runs direct only while the pool's last decode stage missed fewer than ``MISS_BYTES`` per
layer call: read by the SMs, Mixtral-8x7B's 168 MiB INT8 experts cost more device time than copied
(6-12% slower per token in arms missing 1.2-1.7 experts per call, 14% faster in one missing 0.46).
A pool whose misses decode from 4-bit blobs runs direct in every stage: its 92 MiB int4 experts,
missing 1.9 a call, decoded 6% faster read direct than copied (``experiments/decode_marks.py``).

Slot rule: at ``begin_stage`` the table reserves staging slots of each pool with a qualifying
layer (``Table.reserve``, "direct"): all of them when every layer of the pool runs direct, else
the last half. Every direct write and read is on the compute stream, in order. A host-routed
call in a pool whose staging slots are all reserved gives them back first (``leave``), and that
pool's layers run host-routed until the next stage; ``end_stage`` gives the rest back empty.
With the rebalancer on, direct calls count their picks per expert on the device; when its swaps
land the tables are rebuilt and the compute stream waits for the copies into promoted hot slots.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tiers.policy.placement import STACK_BYTES
from tiers.quant import direct, fused4
from tiers.store.pools import SlotPool


@dataclass
class _Layer:
    starts: torch.Tensor  # int64 [E]: each warm expert's offset in the host pool (0 for hot ones)
    resident: torch.Tensor  # int32 [E]: each hot expert's slot, -1 for the rest
    tensors: direct.DirectExpert
    pool: SlotPool
    counts: torch.Tensor  # int64 [4]: the pool's resident, decoded, cached and quantized hot decoded picks (shared by its layers)
    usage: torch.Tensor | None  # int64 [E]: picks per expert, for the rebalancer (None without one)
    step_counts: torch.Tensor  # int64 [4]: the same, for calls inside a step graph (whose reads are not timed)
    fused: tuple[direct.DirectTensor, direct.DirectTensor] | None = None  # (up, down): every expert int4 hot, read by ``quant.fused4``


@dataclass
class _Reserved:
    cache: direct.SlotCache  # what the slots the table has reserved for "direct" hold, kept and decided on the device
    every: bool  # they are all the pool's staging slots: the host-routed path has none


class DirectPath:
    MISS_BYTES = 128 << 20

    def __init__(self, mgr: Any):
        self.mgr = mgr
        self.enabled = mgr.staging.direct_reads  # a GPU with Triton and a pinned pool (tests switch it on for the CPU reference)
        self.fused = direct.kernel_available()  # layers of int4 hot experts alone multiply them in place (tests: the CPU reference)
        self.layers: dict[int, _Layer] | None = None  # built at the first decode stage
        self.version = -1  # the table's homes_version the layers were built at
        self._built_at: dict[int, int] = {}  # layer -> the table's layer version its tables were built at
        self._starts: torch.Tensor | None = None  # int64 [layers, width] over the table's grid
        self._resident: torch.Tensor | None = None  # int32 [layers, width]
        self._host: tuple[torch.Tensor, torch.Tensor] | None = None  # their pinned host copies
        self._copied: Any | None = None  # the last upload's event
        self.reserved: dict[int, _Reserved] = {}  # pool -> its reserved slots, while a decode stage runs
        self.staged = False  # a decode stage runs with tables built (``begin_stage``)
        self._caches: dict[tuple[int, tuple[int, ...]], direct.SlotCache] = {}  # kept across stages: the graphs keep them
        self._counts: dict[int, torch.Tensor] = {}  # pool -> int64 [8]: resident, decoded, cached, quantized hot decoded picks; the same inside step graphs
        self._miss_blob: dict[int, Any] = {}  # pool -> the blob layout a decoded pick reads (its transfer-form bytes, its precision)
        grid = mgr.table.grid
        self.usage = torch.zeros((len(grid.layers), grid.width), dtype=torch.int64, device=mgr.device) if mgr.rebalancer else None
        self.usage_pending = False  # a direct call may have counted picks since the last take
        self._stage_calls: dict[int, int] = {}  # per pool: decode-stage layer calls
        self._stage_start: dict[int, tuple[int, torch.Tensor | None]] = {}  # per pool: staged bytes and direct counts at the stage's start
        self.miss_bytes_per_call: dict[int, float] = {}  # per pool: the last stage's mean miss bytes per layer call

    # -- tables --------------------------------------------------------------------------------
    def _build(self) -> dict[int, _Layer]:
        """The tables of every layer that qualifies. A layer whose experts kept their homes since the
        last build keeps its tables; when any changed, every row is rewritten at once (``_upload``).
        The tables are rows of two tensors allocated once: the decode graphs keep their addresses."""
        mgr, t = self.mgr, self.mgr.table
        out, built, changed = {}, self.layers or {}, False
        for layer, entry in mgr.manifest.layers.items():
            row, n = t.grid.row[layer], entry.layout.num_experts
            first = row * t.grid.width
            pooled = t.pool_offset[first:first + n] >= 0
            warm = t.warm_mask[first:first + n]
            precision = mgr.staging.gpu_precision if pooled.any() else mgr.staging.cpu_precision
            if warm.any() and pooled.any() and mgr.staging.cpu_precision != precision:
                continue  # two encodings in one layer: host-routed
            encodings = set(entry.encodings.get(precision, ()))
            if len(encodings) > 1:  # pack kept some at a higher precision (--min-sqnr): those its kernel would decode
                encodings = {entry.experts[e][precision].encoding or precision for e in np.flatnonzero(warm | pooled)}
            if len(encodings) > 1:
                continue  # one launch decodes one encoding: host-routed
            blob = entry.blobs.get(encodings.pop() if encodings else precision)
            pool = mgr.pool_of[layer]
            if mgr.resident.qualifies(layer) or blob is None or mgr.staging.direct_tensors(pool, blob) is None:
                continue
            version = t.layer_versions.get(layer, 0)
            if layer in built and self._built_at[layer] == version:
                out[layer] = built[layer]
                continue
            if not (t.hot_mask[first:first + n] | warm | pooled).all():
                continue
            self._built_at[layer] = version
            changed = True
            if layer in built:
                out[layer] = built[layer]
                continue
            if self._starts is None:
                self._starts = torch.zeros((len(t.grid.layers), t.grid.width), dtype=torch.int64, device=mgr.device)
                self._resident = torch.full((len(t.grid.layers), t.grid.width), -1, dtype=torch.int32, device=mgr.device)
            counts = self._counts.setdefault(pool.index, torch.zeros(8, dtype=torch.int64, device=mgr.device))
            self._miss_blob[pool.index] = blob
            usage = None if self.usage is None else self.usage[row, :n]
            tensors = mgr.staging.direct_tensors(pool, blob)
            fused = _fused(tensors, blob) if pooled.all() and usage is None else None  # fused calls count no usage
            out[layer] = _Layer(self._starts[row, :n], self._resident[row, :n], tensors, pool, counts[:4], usage, counts[4:], fused)
        if changed:
            self._upload()
        self.version = t.homes_version
        return out

    def _upload(self) -> None:
        """Rewrite every row of the device tables from the table's arrays with one copy each from
        pinned memory, on the compute stream, where every direct call reads them."""
        t, mgr = self.mgr.table, self.mgr
        if self._host is None:
            pin = mgr.device.type == "cuda"
            self._host = (torch.empty(t.grid.size, dtype=torch.int64, pin_memory=pin), torch.empty(t.grid.size, dtype=torch.int32, pin_memory=pin))
        elif self._copied is not None:
            self._copied.synchronize()  # the last upload has read the pinned copies
        starts, resident = self._host
        starts.numpy()[:], resident.numpy()[:] = _tables(t)
        self._starts.view(-1).copy_(starts, non_blocking=True)
        self._resident.view(-1).copy_(resident, non_blocking=True)
        self._copied = mgr.streams.event()
        self._copied.record(mgr.streams.current())

    def refresh(self) -> None:
        """If experts moved since the tables were built: rebuild them, and order the compute stream
        after the copies into hot slots that promotions queued (a direct call reads hot slots without holding them)."""
        if self.layers is None or self.version == self.mgr.table.homes_version:
            return
        self.layers = self._build()
        mgr, table = self.mgr, self.mgr.table
        compute = mgr.streams.current()
        for pool in mgr.pools:
            for s in [s for s in table.pending_slots(pool.index) if s < pool.hot and table.readers(pool.index)[s] == 0]:
                table.hold(pool.index, s)
                compute.wait_event(table.take_ready(pool.index, s)[0])
                table.release(pool.index, s, None)

    def agrees(self) -> bool:
        """Whether the device-side copies agree with the table (syncs; tests and checks): the device
        tables with its arrays, and each reserved slot cache's slots with the slots it has reserved."""
        t = self.mgr.table
        for pool, r in self.reserved.items():
            if r.cache.slots.tolist() != t.reserved_slots(pool, "direct"):
                return False
        if self._starts is None:
            return True
        starts, resident = _tables(t)
        return bool((self._starts.view(-1).cpu().numpy() == starts).all() and (self._resident.view(-1).cpu().numpy() == resident).all())

    # -- the decode stage --------------------------------------------------------------------------
    def begin_stage(self) -> None:
        """Reserve slots for the qualifying layers' misses, each pool's as a slot cache emptied on
        the device: all its staging slots when every layer of the pool runs direct, else half."""
        mgr = self.mgr
        if not self.enabled or mgr.slots.recorded is not None or self.reserved:
            return
        if self.layers is None or self.version != mgr.table.homes_version:
            self.layers = self._build()
        if not self.layers:
            return
        self.staged = True
        mgr.slots.drain()  # read-aheads hold slots until they land
        compute, grid = mgr.streams.current(), mgr.table.grid
        skip = {p for p, mean in self.miss_bytes_per_call.items() if mean >= self.MISS_BYTES and self._copies_win(p)}
        for pool in {d.pool.index: d.pool for d in self.layers.values()}.values():
            self._stage_start[pool.index] = (mgr.staging.staged_bytes[pool.index], self._counts[pool.index].clone())
            if pool.index in skip:
                continue
            every = all(L in self.layers for L in mgr.manifest.layers if mgr.pool_of[L] is pool and not mgr.resident.qualifies(L))
            n = len(pool.staging) if every else len(pool.staging) // 2
            if n == 0:
                continue
            slots = list(range(pool.n_slots - n, pool.n_slots))
            for s in slots:
                mgr.slots.reserve(pool, s, "direct", compute)
            cache = self._caches.get((pool.index, tuple(slots)))
            if cache is None:
                cache = self._caches[(pool.index, tuple(slots))] = direct.SlotCache.new(slots, len(grid.layers), grid.width, mgr.device)
            cache.clear()  # the slots' contents are the host-routed path's leftovers
            self.reserved[pool.index] = _Reserved(cache, every)

    def _copies_win(self, pool: int) -> bool:
        """Whether the host-routed path's copies can beat direct reads of ``pool``'s misses, given
        enough miss bytes a call: experts above ``STACK_BYTES``, not 4-bit (the module docstring)."""
        blob = self._miss_blob[pool]
        return blob.nbytes > STACK_BYTES and blob.precision not in direct.FOUR_BIT

    def end_stage(self) -> None:
        """Give the reserved slots back, and keep each pool's mean miss bytes per decode layer call
        for the next stage's choice (one sync, for the direct calls' device counters)."""
        self.staged = False
        for pool in self.mgr.pools:
            self._release(pool)
        if self._stage_start:
            pools = list(self._stage_start)
            deltas = [(self._counts[p] - self._stage_start[p][1]).view(2, 4) for p in pools]
            decoded = torch.stack([(c[:, 1] - c[:, 3]).sum() for c in deltas]).tolist()  # less the blob pool's: no bytes moved
            for p, n in zip(pools, decoded):
                staged = self.mgr.staging.staged_bytes[p] - self._stage_start[p][0]
                calls = self._stage_calls.get(p, 0)
                if calls:
                    self.miss_bytes_per_call[p] = (staged + max(n, 0) * self._miss_blob[p].nbytes) / calls
        self._stage_start.clear()
        self._stage_calls.clear()

    def note_call(self, pool: SlotPool) -> None:
        """Count a decode-stage layer call of ``pool`` (host-routed or direct)."""
        self._stage_calls[pool.index] = self._stage_calls.get(pool.index, 0) + 1

    def _release(self, pool: SlotPool) -> None:
        """The pool's reserved slots go back empty, read last by what is queued now."""
        r = self.reserved.pop(pool.index, None)
        if r is None:
            return
        ev = self.mgr.streams.event()
        ev.record(self.mgr.streams.current())
        for s in list(self.mgr.table.reserved_slots(pool.index, "direct")):
            self.mgr.table.unreserve(pool.index, s, "direct", ev, keep=False)

    def qualifies(self, layer: int, picks: int) -> bool:
        """Whether a call of ``picks`` picks at ``layer`` runs direct now: its layer qualifies, and
        its calls are fused (no slot needed) or its pool reserved slots for at least that many misses."""
        if not self.staged or self.layers is None or layer not in self.layers:
            return False
        if self._fuses(self.layers[layer]):
            return True
        pool = self.mgr.pool_of[layer].index
        return pool in self.reserved and picks <= len(self.mgr.table.reserved_slots(pool, "direct"))

    def leave(self, pool: SlotPool) -> None:
        """A host-routed call of ``pool``: if its reserved slots are all the pool's staging slots,
        they go back first, since that path needs some."""
        r = self.reserved.get(pool.index)
        if r is not None and r.every:
            self._release(pool)

    def room(self, pool: SlotPool) -> int:
        """Staging slots of ``pool`` a host-routed call may use once it has ``leave``d."""
        r = self.reserved.get(pool.index)
        return len(pool.staging) - (len(self.mgr.table.reserved_slots(pool.index, "direct")) if r is not None and not r.every else 0)

    # -- calls ---------------------------------------------------------------------------------
    def run(self, module: torch.nn.Module, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor) -> torch.Tensor:
        """The slot of every pick, each miss decoded into a reserved slot, then transformers'
        batched_mm forward on those slot ids (a fused layer: ``_run_fused``); inside a step graph
        the device work alone (the step's runner did the host's part, ``Manager.begin_step``)."""
        from transformers.integrations.moe import batched_mm_experts_forward

        mgr = self.mgr
        d = self.layers[layer]
        pool = d.pool
        px = mgr.proxy(module, pool)
        if self._fuses(d):
            return self._run_fused(px, layer, d, hidden_states, top_k_index, top_k_weights)
        if mgr.phase.in_step:
            ids = self._fetch(d, layer, top_k_index, d.step_counts)
            return batched_mm_experts_forward(px, hidden_states, ids, top_k_weights)
        start = None
        if mgr.staging.timing:
            start = mgr.streams.event(timing=True)
            start.record(mgr.streams.current())
        ids = self._fetch(d, layer, top_k_index, d.counts)
        self.counted(layer)
        if start is not None:
            end = mgr.streams.event(timing=True)
            end.record(mgr.streams.current())
            mgr.stats_.timed("stage", start, end)

        def step(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return batched_mm_experts_forward(px, h, ids, w)
        return mgr.decode_graphs.run(("direct", layer), (ids, *pool.slabs.values()), step, (hidden_states, top_k_weights))

    def _fuses(self, d: _Layer) -> bool:
        """Whether ``d``'s calls multiply by its int4 blobs in place (``_run_fused``)."""
        return d.fused is not None and self.fused

    def _run_fused(self, px: Any, layer: int, d: _Layer, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' batched_mm forward, each projection a fused int4 product over the blob pool
        (``quant.fused4``): no slot is written; every pick counts as a quantized hot read."""
        mgr, up, down = self.mgr, *d.fused
        dev = mgr.gpu_pool.slab
        counts = d.step_counts if mgr.phase.in_step else d.counts

        def step(h: torch.Tensor, index: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            picks, k = index.reshape(-1), index.shape[-1]
            counts[1::2] += picks.numel()  # decoded, and of those from the blob pool: GPU hits (``served``)
            y = fused4.linear(h, k, picks, d.starts, dev, up)  # [T*k, 2I] or [T*k, I]
            y = fused4.linear(px._apply_gate(y) if px.has_gate else px.act_fn(y), 1, picks, d.starts, dev, down)  # [T*k, H]
            if px.has_post_expert_norm:
                y = px.post_expert_norm(y)
            y = y * w.reshape(-1).unsqueeze(-1)
            return y.view(h.shape[0], k, -1).sum(dim=1).to(h.dtype)  # summed as transformers sums it
        if mgr.phase.in_step:
            return step(hidden_states, top_k_index, top_k_weights)
        self.counted(layer)
        return mgr.decode_graphs.run(("fused", layer), (dev, d.starts, counts), step, (hidden_states, top_k_index, top_k_weights))

    def counted(self, layer: int) -> None:
        """The host's part of a direct call at ``layer``: its counts (its picks are counted on the device)."""
        self.usage_pending = True
        self.mgr.stats_.direct_calls += 1
        self.note_call(self.mgr.pool_of[layer])

    def step_bound(self) -> list[torch.Tensor]:
        """The tensors a step graph's direct calls bind that can change between decode stages: each
        pool's reserved slots' cache. What else they read is allocated once."""
        out = []
        for pool in self.mgr.pools:
            r = self.reserved.get(pool.index)
            if r is not None:
                out += [r.cache.slots, r.cache.owner, r.cache.stamp, r.cache.clock, r.cache.dst]
        return out

    def _fetch(self, d: _Layer, layer: int, top_k_index: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Queue the fetch of the picks (a decode graph where those are on); each pick's slot, shaped as ``top_k_index``."""
        mgr = self.mgr
        cache, row = self.reserved[d.pool.index].cache, mgr.table.grid.row[layer]
        src, starts, resident, usage, tensors = mgr.host.slab, d.starts, d.resident, d.usage, d.tensors
        dev = mgr.gpu_pool.slab if mgr.gpu_pool is not None else src

        def step(picks: torch.Tensor) -> torch.Tensor:  # reads and writes only ``bound`` besides its input
            ids = torch.empty(picks.shape, dtype=torch.int64, device=picks.device)
            direct.fetch_cached(src, starts, resident, picks, cache, row, ids, counts, tensors, usage, dev)
            return ids

        bound = (src, dev, starts, resident, cache.slots, cache.owner, cache.stamp, cache.clock, cache.dst, counts, usage,
                 *(t.out for t in tensors))
        ids = mgr.decode_graphs.run(("fetch", layer), bound, step, (top_k_index.reshape(-1),), fresh=False)
        return ids.view(top_k_index.shape)

    def take_usage(self) -> np.ndarray | None:
        """Picks per expert counted by direct calls since the last take, per cell of the table's
        grid (one sync), then zeroed; None when none ran since (no sync)."""
        if self.usage is None or self.layers is None or not self.usage_pending:
            return None
        taken = self.usage.reshape(-1).to("cpu", copy=True).numpy()
        self.usage.zero_()
        self.usage_pending = False
        return taken

    def served(self) -> tuple[int, int, int, int]:
        """(gpu hits, cpu hits, bytes read, of those the bytes read inside step graphs, untimed) of
        direct calls since the last reset (syncs)."""
        hits = misses = moved = untimed = 0
        for p, counts in self._counts.items():
            h, m, c, q, sh, sm, sc, sq = counts.tolist()  # q: decodes of quantized hot experts, from the GPU
            per = self._miss_blob[p].nbytes
            m, sm = m - q, sm - sq
            hits, misses, moved, untimed = hits + h + c + q + sh + sc + sq, misses + m + sm, moved + (m + sm) * per, untimed + sm * per
        return hits, misses, moved, untimed

    def reset(self) -> None:
        for c in self._counts.values():
            c.zero_()
        for p, (staged, counts) in list(self._stage_start.items()):  # a stage running: its start moves with the counters
            if counts is not None:
                counts.zero_()


def _fused(tensors: direct.DirectExpert, blob: Any) -> tuple[direct.DirectTensor, direct.DirectTensor] | None:
    """A layer's (up, down) tensors where ``quant.fused4`` multiplies by them in place: two weights, no
    biases, each of which it takes (int4 stored ``[out, in]``, a power-of-two group); else None."""
    by = {name: t for (name, _), t in zip(blob.shapes, tensors)}
    up = by.get("gate_up_proj", by.get("up_proj"))
    if len(by) != 2 or up is None or "down_proj" not in by or not all(fused4.qualifies(t) for t in by.values()):
        return None
    return up, by["down_proj"]


def _tables(t: Any) -> tuple[np.ndarray, np.ndarray]:
    """The device tables' contents over the grid: each expert's start (0 for a hot one, its host
    place for a warm one, ``-1 - place`` in the GPU's blob pool for a quantized hot one) and its
    ``resident`` entry (its hot slot, ``quant.direct.QUANTIZED_HOT`` for a quantized hot one, else -1)."""
    pooled = t.pool_offset >= 0
    starts = np.where(t.hot_mask, 0, np.where(pooled, -1 - t.pool_offset, t.host_offset))
    return starts, np.where(pooled, direct.QUANTIZED_HOT, t.hot_slot)
