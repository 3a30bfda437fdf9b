"""Streamed path: a call whose misses outgrow the free staging slots, read part by part, double buffered.

Owns the plan of one streamed call (``Stream``): every free staging slot is reserved (the table's
``reserve``), split into two buffers; the call's experts cached in them open the first parts
where they lie (no read); its misses fill the rest and go on in parts of a buffer each, in
host-pool order, so a part's copies lie back to back (``Staging.write_part``). Part ``p + 1``'s
reads are queued before part ``p``'s kernels, into the other buffer, after the kernels of the
part that last used it. Every row gets its part and slot as one sort key, uploaded once, so one
sort on the device orders the rows for every part, and each part's row range and windows come
from the host-side counts. At the end the slots go back to the cache holding their last part's
experts (the table saw every write).

Why: the host plans the call once, and each part then costs its copies and its grouped GEMMs.
On the H200 a part of 8 Qwen3-30B-A3B INT8 experts (0.77 ms of reading) had taken about 1.9 ms
of host work when each miss was claimed, staged and mapped one by one. The copy engine reads,
not the SMs: a 6-layer Qwen3 prefill through direct stacks took 78 and 82 ms in bf16 against 64
and 68 through the copy engine. Misses on disk are read on the serving thread into their
slot's ring buffer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tiers.loader.layout import ExpertKey
from tiers.paths import compute
from tiers.paths.routing import Routing
from tiers.store.pools import SlotPool
from tiers.store.table import Home

BUFFERS = 2  # three let the next layer's second part read during a call's tail, but cost a third more parts of host work:
# on the H200 a Qwen3-30B-A3B prefill was 1.25x and 1.48x its bound with three, 1.21x and 1.35x with two
KEY_END = 2**31 - 1  # the sort key of rows no part serves (the sentinel expert, unrouted ids)


@dataclass
class Whole:
    """What a whole-layer call looked up, counted once its routing is on the host (``paths.whole``)."""

    tokens: int
    top_k: int
    took: set[int] = field(default_factory=set)  # cached experts used in place
    read: list[int] = field(default_factory=list)  # experts read from the warm pool
    experts: list[int] = field(default_factory=list)  # the layer's experts, in the order of ``rows``
    rows: Any = None  # the rows routed to each (host, filled by a copy without a sync)
    done: Any = None  # recorded after that copy


@dataclass
class Stream:
    """One streamed call: what it holds and how its misses are split."""

    layer: int
    pool: SlotPool
    held: list  # Handles of the experts in hot slots (run first, or after a whole call's first parts)
    parts: list[list[int]]  # the call's other experts, part p in slots of buffers[p % len(buffers)]
    part_slots: list[list[int]]  # each part's slots, in the part's order
    buffers: tuple[list[int], ...]  # the reserved slots
    preloaded: frozenset[int]  # experts of the first parts already in their slot (no read)
    freed: list  # per buffer: the events its next reads wait on (its last readers' kernels)
    ended: int = 0  # parts whose kernels are queued
    whole: Whole | None = None

    def groups(self, num_experts: int) -> tuple[list[list[tuple[int, int]]], list[int]]:
        """The call's groups of (slot, expert) (group 0: the held experts; group p + 1: part p),
        and each expert id's sort key ``group * n_slots + slot`` (others: ``KEY_END``)."""
        n_slots = self.pool.n_slots
        groups = [[(h.slot, h.key.expert) for h in self.held]] + [list(zip(self.part_slots[p], part)) for p, part in enumerate(self.parts)]
        key_of = [KEY_END] * (num_experts + 1)
        for g, pairs in enumerate(groups):
            for slot, e in pairs:
                key_of[e] = g * n_slots + slot
        return groups, key_of


