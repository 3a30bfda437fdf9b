"""Streamed calls: a long layer call (a prompt's prefill) whose warm misses outnumber what half
the free staging slots hold, read part by part into reserved slots, double buffered.

Owns: the reservation of a pool's unheld staging slots for one call, split into buffers (two),
the reads of each part's misses into one buffer, and the events that order those reads against
the kernels of the part that last used that buffer. A mixin of the tier manager, like
``Prefetcher`` and ``DirectDecoder``.

Why: the general path for such a call (``integration._grouped_in_parts``) claims each part's
slots through the cache policy, stages each miss, and maps and sorts the part's rows on the
device, all on the host, part after part. On the H200, a part of 8 Qwen3-30B-A3B experts
(INT8, 38 MB, 0.77 ms of reading) took about 1.9 ms of host work under the profiler, so the
reads waited on the host. Here the host plans the whole call once: the experts in hot slots
run first, the call's experts cached in the reserved slots open the first parts where they lie
(no read), the misses fill those parts and go on in parts of a buffer each, every row gets
its part and slot as one sort key (one upload, one sort on the device), and each part then
costs its copies and its grouped GEMMs: a copy per bf16 expert tensor, or for small INT8 experts
one copy per run of blobs back to back in the host pool and one stacked dequantization, the
part's copies one driver batch (``tiers.h2d``). Part ``p + 1``'s reads are
queued before part ``p``'s kernels, into the other buffer, after part ``p - 1``'s kernels.
The copy engine reads, not the SMs (``stream_direct`` off): the GEMMs of a long call need the
SMs. On the H200 a 6-layer Qwen3 prefill through direct stacks took 78 and 82 ms in bf16
against 64 and 68 through the copy engine, in two runs; in INT8 46 against 42, then 64 against
66 (``bench/results/prefill_ab-qwen3_moe*.json``).

Reserved slots hold no cache: a miss is read into a slot the residency table never sees, a
cached expert used in place leaves the cache, and each buffer goes back empty, with the event
recorded after its last part's kernels, when the call ends. Misses on disk leave the
call to the general path, which reads them on the reader threads.

Whole-layer calls (``whole=(tokens, top_k)``): a call so long that uniform routing would route
to every expert of its layer but with a tiny chance (a prompt's prefill), at a layer whose last
such call used nearly all its warm experts, need not wait for its routing on the host. Every
warm expert of the layer is read, in expert order; the rows are sorted and each part's row range
found on the device; and the host queues the call without a sync, so it runs ahead into the
next layers while the GPU computes, and the next layer's first reads queue behind this one's
(each buffer's first reads wait on its slots' last reads, not on the whole compute stream; the
buffer the last parts of the call before used goes last). The
lookups the call made are counted later, in call order, once its rows per expert have reached the
host (``settle``); experts read but routed no row are counted as read in vain.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tiers import quant
from tiers.loader.layout import ExpertKey
from tiers.residency import Home


@dataclass
class Stream:
    """One streamed call: what it holds and how its misses are split."""

    layer: int
    pool: Any
    held: list  # Handles of the experts resident in hot or otherwise held slots (run first)
    parts: list[list[int]]  # the call's other experts, part p in slots of buffers[p % len(buffers)]
    part_slots: list[list[int]]  # each part's slots, in the part's order
    buffers: tuple[list[int], ...]  # the reserved slots: two buffers (WHOLE_BUFFERS for a whole-layer call)
    preloaded: frozenset[int]  # experts of the first parts whose bytes are in their slot already (no read)
    freed: list = field(default_factory=list)  # per buffer: the events its next reads wait on (its last readers' kernels)
    ended: int = 0  # parts whose kernels are queued (end_part)
    whole: Whole | None = None  # a whole-layer call's lookups, counted when settled

    def slots(self, p: int) -> list[int]:
        """The slots part ``p``'s experts are in (or read into), in the part's order."""
        return self.part_slots[p]


@dataclass
class Whole:
    """What a whole-layer call looked up, counted once its routing is on the host (``settle``)."""

    tokens: int
    top_k: int
    predicted: list[int] | None  # the prediction made for this layer, scored when settled
    took: dict[int, int | None] = field(default_factory=dict)  # cached experts used in place -> bytes if read ahead
    read: list[int] = field(default_factory=list)  # experts read from the warm pool
    experts: list[int] = field(default_factory=list)  # the layer's experts, in the order of ``rows``
    rows: Any = None  # the rows routed to each (host, filled by a copy without a sync)
    done: Any = None  # recorded after that copy


class StreamedCalls:
    """Mixed into ``TierManager``: uses its table, pools, cache, staging helpers, streams and stats."""

    STREAM_AHEAD_COVERAGE = 0.9  # expected share of a layer's experts a call must hit for stage_ahead
    # A whole-layer call's reserved slots are split into this many buffers (a waiting call's: two).
    # Three let the next layer's second part read during a call's tail, but cost a third more parts
    # of host work: on the H200 a Qwen3-30B-A3B prefill was slower with three, 1.25x and 1.48x its
    # bound against 1.21x and 1.35x with two (prefill_split-qwen3_moe-buffers.json).
    WHOLE_BUFFERS = 2
    # A whole-layer call uploads its plan on the copy stream, ahead of its reads (False: on the
    # compute stream, where it waits for the reads under way; kept for A/B runs).
    WHOLE_PLAN_ON_COPY = True
    # A streamed part's copies go up as one batch (``tiers.h2d``): lossless misses straight into
    # their slots, lossy runs into transit rows (False: a copy per expert and tensor, or per
    # run, each with its own host work; kept for A/B runs).
    BATCHED_COPIES = True

    def whole_out(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The buffer a whole-layer call's windows write their rows into: one per shape, kept for
        the graphs that write it while its shape recurs (the last two shapes), else a new one."""
        if not self.whole_graphs.enabled:
            return torch.empty(shape, dtype=dtype, device=device)
        key = (shape, dtype)
        out = self.whole_outs.pop(key, None)
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=device)
            while len(self.whole_outs) >= 2:
                self.whole_outs.pop(next(iter(self.whole_outs)))
        self.whole_outs[key] = out  # the most recent last
        return out

    def begin_stream(self, layer: int, experts: list[int], whole: tuple[int, int] | None = None) -> Stream | None:
        """Plan a streamed call of ``experts`` (ascending) and reserve its slots; None when the
        call does not qualify (a miss on disk, a routing trace recorded, fewer free staging slots
        than buffers, or misses that fit one buffer), holding nothing then. ``whole``: the
        tokens and top-k of a whole-layer call (``experts`` is every expert of the layer), whose
        lookups are counted when it is settled.

        Every unheld staging slot is reserved and split into buffers: two, or ``WHOLE_BUFFERS``
        for a whole-layer call. The call's experts cached in those slots (read ahead by
        lookahead, or left by an earlier call) stay where they are, without a read: they open
        the first parts in the buffer their slot is in, and leave the cache (reserved slots hold
        none). The misses fill those parts' other slots, then go in parts of a buffer each.
        Experts in hot or otherwise held slots are held and run first."""
        if not self.streamed_calls or self.recorded is not None:
            return None
        self.drain()  # read-aheads hold their slots until they land (or fail, leaving their expert out)
        pool = self.pool_of[layer]
        rows = [self.table[ExpertKey(layer, e)] for e in experts]
        if any(r.slot is None and r.home is not Home.CPU for r in rows):
            return None
        hot = self.hot_count[id(pool)]
        free = [s for s in range(hot, pool.n_slots) if pool.readers[s] == 0]
        n = self.WHOLE_BUFFERS if whole else 2
        size = len(free) // n
        cached = {r.slot: e for e, r in zip(experts, rows) if r.slot is not None and r.slot >= hot and pool.readers[r.slot] == 0}
        # in host-pool order: a part's reads then lie back to back as far as the pool allows
        # (``_stage_copy_run`` copies each such run at once), whatever swaps have reordered
        misses = [e for _, e in sorted((r.host_offset, e) for e, r in zip(experts, rows) if r.slot is None)]
        if size < 1 or len(misses) <= size:
            return None
        # the cached experts' slots first, so they fall in as few buffers as the count allows;
        # every free slot is reserved, in buffers whose sizes differ by one at most
        ordered = sorted(free, key=lambda s: (s not in cached, s))
        cut = [len(ordered) * i // n for i in range(n + 1)]
        buffers = [sorted(ordered[cut[i] : cut[i + 1]]) for i in range(n)]
        if whole:
            # the first parts read first: into the buffers the last streamed call's last parts did
            # not use, so those reads need not wait for those parts' kernels (the call's tail)
            last = self.last_parts.get(id(pool), {})
            buffers.sort(key=lambda b: max(last.get(s, -1) for s in b))
        resident = [ExpertKey(layer, e) for e, r in zip(experts, rows) if r.slot is not None and r.slot not in cached]
        w = Whole(*whole, self.predicted.pop(layer, None)) if whole else None
        held = [self.hold_resident(key) for key in resident] if w else [self.try_acquire(key) for key in resident]
        compute = self.streams.current()
        parts, part_slots = [], []
        for b in buffers:
            pre = [s for s in b if s in cached]
            for s in pre:
                self._take_cached(pool, s, w)
            rest = [s for s in b if s not in cached][: len(misses)]
            parts.append([cached[s] for s in pre] + misses[: len(rest)])
            part_slots.append(pre + rest)
            misses = misses[len(rest) :]
        while not parts[-1]:
            parts.pop()  # buffers left empty (an empty part between two others runs nothing)
            part_slots.pop()
        while misses:
            b = buffers[len(parts) % n]
            parts.append(misses[: len(b)])
            part_slots.append(b[: len(parts[-1])])
            misses = misses[len(b) :]
        # a whole-layer call's first reads wait on its buffers' last readers only, so they may run
        # while the kernels queued before them (the layer's attention) do
        freed = [self._last_reads(pool, b) for b in buffers] if w else None
        for s in ordered:
            if s in cached:
                pool.hold(s)  # its expert, used in place, keeps the ready event its part waits on
            else:
                self.reserve_slot(pool, s, compute)
        if freed is None:
            start = self.streams.event()
            start.record(compute)  # after the slots' last readers and pending writes: the first reads wait on it
            freed = [[start] for _ in buffers]
        assert len(parts) >= 2, "more misses than one buffer holds: at least two parts"
        self.stats_.streamed_calls += 1
        self.stats_.whole_calls += bool(w)
        return Stream(layer, pool, held, parts, part_slots, tuple(buffers), frozenset(cached[s] for s in ordered if s in cached), freed, whole=w)

    @staticmethod
    def _last_reads(pool: Any, slots: list[int]) -> list:
        """The distinct last-read events of ``slots``: a copy into them waits on these."""
        evs: list = []
        for slot in slots:
            ev = pool.last_read[slot]
            if ev is not None and not any(ev is e for e in evs):
                evs.append(ev)
        return evs

    def _take_cached(self, pool: Any, slot: int, whole: Whole | None = None) -> None:
        """A cached expert of a streamed call is used where it is, and leaves the cache: counted as
        a lookup served from the GPU (a used read-ahead), as ``try_acquire`` would count it, or
        for a whole-layer call when it is settled."""
        key = pool.owner[slot]
        if whole is not None:
            whole.took[key.expert] = self.prefetched.pop(key, None)
        else:
            self.cache[id(pool)].access(key)
            self.stats_.lookup("gpu")
            if self.prefetched.pop(key, None) is not None:
                self.stats_.prefetch_used += 1
        self.drop_staged(pool, slot)

    def stage_ahead(self, layer: int, tokens: int, top_k: int, limit: int) -> int:
        """After a streamed call of ``tokens`` tokens at ``layer`` (``stream_ahead`` on): stage the
        next MoE layer's warm experts in expert order into at most ``limit`` unheld staging slots,
        when a call that long would hit nearly every expert under uniform routing (each expert
        missed with chance (1 - k/E)^tokens, at most ``1 - STREAM_AHEAD_COVERAGE``), so their
        copies run while the host reaches that layer's sync. Returns how many were staged."""
        if not self.stream_ahead:
            return 0
        layers = sorted(self.manifest.layers)
        at = layers.index(layer) + 1
        if at == len(layers) or layers[at] in self.static_maps:
            return 0
        nxt = layers[at]
        n = self.manifest.layers[nxt].layout.num_experts
        if (1 - top_k / n) ** tokens > 1 - self.STREAM_AHEAD_COVERAGE:
            return 0
        rows = [self.table[ExpertKey(nxt, e)] for e in range(n)]
        return self.prefetch(nxt, [e for e, r in enumerate(rows) if r.slot is None and r.home is Home.CPU], limit, direct=self.stream_direct)

    def stream_part(self, s: Stream, p: int) -> None:
        """Queue the reads of part ``p``'s misses into its buffer, after that buffer's last kernels."""
        pool, lru = s.pool, self.cache[id(s.pool)]
        reads = [(e, slot) for e, slot in zip(s.parts[p], s.slots(p)) if e not in s.preloaded]
        self.stats_.streamed_parts += 1
        if not reads:
            return
        for ev in s.freed[p % len(s.buffers)]:
            self.copy_stream.wait_event(ev)
        assert self._batch is None, "a streamed part is read inside another staging batch"
        with self.staging():  # one batch: the part's stacks and ready events
            fetched = []
            for e, slot in reads:
                key = ExpertKey(s.layer, e)
                if s.whole is None:
                    lru.access(key)  # the policy counts every lookup
                fetched.append((key, *self._fetch(key, self.table[key], pool, slot)))
                if s.whole is None:
                    self.stats_.lookup(fetched[-1][2])
                else:
                    s.whole.read.append(e)
            slots = [slot for _, slot in reads]
            blob = self.manifest.blob(fetched[0][0], fetched[0][1])
            warm = all(source == "cpu" for _, _, source, _ in fetched)
            if warm and self._runs_copy(pool, blob):
                self._stage_copy_run(self._batch, pool, blob, slots, [src for *_, src in fetched])
            elif warm and self._batches_copy(pool, blob):
                self._stage_copy_batch(self._batch, pool, blob, slots, [src for *_, src in fetched])
            else:
                for (key, precision, source, src), slot in zip(fetched, slots):
                    self._queue_read(self._batch, key, pool, slot, precision, source, src, direct=self.stream_direct)

    def _runs_copy(self, pool: Any, blob: Any) -> bool:
        """A part's misses go up as one stack (``_stage_copy_run``): lossy, stackable, small (the
        pool stacks its lossy experts), and not read by direct stacks."""
        if self._reads_direct(pool, blob, self.stream_direct):
            return False
        scheme = quant.get_scheme(blob.precision)
        return not scheme.lossless and scheme.stacks and self.stack_limit[id(pool)] > 1

    def _batches_copy(self, pool: Any, blob: Any) -> bool:
        """A part's misses land in their slots as one batch of copies (``_stage_copy_batch``):
        lossless, each field already the slab's dtype and shape, and not read by direct stacks."""
        if not self.BATCHED_COPIES or self._reads_direct(pool, blob, self.stream_direct) or not quant.get_scheme(blob.precision).lossless:
            return False
        return all(f.spec.dtype == pool.dtype and f.spec.shape == tuple(pool.slabs[f.tensor].shape[1:]) for f in blob.fields)

    def wait_part(self, s: Stream, p: int) -> None:
        """Order the compute stream after part ``p``'s reads; call before its first kernel."""
        self._wait_slots(s.pool, s.slots(p))

    def _wait_slots(self, pool: Any, slots: list[int]) -> None:
        """Order the compute stream after the pending writes of held ``slots`` (one wait per stream)."""
        self._wait_latest([w for w in (pool.take_ready(slot) for slot in slots) if w is not None])

    def end_part(self, s: Stream, p: int) -> None:
        """Part ``p``'s kernels are queued: its buffer may be read into again after them."""
        ev = self.streams.event()
        ev.record(self.streams.current())
        s.freed[p % len(s.buffers)] = [ev]
        s.ended = p + 1

    def end_stream(self, s: Stream) -> None:
        """The call's kernels are queued: give back the reserved slots (empty) and the held
        experts. Each buffer's last read is its last part's kernels, so a read into a buffer the
        last parts did not use need not wait for them (a buffer no part used keeps its slots'
        last reads); a call that failed on the way gives every slot back after whatever it
        queued, once a part it never waited on has landed."""
        if s.ended < len(s.parts):
            self._wait_slots(s.pool, [slot for b in s.buffers for slot in b])
            ev = self.streams.event()
            ev.record(self.streams.current())
            s.freed = [[ev] for _ in s.buffers]
        for i, b in enumerate(s.buffers):
            ev = s.freed[i][0] if i < len(s.parts) or s.ended < len(s.parts) else None
            for slot in b:
                s.pool.end_read_at(slot, ev)
        # per slot: the last part that used it (a later one frees it later)
        self.last_parts[id(s.pool)] = {slot: p for p in range(len(s.parts)) for slot in s.slots(p)}
        self.release_all(s.held)

    # -- whole-layer calls -------------------------------------------------------------------
    WHOLE_LAYER_MISS = 1e-3  # a whole-layer call: each expert unrouted with chance at most this under uniform routing
    WHOLE_LAYER_ROWS = 1 << 17  # ... and at most this many (token, pick) rows: each part gathers up to T·k of them
    WHOLE_LAYER_USED = 0.9  # ... and the layer's last such call used at least this share of the warm experts it could
    # Whole-layer calls are counted at the next call that waits for its routing (or at stats),
    # after the last pooled layer's call of a forward is queued (``settle_after``), or, once this
    # many wait, as their rows land at a whole-layer call's start: on the H200, counting each at
    # the next one's start took 0.45 ms of a Qwen3-30B-A3B layer's 12 ms of host time
    # (prefill_split-*-whole.json), and counting 64 at once inside a 2048-token prefill, with
    # the rebalances they closed, made that prefill 5-39 ms slower (bench-qwen3_moe-run42.json).
    UNSETTLED_CALLS = 64

    def long_call(self, layer: int, tokens: int, top_k: int) -> bool:
        """A call long enough that, were routing uniform, every expert of ``layer`` would be routed
        to but with chance ``WHOLE_LAYER_MISS``: ``(1 - k/E)^T <= WHOLE_LAYER_MISS``."""
        n = self.manifest.layers[layer].layout.num_experts
        return (1 - top_k / n) ** tokens <= self.WHOLE_LAYER_MISS

    def whole_layer(self, layer: int, tokens: int, top_k: int) -> bool:
        """Whether a call of ``tokens`` tokens at ``layer`` goes as a whole-layer call (it still
        needs ``begin_stream`` to qualify): on, no routing trace recorded, not decode, more rows
        than a host-routed call and few enough for its gathers, a long call, and the layer's last
        long call used at least ``WHOLE_LAYER_USED`` of its warm experts (``used_share``; none
        yet: taken as all). Real routing is not uniform: a random-weight model's router sends a
        prompt's 2048 tokens to about 40% of Qwen3-30B-A3B's warm experts per layer, and reading
        them all moved 2.5 times the bytes (``bench-qwen3_moe-run17-ungated.md``)."""
        if not (self.whole_calls and self.streamed_calls) or self.recorded is not None or self.decoding:
            return False
        rows = tokens * top_k
        return (self.HOST_ROUTED_ROWS < rows <= self.WHOLE_LAYER_ROWS and self.long_call(layer, tokens, top_k)
                and self.used_share.get(layer, 1.0) >= self.WHOLE_LAYER_USED)

    def note_share(self, layer: int, experts: list[int], tokens: int, top_k: int) -> None:
        """After a long call at ``layer`` that used ``experts``: the share of the layer's experts
        not hot that it used, which decides whether its next long call reads them all."""
        if not self.long_call(layer, tokens, top_k):
            return
        n = self.manifest.layers[layer].layout.num_experts
        warm = [e for e in range(n) if not self.table[ExpertKey(layer, e)].pinned]
        used = set(experts)
        self.used_share[layer] = sum(e in used for e in warm) / len(warm) if warm else 1.0

    def defer_whole(self, s: Stream, rows: torch.Tensor, experts: list[int]) -> None:
        """A whole-layer call's kernels are queued: copy the rows routed to each of ``experts``
        (``rows``, on the device, in their order) to the host without a sync; ``settle`` counts
        the call."""
        w = s.whole
        w.experts = experts
        if rows.device.type == "cuda":
            w.rows = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            w.rows.copy_(rows, non_blocking=True)
        else:
            w.rows = rows.clone()
        w.done = self.streams.event()
        w.done.record(self.streams.current())
        self.unsettled.append(s)

    def settle_after(self, layer: int) -> None:
        """A whole-layer call at ``layer`` is queued: if it is the forward's last pooled layer
        (``settle_layer``), count the whole-layer calls whose rows have landed, without waiting.
        There the device still has that call's reads and kernels to run, so on a host ahead of it
        the counting (and the rebalances it closes) overlaps them, where inside the forward it
        would hold back the next layer's reads; what has not landed yet (usually this forward's
        calls) is counted at the next forward's end or earlier."""
        if layer == self.settle_layer:
            self.settle(block=False)

    def settle(self, block: bool = True) -> None:
        """Count the whole-layer calls whose rows per expert have reached the host, in call order:
        every one, waiting for them, when ``block`` (before any other call, and before stats)."""
        while self.unsettled:
            s = self.unsettled[0]
            if not block and not s.whole.done.query():
                return
            s.whole.done.synchronize()
            self.unsettled.popleft()
            self._count_whole(s)

    def _count_whole(self, s: Stream) -> None:
        """What a streamed call counts at once, for a settled whole-layer call: the cache policy's
        visit and lookups, the rebalancer's routing, the hits, the prediction's score; the
        experts it read that no row was routed to; and, as waste, read-aheads it took from the
        cache unused."""
        w, layer = s.whole, s.layer
        used = sorted(e for e, n in zip(w.experts, w.rows.tolist()) if n > 0)
        self.score_prediction(w.predicted, used)
        self.begin_call(layer, used, w.tokens)
        self.note_share(layer, used, w.tokens, w.top_k)
        lru, read = self.cache[id(s.pool)], set(w.read)
        for e in used:
            key = ExpertKey(layer, e)
            if e in w.took or e in read:
                lru.access(key)
            self.stats_.lookup("cpu" if e in read else "gpu")
            if w.took.get(e) is not None:
                self.stats_.prefetch_used += 1
        used_set = set(used)
        for e in read - used_set:
            self.stats_.unused_reads += 1
            self.stats_.unused_bytes += self.manifest.ref(ExpertKey(layer, e), self.cfg.cpu.precision).nbytes
        for e, nbytes in w.took.items():
            if e not in used_set and nbytes is not None:
                self.stats_.prefetch_wasted_bytes += nbytes  # read ahead, never used: as an eviction counts it
