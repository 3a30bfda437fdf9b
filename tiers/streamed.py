"""Streamed calls: a long layer call (a prompt's prefill) whose warm misses outnumber what half
the free staging slots hold, read part by part into reserved slots, double buffered.

Owns: the reservation of a pool's unheld staging slots for one call, the reads of each part's
misses into one half of them, and the events that order those reads against the part before
last's kernels. A mixin of the tier manager, like ``Prefetcher`` and ``DirectDecoder``.

Why: the general path for such a call (``integration._grouped_in_parts``) claims each part's
slots through the cache policy, stages each miss, and maps and sorts the part's rows on the
device, all on the host, part after part. On the H200, a part of 8 Qwen3-30B-A3B experts
(INT8, 38 MB, 0.77 ms of reading) took about 1.9 ms of host work under the profiler, so the
reads waited on the host. Here the host plans the whole call once: the experts in hot slots
run first, the call's experts cached in the reserved slots open parts 0 and 1 where they lie
(no read), the misses fill those parts and go on in parts of half the reserved slots, every row gets
its part and slot as one sort key (one upload, one sort on the device), and each part then
costs its copies and its grouped GEMMs: a copy per bf16 expert, or for small INT8 experts one
copy per run of blobs back to back in the host pool and one stacked dequantization. Part ``p + 1``'s reads are
queued before part ``p``'s kernels, into the other half, after part ``p - 1``'s kernels.
The copy engine reads, not the SMs (``stream_direct`` off): the GEMMs of a long call need the
SMs. On the H200 a 6-layer Qwen3 prefill through direct stacks took 78 and 82 ms in bf16
against 64 and 68 through the copy engine, in two runs; in INT8 46 against 42, then 64 against
66 (``bench/results/prefill_ab-qwen3_moe*.json``).

Reserved slots hold no cache: a miss is read into a slot the residency table never sees, a
cached expert used in place leaves the cache, and each half goes back empty, with the event
recorded after its last part's kernels, when the call ends. Misses on disk leave the
call to the general path, which reads them on the reader threads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import quant
from loader.layout import ExpertKey
from tiers.residency import Home


@dataclass
class Stream:
    """One streamed call: what it holds and how its misses are split."""

    layer: int
    pool: Any
    held: list  # Handles of the experts resident in hot or otherwise held slots (run first)
    parts: list[list[int]]  # the call's other experts, part p in slots of halves[p % 2]
    part_slots: list[list[int]]  # each part's slots, in the part's order
    halves: tuple[list[int], list[int]]  # the reserved slots
    preloaded: frozenset[int]  # experts of parts 0 and 1 whose bytes are in their slot already (no read)
    freed: list = field(default_factory=list)  # per half: the event its last reader's kernels were queued before
    ended: int = 0  # parts whose kernels are queued (end_part)

    def slots(self, p: int) -> list[int]:
        """The slots part ``p``'s experts are in (or read into), in the part's order."""
        return self.part_slots[p]


class StreamedCalls:
    """Mixed into ``TierManager``: uses its table, pools, cache, staging helpers, streams and stats."""

    STREAM_AHEAD_COVERAGE = 0.9  # expected share of a layer's experts a call must hit for stage_ahead

    def begin_stream(self, layer: int, experts: list[int]) -> Stream | None:
        """Plan a streamed call of ``experts`` (ascending) and reserve its slots; None when the
        call does not qualify (a miss on disk, a routing trace recorded, fewer than two free
        staging slots, or misses that fit half of them), holding nothing then.

        Every unheld staging slot is reserved and split into two halves. The call's experts
        cached in those slots (read ahead by lookahead, or left by an earlier call) stay where
        they are, without a read: they open parts 0 and 1 in the half their slot is in, and leave
        the cache (reserved slots hold none). The misses fill those parts' other slots, then go in
        parts of a half each. Experts in hot or otherwise held slots are held and run first."""
        if not self.streamed_calls or self.recorded is not None:
            return None
        self.drain()  # read-aheads hold their slots until they land (or fail, leaving their expert out)
        pool = self.pool_of[layer]
        rows = [self.table[ExpertKey(layer, e)] for e in experts]
        if any(r.slot is None and r.home is not Home.CPU for r in rows):
            return None
        hot = self.hot_count[id(pool)]
        free = [s for s in range(hot, pool.n_slots) if pool.readers[s] == 0]
        half = len(free) // 2
        cached = {r.slot: e for e, r in zip(experts, rows) if r.slot is not None and r.slot >= hot and pool.readers[r.slot] == 0}
        misses = [e for e, r in zip(experts, rows) if r.slot is None]
        if half < 1 or len(misses) <= half:
            return None
        # the cached experts' slots first, so they fall in as few halves as the count allows
        ordered = sorted(free, key=lambda s: (s not in cached, s))[: 2 * half]
        halves = (sorted(ordered[:half]), sorted(ordered[half:]))
        misses += [e for slot, e in cached.items() if slot not in ordered]  # an odd slot out: read again
        held = [self.try_acquire(ExpertKey(layer, e)) for e, r in zip(experts, rows) if r.slot is not None and r.slot not in cached]
        compute = self.streams.current()
        parts, part_slots = [], []
        for h in halves:
            pre = [s for s in h if s in cached]
            for s in pre:
                self._take_cached(pool, s)
            rest = [s for s in h if s not in cached][: len(misses)]
            parts.append([cached[s] for s in pre] + misses[: len(rest)])
            part_slots.append(pre + rest)
            misses = misses[len(rest) :]
        while misses:
            h = halves[len(parts) % 2]
            parts.append(misses[: len(h)])
            part_slots.append(h[: len(parts[-1])])
            misses = misses[len(h) :]
        for s in ordered:
            if s in cached:
                pool.hold(s)  # its expert, used in place, keeps the ready event its part waits on
            else:
                self.reserve_slot(pool, s, compute)
        start = self.streams.event()
        start.record(compute)  # after the slots' last readers and pending writes: the first reads wait on it
        assert all(parts), "more misses than half the slots: parts 0 and 1 both serve some"
        self.stats_.streamed_calls += 1
        return Stream(layer, pool, held, parts, part_slots, halves, frozenset(cached[s] for s in ordered if s in cached), [start, start])

    def _take_cached(self, pool: Any, slot: int) -> None:
        """A cached expert of a streamed call is used where it is, and leaves the cache: counted as
        a lookup served from the GPU (a used read-ahead), as ``try_acquire`` would count it."""
        key = pool.owner[slot]
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
        """Queue the reads of part ``p``'s misses into its half, after that half's last kernels."""
        pool, lru = s.pool, self.cache[id(s.pool)]
        reads = [(e, slot) for e, slot in zip(s.parts[p], s.slots(p)) if e not in s.preloaded]
        self.stats_.streamed_parts += 1
        if not reads:
            return
        self.copy_stream.wait_event(s.freed[p % 2])
        assert self._batch is None, "a streamed part is read inside another staging batch"
        with self.staging():  # one batch: the part's stacks and ready events
            fetched = []
            for e, slot in reads:
                key = ExpertKey(s.layer, e)
                lru.access(key)  # the policy counts every lookup
                fetched.append((key, *self._fetch(key, self.table[key], pool, slot)))
                self.stats_.lookup(fetched[-1][2])
            slots = [slot for _, slot in reads]
            blob = self.manifest.blob(fetched[0][0], fetched[0][1])
            if all(source == "cpu" for _, _, source, _ in fetched) and self._runs_copy(pool, blob):
                self._stage_copy_run(self._batch, pool, blob, slots, [src for *_, src in fetched])
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

    def wait_part(self, s: Stream, p: int) -> None:
        """Order the compute stream after part ``p``'s reads; call before its first kernel."""
        self._wait_slots(s.pool, s.slots(p))

    def _wait_slots(self, pool: Any, slots: list[int]) -> None:
        """Order the compute stream after the pending writes of held ``slots`` (one wait per stream)."""
        self._wait_latest([w for w in (pool.take_ready(slot) for slot in slots) if w is not None])

    def end_part(self, s: Stream, p: int) -> None:
        """Part ``p``'s kernels are queued: its half may be read into again after them."""
        ev = self.streams.event()
        ev.record(self.streams.current())
        s.freed[p % 2] = ev
        s.ended = p + 1

    def end_stream(self, s: Stream) -> None:
        """The call's kernels are queued: give back the reserved slots (empty) and the held
        experts. Each half's last read is its last part's kernels, so a read into the half the
        last part did not use need not wait for that part; a call that failed on the way gives
        every slot back after whatever it queued, once a part it never waited on has landed."""
        if s.ended < len(s.parts):
            self._wait_slots(s.pool, s.halves[0] + s.halves[1])
            ev = self.streams.event()
            ev.record(self.streams.current())
            s.freed = [ev, ev]
        for half, ev in zip(s.halves, s.freed):
            for slot in half:
                s.pool.end_read_at(slot, ev)
        self.release_all(s.held)