class StreamedPath:
    def __init__(self, mgr: Any):
        self.mgr = mgr
        self.last_parts: dict[int, dict[int, int]] = {}  # per pool: slot -> the last part of the last streamed call that used it

    # -- planning ------------------------------------------------------------------------------
    def plan(self, layer: int, experts: list[int], whole: Whole | None = None) -> Stream:
        """Reserve the free staging slots of ``layer``'s pool and split ``experts`` (ascending) into
        parts (see the module docstring); ``whole``: a whole-layer call's lookups, counted when
        it is settled (else each is counted now)."""
        mgr = self.mgr
        slots, table = mgr.slots, mgr.table
        slots.drain()  # read-aheads hold their slots until they land
        pool = mgr.pool_of[layer]
        rows = [table[ExpertKey(layer, e)] for e in experts]
        readers = table.readers(pool.index)
        free = [s for s in pool.staging if readers[s] == 0 and not table.reserved(pool.index, s)]
        n = min(BUFFERS, len(free))
        free_set = set(free)
        cached = {r.slot: e for e, r in zip(experts, rows) if r.slot in free_set}
        # in host-pool order (disk last): a part's reads then lie back to back as far as the pool allows
        misses = [e for _, e in sorted((r.host_offset if r.home is Home.CPU else 1 << 62, e) for e, r in zip(experts, rows) if r.slot is None)]
        ordered = sorted(free, key=lambda s: (s not in cached, s))  # cached slots fall in as few buffers as they can
        cut = [len(ordered) * i // n for i in range(n + 1)]
        buffers = [sorted(ordered[cut[i] : cut[i + 1]]) for i in range(n)]
        if whole:  # the first reads go into the buffers the last streamed call's last parts did not use
            last = self.last_parts.get(pool.index, {})
            buffers.sort(key=lambda b: max(last.get(s, -1) for s in b))
        resident = [ExpertKey(layer, e) for e, r in zip(experts, rows) if r.slot is not None and r.slot not in cached]  # hot ones
        held = [slots.hold_resident(k) for k in resident] if whole else [slots.acquire(k) for k in resident]
        parts, part_slots = self._split(buffers, cached, misses)
        compute_stream = mgr.streams.current()
        # a whole-layer call's first reads wait on its buffers' last readers only, so they may run
        # while the kernels queued before them (the layer's attention) do
        freed = [self._last_reads(pool, b) for b in buffers] if whole else None
        for s in ordered:
            if s in cached:
                self._take_cached(pool, s, whole)
            else:
                slots.reserve(pool, s, "stream", compute_stream)
        if freed is None:
            start = mgr.streams.event()
            start.record(compute_stream)  # after the slots' last readers and pending writes: the first reads wait on it
            freed = [[start] for _ in buffers]
        if whole is None and slots.recorded is not None:
            slots.recorded.extend(ExpertKey(layer, e) for part in parts for e in part if e not in cached.values())
        mgr.stats_.streamed_calls += 1
        mgr.stats_.whole_calls += bool(whole)
        return Stream(layer, pool, held, parts, part_slots, tuple(buffers), frozenset(cached[s] for s in ordered if s in cached), freed,
                      whole=whole)

    @staticmethod
    def _split(buffers: list[list[int]], cached: dict[int, int], misses: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Parts and their slots: each buffer's cached experts open its first part, misses fill the
        rest and go on in parts of a buffer each, round robin."""
        parts, part_slots = [], []
        for b in buffers:
            pre = [s for s in b if s in cached]
            rest = [s for s in b if s not in cached][: len(misses)]
            parts.append([cached[s] for s in pre] + misses[: len(rest)])
            part_slots.append(pre + rest)
            misses = misses[len(rest) :]
        while parts and not parts[-1]:
            parts.pop()  # buffers left empty
            part_slots.pop()
        while misses:
            b = buffers[len(parts) % len(buffers)]
            parts.append(misses[: len(b)])
            part_slots.append(b[: len(parts[-1])])
            misses = misses[len(b) :]
        return parts, part_slots

    def _last_reads(self, pool: SlotPool, slots: list[int]) -> list:
        """The distinct last-read events of ``slots``: a copy into them waits on these."""
        evs: list = []
        for slot in slots:
            ev = self.mgr.table.last_read(pool.index, slot)
            if ev is not None and not any(ev is e for e in evs):
                evs.append(ev)
        return evs

    def _take_cached(self, pool: SlotPool, slot: int, whole: Whole | None) -> None:
        """A cached expert of the call is used where it is: its slot is reserved with it and held
        (keeping the pending write its part waits on), and its lookup counted as a GPU hit now,
        or for a whole-layer call when it is settled."""
        mgr = self.mgr
        key = mgr.table.occupant(pool.index, slot)
        if whole is not None:
            whole.took.add(key.expert)
        else:
            mgr.caches[pool.index].access(key)
            mgr.stats_.lookup("gpu")
            if mgr.slots.recorded is not None:
                mgr.slots.recorded.append(key)
        mgr.table.reserve(pool.index, slot, "stream", keep=True)
        mgr.table.hold(pool.index, slot)

    # -- parts ---------------------------------------------------------------------------------
    def read_part(self, s: Stream, p: int) -> None:
        """Queue the reads of part ``p``'s misses into its buffer, after that buffer's last kernels."""
        mgr = self.mgr
        table, staging, pool = mgr.table, mgr.staging, s.pool
        reads = [(e, slot) for e, slot in zip(s.parts[p], s.part_slots[p]) if e not in s.preloaded]
        mgr.stats_.streamed_parts += 1
        if not reads:
            return
        for ev in s.freed[p % len(s.buffers)]:
            staging.copy_stream.wait_event(ev)
        with staging.batch():  # one batch: the part's stacks and ready events
            fetched = []
            for e, slot in reads:
                key = ExpertKey(s.layer, e)
                precision, source, src = staging.fetch(key, table[key], pool, slot)
                if s.whole is None:
                    mgr.caches[pool.index].access(key)  # the policy counts every lookup
                    mgr.stats_.lookup(source)
                else:
                    s.whole.read.append(e)
                table.stage(key, pool.index, slot, by="stream")
                fetched.append((key, precision, source, src, slot))
            blob = mgr.manifest.blob(fetched[0][0], fetched[0][1])
            warm = all(source == "cpu" and mgr.manifest.blob(key, precision) is blob for key, precision, source, _, _ in fetched)  # one layout
            if not (warm and staging.write_part(pool, blob, [f[4] for f in fetched], [f[3] for f in fetched])):
                for key, precision, source, src, slot in fetched:
                    staging.write(key, pool, slot, precision, source, src, direct_ok=False)
        table.hold_many(pool.index, [slot for _, slot in reads])

    def wait_part(self, s: Stream, p: int) -> None:
        """Order the compute stream after part ``p``'s reads; call before its first kernel."""
        self.mgr.slots.wait_pending(self.mgr.table.take_ready_many(s.pool.index, s.part_slots[p]))

    def end_part(self, s: Stream, p: int) -> None:
        """Part ``p``'s kernels are queued: its buffer may be read into again after them."""
        ev = self.mgr.streams.event()
        ev.record(self.mgr.streams.current())
        self.mgr.table.release_many(s.pool.index, s.part_slots[p], ev)
        s.freed[p % len(s.buffers)] = [ev]
        s.ended = p + 1

    def end(self, s: Stream) -> None:
        """The call's kernels are queued: the reserved slots go back to the cache with what they
        hold, and the hot experts are released. A call that failed on the way first gives back
        the parts it held, once what it queued into them has landed."""
        mgr, table, pi = self.mgr, self.mgr.table, s.pool.index
        if s.ended < len(s.parts):
            held = [slot for slot in {x for p in range(s.ended, len(s.parts)) for x in s.part_slots[p]} if table.readers(pi)[slot]]
            mgr.slots.wait_pending(table.take_ready_many(pi, held))
            ev = mgr.streams.event()
            ev.record(mgr.streams.current())
            table.release_many(pi, held, ev)
            s.freed = [[ev] for _ in s.buffers]
        for i, b in enumerate(s.buffers):
            ev = s.freed[i][0] if s.freed[i] and (i < len(s.parts) or s.ended < len(s.parts)) else None
            for slot in b:
                table.unreserve(pi, slot, "stream", ev, keep=True)
        self.last_parts[pi] = {slot: p for p in range(len(s.parts)) for slot in s.part_slots[p]}
        mgr.slots.release_all(s.held)

    def run_parts(self, s: Stream, run, held_after: int) -> None:
        """Queue the call's kernels, ``run(g)`` for group ``g`` (0: the held experts, p + 1: part p),
        the first parts' reads (one per buffer) already queued: before part p's kernels, part
        p + n - 1's reads are queued into the buffer of part p - 1 (n buffers); the held experts'
        kernels follow part ``held_after`` (-1: first)."""
        n = len(s.buffers)
        if held_after < 0:
            self.mgr.slots.wait_all(s.held)
            run(0)
        for p in range(len(s.parts)):
            if p > 0 and p + n - 1 < len(s.parts):
                self.read_part(s, p + n - 1)  # into part p - 1's buffer, after its kernels
            self.wait_part(s, p)
            run(p + 1)
            self.end_part(s, p)
            if p == held_after:
                self.mgr.slots.wait_all(s.held)
                run(0)

    # -- the call ------------------------------------------------------------------------------
    def run(self, module: torch.nn.Module, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor, routing: Routing) -> torch.Tensor:
        """A streamed call whose routing the host knows (its rows per expert): one device sort of
        every row by ``group * n_slots + slot``, then each part's windows."""
        mgr = self.mgr
        s = self.plan(layer, routing.hit)
        try:
            for p in range(min(len(s.buffers), len(s.parts))):  # the first parts' reads: queued while the host plans the rest
                self.read_part(s, p)
            n_slots, k, counts = s.pool.n_slots, top_k_index.shape[-1], routing.counts
            groups, key_of = s.groups(module.num_experts)
            wins = [compute.windows(sorted((slot, counts[e]) for slot, e in g if counts[e])) for g in groups]
            key_map, *offsets = mgr.uploads.int_lists([key_of] + [[o for w in ws for o in w["offs"]] for ws in wins])
            sorted_keys, order = torch.sort(key_map[top_k_index.reshape(-1)], stable=True)  # [T*k]
            routed = sum(counts[e] for e in routing.hit)
            order = order[:routed]  # rows by (part, slot)
            xs = hidden_states[order // k]  # [routed, H]
            slot_ids = sorted_keys[:routed] % n_slots if module.has_bias else None  # [routed], for biases
            px = compute.proxy(module, s.pool.slabs, n_slots)
            outs, row = [], 0

            def run(i: int) -> None:
                nonlocal row
                if not wins[i]:
                    return
                m = wins[i][-1]["b"]
                outs.append(compute.run_windows(px, xs[row : row + m], wins[i], offsets[i], None if slot_ids is None else slot_ids[row : row + m]))
                row += m

            self.run_parts(s, run, held_after=-1)
            y = (outs[0] if len(outs) == 1 else torch.cat(outs)) * top_k_weights.reshape(-1)[order].unsqueeze(-1)  # [routed, H]
            out = torch.zeros(top_k_index.numel(), y.shape[-1], dtype=y.dtype, device=y.device).index_copy_(0, order, y)  # [T*k, H]
            return out.view(-1, k, y.shape[-1]).sum(dim=1).to(hidden_states.dtype)
        finally:
            self.end(s)
