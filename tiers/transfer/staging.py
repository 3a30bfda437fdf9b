"""Staging: an expert's pinned host bytes queued into its GPU slot on the copy stream, dequantized there.

Owns the copy path and its buffers: the transit rows lossy copies land in (per pool), the pinned
ring buffer each staging slot's disk reads land in, the staging batch, and the events that order
it. The table (``tiers.store.table``) says which expert a slot gets; staging queues the bytes and
tells the table each write's ready event (``Table.written``).

- A write waits, on the copy stream, for the slot's last read (``Table.last_read``).
- Lossless bytes are copied straight into the slot; lossy ones into the next transit row, which
  the dequant stream turns into the slot's weights while the copy stream moves on: with one
  ``quant.direct`` launch where it decodes the encoding, else the scheme's dequantization.
- The writes of one layer call form a batch (``batch``): each copy is queued at once, but small
  lossy experts are dequantized a stack at a time (up to ``STACK_EXPERTS`` after one wait,
  sharing one ready event, one launch). Larger ones go up one tensor at a time, each dequantized
  once its own copy has landed, so that only the last tensor's follows the last copy.
- On CUDA with Triton, small warm experts are read by the GPU straight from the pinned pool
  (a direct stack: one launch on the copy stream decodes up to ``STACK_EXPERTS`` of them).
- A streamed part's misses go up as one driver batch (``tiers.transfer.h2d``) or one run.

Invariant: no pinned bytes are overwritten while a queued copy may read them (a ring buffer is
refilled only after its last copy ran; a transit row only after its last dequantization).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from tiers import quant
from tiers.loader.layout import ExpertKey
from tiers.loader.packed import Manifest
from tiers.policy.placement import STACK_BYTES
from tiers.quant import direct
from tiers.store.disk_store import DiskStore
from tiers.store.host_pool import HostPool, assert_pinned
from tiers.store.pools import SlotPool
from tiers.store.table import Home, Residency, Table
from tiers.transfer.h2d import copy_batch
from tiers.transfer.uploads import Uploads


@dataclass
class _Stack:
    """Lossy copies into consecutive transit rows of one pool, to be dequantized together; or
    (``starts`` set) small experts the GPU reads straight from the host pool, in one launch."""

    pool: SlotPool
    blob: Any
    row: int  # the first transit row (-1 for a direct stack)
    slots: list[int]
    starts: list[int] | None = None  # a direct stack: each expert's offset in the host pool


@dataclass
class _Batch:
    start: Any = None  # timing event recorded before the first copy
    staged: set = field(default_factory=set)  # (pool, slot) written in this batch
    waited: list = field(default_factory=list)  # events the copy stream already waits on
    copied: dict = field(default_factory=dict)  # pool index -> (pool, slots written by the copy stream alone)
    stacks: dict[int, _Stack] = field(default_factory=dict)  # pool index -> its open stack
    rings: list = field(default_factory=list)  # (pool, slot) whose ring buffer a copy reads
    last: Any = None  # the latest ready event issued


class Staging:
    STACK_EXPERTS = 4

    def __init__(self, manifest: Manifest, table: Table, pools: list[SlotPool], transit: dict[int, tuple[int, int]], host: HostPool,
                 disk: DiskStore, uploads: Uploads, streams: Any, stats: Any, *, precisions: tuple[str, str],
                 rings: bool, clock: Callable[[], float], gpu_pool: tuple[Any, str] | None = None):
        """``transit``: pool -> (rows, bytes per row) of its transit buffer; ``precisions``: the cpu
        and nvme tiers'; ``rings``: keep a pinned ring buffer per staging slot for disk reads;
        ``gpu_pool``: the quantized hot experts' ``BlobPool`` and its precision, if any."""
        self.manifest, self.table, self.pools, self.host, self.disk = manifest, table, pools, host, disk
        self.uploads, self.streams, self.stats, self.clock = uploads, streams, stats, clock
        self.cpu_precision, self.nvme_precision = precisions
        self.gpu_pool, self.gpu_precision = gpu_pool if gpu_pool is not None else (None, None)
        self.device = pools[0].slabs[next(iter(pools[0].slabs))].device if pools else torch.device("cpu")
        self.timing = self.device.type == "cuda"
        self.copy_stream = streams.new_stream()
        lossy = not all(quant.get_scheme(p).lossless for p in (*precisions, *([self.gpu_precision] if gpu_pool else [])))
        self.dequant_stream = streams.new_stream() if lossy else self.copy_stream
        self.transit = {p: torch.empty(shape, dtype=torch.uint8, device=self.device) for p, shape in transit.items()}
        self.next_row = dict.fromkeys(self.transit, 0)  # per pool: the transit row the next lossy copy goes to (a ring)
        self.transit_done: dict[tuple[int, int], Any] = {}  # (pool, row) -> its last dequantization's end
        self.stack_limit = {p.index: self._stack_limit(p, transit[p.index][0]) for p in pools}
        self.staged_bytes = [0] * len(pools)  # per pool: bytes staged into it so far (direct decode's choice reads it)
        self._batch: _Batch | None = None
        self._views_of: dict[tuple, dict] = {}  # (blob layout, address, device, shape) -> prepared field views
        self._warm: dict[tuple[int, int], torch.Tensor] = {}  # (host offset, bytes) -> that view of the pool
        self._rows: dict[tuple[int, int, int, int], torch.Tensor] = {}  # (pool, row, bytes, rows) -> those rows' first bytes
        self._direct: dict[tuple, direct.DirectExpert | None] = {}  # (pool, precision[, tensor]) -> how quant.direct decodes it
        self.direct_reads = self.device.type == "cuda" and host.pinned and direct.kernel_available()
        self.ring: dict[tuple[int, int], torch.Tensor] = {}
        self.ring_busy: dict[tuple[int, int], Any] = {}
        if rings:
            for p in pools:
                size = max(manifest.layers[L].largest(self.nvme_precision).stride for L in self._layers(p))
                for s in p.staging:
                    self.ring[(p.index, s)] = host.view(host.alloc(size, "rings"), size)
        n = self.STACK_EXPERTS  # direct stacks' scratch: their picks are 0..k-1, none resident
        self._stack_picks, self._stack_ids = torch.arange(n, device=self.device), torch.empty(n, dtype=torch.int64, device=self.device)
        self._stack_resident = torch.full((n,), -1, dtype=torch.int32, device=self.device)
        self._stack_counts = torch.zeros(2, dtype=torch.int64, device=self.device)

    def _layers(self, pool: SlotPool) -> list[int]:
        return [L for L, p in self.table.pool_of.items() if p == pool.index]

    def _stack_limit(self, pool: SlotPool, rows: int) -> int:
        """Experts one stacked dequantization may take: a stack's copies take consecutive rows, so
        only a pool with a row per staging slot, whose lossy blobs are small, stacks."""
        staging = pool.n_slots - pool.hot
        lossy = max((e.blobs[enc].nbytes for e in map(self.manifest.layers.get, self._layers(pool)) for p in (self.cpu_precision, self.nvme_precision,
                     self.gpu_precision) if p in e.blobs for enc in e.encodings[p] if not quant.get_scheme(enc).lossless), default=0)
        return min(staging, self.STACK_EXPERTS) if lossy <= STACK_BYTES and rows >= staging else 1

    # -- sources -------------------------------------------------------------------------------
    def precision_of(self, r: Residency) -> str:
        if r.home is Home.GPU:  # a quantized hot expert (a hot one is never staged)
            return self.gpu_precision
        return self.cpu_precision if r.home is Home.CPU else self.nvme_precision

    def fetch(self, key: ExpertKey, r: Residency, pool: SlotPool, slot: int) -> tuple[str, str, torch.Tensor]:
        """(precision, source tier, bytes) of ``key``'s blob: a view into the GPU's blob pool (a quantized
        hot expert), into the pinned host pool, or a disk read into ``slot``'s pinned ring buffer. Call
        before any state changes: a read can fail."""
        precision = self.precision_of(r)
        nbytes = self.manifest.ref(key, precision).nbytes
        if r.home is Home.GPU:
            return precision, "gpu", self.gpu_pool.view(r.host_offset, nbytes)
        if r.home is Home.CPU:
            return precision, "cpu", self.warm_view(r.host_offset, nbytes)
        src = self.ring_buffer(pool.index, slot, nbytes)
        self.disk.read(key, precision, src)
        return precision, "nvme", src

    def ring_buffer(self, pool: int, slot: int, nbytes: int) -> torch.Tensor:
        """The slot's pinned ring buffer, once no earlier copy up reads it any more."""
        busy = self.ring_busy.pop((pool, slot), None)
        if busy is not None:
            busy.synchronize()  # the host must not overwrite pinned bytes an earlier H2D may still read
        return self.ring[(pool, slot)][:nbytes]

    def warm_view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The host pool's bytes ``[offset, offset + nbytes)`` (a view made once per place)."""
        view = self._warm.get((offset, nbytes))
        if view is None:
            view = self._warm[(offset, nbytes)] = self.host.view(offset, nbytes)
        return view

    def views(self, blob: Any, buf: torch.Tensor) -> dict:
        """``blob.views(buf)`` prepared for dequantization, made once per (blob layout, address, shape)."""
        key = (id(blob), buf.data_ptr(), buf.device, buf.shape)
        got = self._views_of.get(key)
        if got is None:
            scheme = quant.get_scheme(blob.precision)
            got = self._views_of[key] = {n: scheme.prepare(q) for n, q in blob.views(buf).items()}
        return got

    def direct_tensors(self, pool: SlotPool, blob: Any) -> direct.DirectExpert | None:
        """How ``quant.direct`` decodes ``blob`` into ``pool``'s slabs; None when the GPU cannot read
        it in place (a precision it does not decode, or an expert too large for one launch)."""
        key = (pool.index, blob.precision)
        if key not in self._direct:
            tensors = None
            if direct.supported(blob.precision):
                tensors = direct.expert_of(pool.slabs, blob, blob.precision)
                if not direct.fits(tensors):
                    tensors = None
            self._direct[key] = tensors
        return self._direct[key]

    def _tensor_of(self, pool: SlotPool, blob: Any, name: str) -> direct.DirectExpert:
        """``direct_tensors``' tensor ``name`` alone, as a launch takes it (made once)."""
        key = (pool.index, blob.precision, name)
        if key not in self._direct:
            self._direct[key] = direct.DirectExpert(t for t, (n, _) in zip(self.direct_tensors(pool, blob), blob.shapes) if n == name)
        return self._direct[key]

    def _check_pinned(self, src: torch.Tensor) -> None:
        """Every H2D source is a view of the host pool: pinned when the pool is, checked per copy
        otherwise (a view of the GPU's blob pool is no H2D source)."""
        if not self.host.pinned and src.device.type == "cpu":
            assert_pinned(src, self.device)

    # -- batches -------------------------------------------------------------------------------
    @contextmanager
    def batch(self) -> Iterator[None]:
        """Batch the writes queued inside (see the module docstring); readers wait on a slot only
        after the batch closed. Nested uses join the outer batch."""
        if self._batch is not None:
            yield
            return
        self._batch = _Batch()
        try:
            yield
        finally:
            b, self._batch = self._batch, None
            self._close(b)  # also after an exception: the writes queued so far need their events

    def write(self, key: ExpertKey, pool: SlotPool, slot: int, precision: str, source: str, src: torch.Tensor, direct_ok: bool = True) -> None:
        """Queue ``src`` (pinned) -> ``slot``, which the table has just given ``key`` (``stage`` or
        ``swap_hot``). ``source`` names the bytes in the stats (cpu, nvme, or rebalance);
        ``direct_ok``: a small warm expert may be read by a direct stack. Outside ``batch`` it
        is a batch of one."""
        if self._batch is None:
            with self.batch():
                self.write(key, pool, slot, precision, source, src, direct_ok)
            return
        b = self._batch
        if (pool.index, slot) in b.staged:  # rewritten within the batch: what is queued for it closes first
            self._close(b)
            b = self._batch = _Batch()
        b.staged.add((pool.index, slot))
        self._after_read(b, pool, slot)
        t0 = self.clock()
        blob = self.manifest.blob(key, precision)
        if source != "gpu" and self._reads_direct(pool, blob, direct_ok):  # a direct stack reads the host pool
            self._stage_direct(b, pool, slot, blob, src)
        else:
            self._stage_copy(b, pool, slot, blob, quant.get_scheme(blob.precision), src)  # the expert's own encoding
        if source == "nvme":
            b.rings.append((pool.index, slot))
        self._count(pool, source, src.numel(), t0)

    def _after_read(self, b: _Batch, pool: SlotPool, slot: int) -> None:
        """Order the copy stream after the slot's last read (once per event per batch): kernels
        queued on the compute stream may still read the old expert."""
        ev = self.table.last_read(pool.index, slot)
        if ev is not None and not any(ev is w for w in b.waited):
            self.copy_stream.wait_event(ev)
            b.waited.append(ev)

    def _reads_direct(self, pool: SlotPool, blob: Any, direct_ok: bool) -> bool:
        return direct_ok and self.direct_reads and blob.nbytes <= STACK_BYTES and self.direct_tensors(pool, blob) is not None

    def _count(self, pool: SlotPool, source: str, nbytes: int, t0: float) -> None:
        """Count ``nbytes`` staged into ``pool`` from ``source``; on the CPU, where copies run as
        they are queued, the time since ``t0`` (on a GPU, events time the batches). Copies from the
        GPU's own blob pool move no bytes between tiers: not counted."""
        if source == "gpu":
            self._count_time(t0)
            return
        self.staged_bytes[pool.index] += nbytes
        self.stats.bytes_moved[source] = self.stats.bytes_moved.get(source, 0) + nbytes
        self._count_time(t0)

    def _count_time(self, t0: float) -> None:
        if not self.timing:
            self.stats.stage_seconds += self.clock() - t0

    def _mark_start(self, b: _Batch) -> None:
        if self.timing and b.start is None:
            b.start = self.streams.event(timing=True)
            b.start.record(self.copy_stream)

    def _after_row(self, b: _Batch, pool: int, row: int) -> None:
        """Order the copy stream after the last dequantization from a transit row (once per batch)."""
        done = self.transit_done.get((pool, row))
        if done is not None and not any(done is w for w in b.waited):
            self.copy_stream.wait_event(done)
            b.waited.append(done)

    def _row(self, pool: int, row: int, nbytes: int, rows: int = 1) -> torch.Tensor:
        """The first ``nbytes`` of transit rows ``[row, row + rows)``, flat (a view made once)."""
        key = (pool, row, nbytes, rows)
        view = self._rows.get(key)
        if view is None:
            view = self._rows[key] = self.transit[pool][row : row + rows].view(-1)[:nbytes]
        return view

    def _stage_direct(self, b: _Batch, pool: SlotPool, slot: int, blob: Any, src: torch.Tensor) -> None:
        """Join the pool's open direct stack (the GPU reads ``src`` in place, on the copy stream)."""
        self._mark_start(b)
        g = b.stacks.get(pool.index)
        if g is not None and (g.starts is None or g.blob.precision != blob.precision or len(g.slots) >= self.STACK_EXPERTS):
            self._dequantize(b, b.stacks.pop(pool.index))
            g = None
        if g is None:
            g = b.stacks[pool.index] = _Stack(pool, blob, -1, [], [])
        g.slots.append(slot)
        g.starts.append(src.data_ptr() - self.host.slab.data_ptr())

    def _stage_copy(self, b: _Batch, pool: SlotPool, slot: int, blob: Any, scheme: Any, src: torch.Tensor) -> None:
        """Queue the copy up: into the slot when lossless, else into the next transit row."""
        pi = pool.index
        if not scheme.lossless:
            g = b.stacks.get(pi)
            row = self.next_row[pi]
            if g is not None and (g.blob.precision != blob.precision or row != g.row + len(g.slots) or len(g.slots) >= self.stack_limit[pi]):
                self._dequantize(b, b.stacks.pop(pi))  # the open stack cannot grow: dequantize it now
            self.next_row[pi] = (row + 1) % len(self.transit[pi])
            if self.stack_limit[pi] < 2 and len(blob.shapes) > 1:
                self._stage_by_tensor(b, pool, slot, blob, scheme, src, row)
                return
        with self.streams.use(self.copy_stream):
            self._mark_start(b)
            self._check_pinned(src)
            if scheme.lossless:
                blob.dequantize_views(self.views(blob, src), pool.tensors(slot))  # the H2D copies land straight in the slot
                b.copied.setdefault(pi, (pool, []))[1].append(slot)
            else:
                self._after_row(b, pi, row)
                self._row(pi, row, src.numel()).copy_(src, non_blocking=True)
        if not scheme.lossless:
            g = b.stacks.get(pi)
            if g is None:
                g = b.stacks[pi] = _Stack(pool, blob, row, [])
            g.slots.append(slot)
            if self.stack_limit[pi] < 2:  # too large to stack: this one's dequantization overlaps the next one's copy
                self._dequantize(b, b.stacks.pop(pi))

    def _stage_by_tensor(self, b: _Batch, pool: SlotPool, slot: int, blob: Any, scheme: Any, src: torch.Tensor, row: int) -> None:
        """A lossy expert too large to stack: one copy per tensor into transit row ``row``, each
        tensor dequantized into the slot once its own copy has landed; one ready event."""
        pi = pool.index
        buf = self._row(pi, row, blob.nbytes)
        kernel = self.direct_tensors(pool, blob) is not None
        views, out = (None, None) if kernel else (self.views(blob, buf), pool.tensors(slot))  # the scheme's path alone
        with self.streams.use(self.copy_stream):
            self._mark_start(b)
            self._check_pinned(src)
            self._after_row(b, pi, row)
        for name, lo, hi in blob.tensor_spans:
            with self.streams.use(self.copy_stream):
                buf[lo:hi].copy_(src[lo:hi], non_blocking=True)
            landed = self.streams.event()
            landed.record(self.copy_stream)
            with self.streams.use(self.dequant_stream):
                self.dequant_stream.wait_event(landed)
                if kernel:
                    self._decode_rows(pool, blob, row, [slot], self._tensor_of(pool, blob, name))
                else:
                    scheme.dequantize(views[name], out=out[name])
        with self.streams.use(self.dequant_stream):
            ready = self.streams.event(timing=self.timing)
            ready.record(self.dequant_stream)
        self._dequantized(b, pool, [slot], row, ready)

    def _dequantized(self, b: _Batch, pool: SlotPool, slots: list[int], row: int, ready: Any) -> None:
        """``slots`` were dequantized from transit rows ``row, row + 1, ...`` before ``ready``."""
        self.table.written(pool.index, slots, ready, self.dequant_stream)
        for r in range(row, row + len(slots)):
            self.transit_done[(pool.index, r)] = ready
        b.last = ready

    # -- a streamed part's copies ------------------------------------------------------------------
    def write_part(self, pool: SlotPool, blob: Any, slots: list[int], srcs: list[torch.Tensor]) -> bool:
        """Queue a streamed part's warm misses (one blob layout, the table's ``stage`` done, the copy
        stream already after the slots' last reads) as one stack or one driver batch; False when
        neither fits (a direct read, or a lossy blob too large to stack): then ``write`` each."""
        if self._reads_direct(pool, blob, False):
            return False
        scheme = quant.get_scheme(blob.precision)
        b = self._batch
        assert b is not None, "a part is written inside a batch"
        b.staged.update((pool.index, s) for s in slots)
        if not scheme.lossless and scheme.stacks and self.stack_limit[pool.index] > 1:
            self._copy_run(b, pool, blob, slots, srcs)
            return True
        if scheme.lossless and all(f.spec.dtype == pool.dtype and f.spec.shape == tuple(pool.slabs[f.tensor].shape[1:]) for f in blob.fields):
            self._copy_batch(b, pool, blob, slots, srcs)
            return True
        return False

    def _copy_run(self, b: _Batch, pool: SlotPool, blob: Any, slots: list[int], srcs: list[torch.Tensor]) -> None:
        """Lossy copies into ``slots`` as a single stack: consecutive transit rows, one copy per run
        of sources back to back in the host pool, one driver batch, one stacked dequantization."""
        pi, k = pool.index, len(slots)
        rows_n = len(self.transit[pi])
        assert 0 < k <= rows_n, f"{k} copies for {rows_n} transit rows"
        row0 = self.next_row[pi] if self.next_row[pi] + k <= rows_n else 0
        self.next_row[pi] = (row0 + k) % rows_n
        width = self.transit[pi].shape[1]
        t0 = self.clock()
        with self.streams.use(self.copy_stream):
            self._mark_start(b)
            for r in range(row0, row0 + k):
                self._after_row(b, pi, r)
            dsts, runs, i = [], [], 0
            while i < k:
                j = i + 1
                while j < k and srcs[j].data_ptr() == srcs[i].data_ptr() + (j - i) * width:
                    j += 1
                nbytes = (j - i - 1) * width + srcs[j - 1].numel()
                src = srcs[i] if j == i + 1 else self.warm_view(srcs[i].data_ptr() - self.host.slab.data_ptr(), nbytes)
                self._check_pinned(src)
                dsts.append(self._row(pi, row0 + i, nbytes, rows=j - i))
                runs.append(src)
                i = j
            copy_batch(dsts, runs, self.copy_stream)
        self._count(pool, "cpu", sum(src.numel() for src in srcs), t0)
        self._dequantize(b, _Stack(pool, blob, row0, list(slots)))

    def _copy_batch(self, b: _Batch, pool: SlotPool, blob: Any, slots: list[int], srcs: list[torch.Tensor]) -> None:
        """Lossless copies straight into ``slots``, every tensor of every expert, as one driver batch."""
        t0 = self.clock()
        dsts, views = [], []
        for slot, src in zip(slots, srcs):
            self._check_pinned(src)
            out = pool.tensors(slot)
            for name, q in self.views(blob, src).items():  # lossless: one field per tensor, the slot's dtype and shape
                dsts.append(out[name])
                views.append(q.data["data"])
        with self.streams.use(self.copy_stream):
            self._mark_start(b)
            copy_batch(dsts, views, self.copy_stream)
        b.copied.setdefault(pool.index, (pool, []))[1].extend(slots)
        self._count(pool, "cpu", sum(src.numel() for src in srcs), t0)

    # -- dequantization and closing -----------------------------------------------------------------
    def _dequantize(self, b: _Batch, g: _Stack) -> None:
        """Dequantize a stack (consecutive transit rows of one pool) into its slots on the dequant
        stream after its copies land, one ready event for all; a direct stack is one
        ``quant.direct.fetch`` launch on the copy stream."""
        pool, t0 = g.pool, self.clock()
        if g.starts is not None:
            self._fetch_stack(pool, g.blob, self.host.slab, g.starts, g.slots, self.copy_stream)
            ready = self.streams.event(timing=self.timing)
            ready.record(self.copy_stream)
            self.stats.direct_stacks += 1
            self.table.written(pool.index, g.slots, ready, self.copy_stream)
            b.last = ready
            self._count_time(t0)
            return
        landed = self.streams.event()
        landed.record(self.copy_stream)
        with self.streams.use(self.dequant_stream):
            self.dequant_stream.wait_event(landed)
            if self.direct_tensors(pool, g.blob) is not None:  # one launch reads the stack's transit rows
                self._decode_rows(pool, g.blob, g.row, g.slots)
            else:  # an encoding quant.direct does not decode (bnb8): the scheme's own, slot by slot
                scheme = quant.get_scheme(g.blob.precision)
                for r, slot in enumerate(g.slots):
                    out = pool.tensors(slot)
                    for name, q in self.views(g.blob, self._row(pool.index, g.row + r, g.blob.nbytes)).items():
                        scheme.dequantize(q, out=out[name])
            ready = self.streams.event(timing=self.timing)
            ready.record(self.dequant_stream)
        self._dequantized(b, pool, g.slots, g.row, ready)
        self._count_time(t0)

    def _decode_rows(self, pool: SlotPool, blob: Any, row: int, slots: list[int], tensors: direct.DirectExpert | None = None) -> None:
        """``quant.direct`` decodes transit rows ``[row, row + len(slots))`` into ``slots`` on the dequant stream."""
        rows = self.transit[pool.index]
        self._fetch_stack(pool, blob, rows.view(-1), [(row + r) * rows.shape[1] for r in range(len(slots))], slots, self.dequant_stream, tensors)

    def _fetch_stack(self, pool: SlotPool, blob: Any, src: torch.Tensor, starts: list[int], slots: list[int], stream: Any,
                     tensors: direct.DirectExpert | None = None) -> None:
        """Decode the blobs at byte ``starts`` of ``src`` (the host pool, or transit rows) into ``slots`` in one
        launch on ``stream`` (``tensors``: default all of each), through a pinned buffer of offsets and slots."""
        k = len(slots)
        buf, i = self.uploads.pinned(starts + slots, torch.int64)
        with self.streams.use(stream):
            direct.fetch(src, buf[:k], self._stack_resident, self._stack_picks[:k], buf[k:],
                         self._stack_ids[:k], self._stack_counts, tensors or self.direct_tensors(pool, blob))
        self.uploads.read_by(i, stream)

    def _close(self, b: _Batch) -> None:
        """Issue a batch's pending dequantizations and ready events; mark its ring buffers busy."""
        for g in list(b.stacks.values()):
            self._dequantize(b, g)
        b.stacks.clear()
        if b.copied or b.rings:
            end = self.streams.event(timing=self.timing)
            end.record(self.copy_stream)  # after every copy of the batch
            for pool, slots in b.copied.values():
                self.table.written(pool.index, slots, end, self.copy_stream)
            for ring in b.rings:
                self.ring_busy[ring] = end  # the host must not refill these buffers before their copies ran
            if b.last is None:
                b.last = end
        if self.timing and b.start is not None:
            self.stats.timed("stage", b.start, b.last)

