"""Whole-layer path: a prefill call long enough to route to every expert, read whole without a host sync.

Owns the decision's statistics (the share of its warm experts a layer's last long call used),
the call's plan, and the deferred counting of such calls. A call so long that uniform routing
would route to every expert of its layer but with a tiny chance, at a layer whose last long call
used nearly all its warm experts, need not wait for its routing on the host: every warm expert of
the layer is streamed through the reserved slots (``paths.streamed``, in expert order), the rows
are sorted and each part's row range found on the device, and the host queues the call without a
sync, running ahead into the next layers while the GPU computes.

The plan (``Plan``) is made on the host from the slots alone: every expert's rows get the sort
key ``group * n_slots + slot``, and the call's bounds are those keys for every group and slot in
a fixed order, so one ``searchsorted`` gives every slot's first row and a window's bounds depend
on its own group and first slot alone. Where a call's shapes and slots recur, the plan and each
window replay as CUDA graphs (``Manager.prefill_graphs``).

A whole-layer call's lookups are counted later, in call order, once its rows per expert have
reached the host (``settle``): before any other call counts, after the forward's last pooled
layer (without waiting), or once ``UNSETTLED_CALLS`` wait. Experts read that no row was routed
to are counted as read in vain.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from tiers.loader.layout import ExpertKey
from tiers.store.table import Home
from tiers.paths import compute
from tiers.paths.routing import HOST_ROUTED_ROWS
from tiers.paths.streamed import Stream, StreamedPath, Whole

MISS = 1e-3  # a whole-layer call: each expert unrouted with chance at most this under uniform routing
ROWS = 1 << 17  # ... and at most this many (token, pick) rows: each part gathers up to T*k of them
USED = 0.9  # ... and the layer's last such call used at least this share of the warm experts it could
# On the H200, counting each call at the next one's start took 0.45 ms of a Qwen3-30B-A3B layer's
# 12 ms of host time; counting 64 at once inside a 2048-token prefill made it 5-39 ms slower.
UNSETTLED_CALLS = 64


@dataclass
class Plan:
    key_of: list[int]  # expert id (sentinel included) -> sort key
    n_groups: int
    segments: list[tuple[int, int, int, int]]  # (group, lo, hi, index of its first bound), in group order
    ends: list[tuple[int, int]]  # (expert, index of the bound its rows end at; they start at the one before)

    @classmethod
    def of(cls, s: Stream, num_experts: int) -> Plan:
        span = s.pool.n_slots + 1  # bounds per group
        groups, key_of = s.groups(num_experts)
        segments, ends = [], []
        for g, pairs in enumerate(groups):
            expert_at = dict(pairs)  # slot -> expert
            for lo, hi in compute.slot_runs(sorted(expert_at)):
                segments.append((g, lo, hi, g * span + lo))
            ends.extend((e, g * span + slot + 1) for slot, e in pairs)
        return cls(key_of, len(groups), segments, ends)


class WholePath:
    def __init__(self, mgr: Any, streamed: StreamedPath):
        self.mgr, self.streamed = mgr, streamed
        self.used_share: dict[int, float] = {}  # per layer: the share of its warm experts its last long call used
        self.unsettled: deque[Stream] = deque()  # calls not yet counted, in call order
        self.outs: dict[tuple, torch.Tensor] = {}  # their summed outputs' buffers, by shape (the last two)
        layers = [L for L in mgr.manifest.layers if not mgr.resident.qualifies(L)]
        self.last_layer = max(layers, default=None)  # after its call, the calls whose rows landed are counted

    # -- the decision --------------------------------------------------------------------------
    def long_call(self, layer: int, tokens: int, top_k: int) -> bool:
        """Were routing uniform, every expert of ``layer`` would be routed to but with chance ``MISS``."""
        n = self.mgr.manifest.layers[layer].layout.num_experts
        return (1 - top_k / n) ** tokens <= MISS

    def qualifies(self, layer: int, tokens: int, top_k: int) -> bool:
        """More rows than a host-routed call and few enough for its gathers, a long call, and the
        layer's last long call used at least ``USED`` of its warm experts (none yet: taken as all).
        Real routing is not uniform: a random-weight router sends a 2048-token prompt to about 40%
        of Qwen3-30B-A3B's warm experts per layer, and reading them all moved 2.5 times the bytes."""
        rows = tokens * top_k
        return HOST_ROUTED_ROWS < rows <= ROWS and self.long_call(layer, tokens, top_k) and self.used_share.get(layer, 1.0) >= USED

    def note_share(self, layer: int, experts: list[int], tokens: int, top_k: int) -> None:
        """After a long call at ``layer`` that used ``experts``: the share of the layer's experts not
        hot that it used, which decides whether its next long call reads them all."""
        if not self.long_call(layer, tokens, top_k):
            return
        table, n = self.mgr.table, self.mgr.manifest.layers[layer].layout.num_experts
        warm = [e for e in range(n) if not table[ExpertKey(layer, e)].hot]
        used = set(experts)
        self.used_share[layer] = sum(e in used for e in warm) / len(warm) if warm else 1.0

    # -- the call ------------------------------------------------------------------------------
    def _out(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The buffer a call's windows write their rows into: one per shape, kept for the graphs
        that write it while its shape recurs (the last two shapes)."""
        if not self.mgr.prefill_graphs.enabled:
            return torch.empty(shape, dtype=dtype, device=device)
        key = (shape, dtype)
        out = self.outs.pop(key, None)
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=device)
            while len(self.outs) >= 2:
                self.outs.pop(next(iter(self.outs)))
        self.outs[key] = out  # the most recent last
        return out

    def run(self, module: torch.nn.Module, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor) -> torch.Tensor:
        """Each window gathers its rows into a buffer of ``T * min(k, slots)`` rows (a token's picks
        are distinct), whose grouped GEMMs run over the rows its device-side offsets cover; rows
        past them go to a spare output row. The held experts run after parts 0 and 1, whose reads
        were queued first, so the copy engine reads part 2 while they run."""
        mgr = self.mgr
        if len(self.unsettled) >= UNSETTLED_CALLS:
            self.settle(block=False)
        T, k = top_k_index.shape
        s = self.streamed.plan(layer, list(range(module.num_experts)), whole=Whole(T, k))
        plan = Plan.of(s, module.num_experts)
        done = False
        try:
            firsts = [f for *_, f in plan.segments]
            lasts = [f + hi - lo for _, lo, hi, f in plan.segments]
            # the plan goes up on the copy stream ahead of the parts' reads: on the compute stream it
            # would wait for the copy engine to finish the first parts' reads
            uploaded = mgr.uploads.int_lists([plan.key_of, firsts, lasts, [i for _, i in plan.ends]], on=mgr.staging.copy_stream)
            for p in range(min(len(s.buffers), len(s.parts))):
                self.streamed.read_part(s, p)
            out = self._out((T * k + 1, hidden_states.shape[-1]), torch.promote_types(s.pool.dtype, top_k_weights.dtype),
                            hidden_states.device)  # [T*k + 1, H] as the GEMMs' rows times their weights
            routed = self._windows(module, s, plan, uploaded, out, top_k_index, top_k_weights, hidden_states)
            done = True
            return out[: T * k].view(T, k, -1).sum(dim=1).to(hidden_states.dtype)
        finally:
            self.streamed.end(s)
            if done:
                self._defer(s, routed, [e for e, _ in plan.ends])

    def _windows(self, module, s: Stream, plan: Plan, uploaded: list, out: torch.Tensor, top_k_index, top_k_weights,
                 hidden_states) -> torch.Tensor:
        """Queue the plan's kernels and every window's (graphs where they recur); the rows routed
        to each expert, in ``plan.ends``' order, on the device."""
        graphs = self.mgr.prefill_graphs
        T, k = top_k_index.shape
        n_slots, rows_n, layer, has_bias, span = s.pool.n_slots, T * k, s.layer, module.has_bias, s.pool.n_slots + 1
        n_bounds = plan.n_groups * span
        cap = T * min(k, max(hi - lo for _, lo, hi, _ in plan.segments))

        def plan_step(key_map, first_at, last_at, end_at, top_k_index, top_k_weights, hidden_states):
            sorted_keys, order = torch.sort(key_map[top_k_index.reshape(-1)], stable=True)  # [T*k]
            u = torch.arange(n_bounds, device=sorted_keys.device)  # bound g * span + s is key g * n_slots + s
            at = torch.searchsorted(sorted_keys, (u - u // span).to(sorted_keys.dtype))  # [U] rows before each bound
            # per bound: its window's first bound (the last first at or before it), and its rows' end from that window's first row
            first = torch.zeros(n_bounds, dtype=torch.bool, device=u.device).index_fill_(0, first_at.long(), True)
            base = torch.where(first, u, 0).cummax(0).values
            offs = (at - at[base]).to(torch.int32)  # [U]
            routed = at[end_at] - at[end_at - 1]  # [E] rows per expert, in plan.ends' order
            pos = at[first_at].unsqueeze(1) + torch.arange(cap, device=at.device)  # [S, cap] sorted row of each buffer row
            valid = pos < at[last_at].unsqueeze(1)
            src = order[pos.clamp_(max=rows_n - 1)]  # [S, cap] flat (token, pick) row
            dest = torch.where(valid, src, rows_n)  # rows past the window's -> the spare row
            tok = torch.div(src, k, rounding_mode="floor")  # [S, cap]
            weights = top_k_weights.reshape(-1)[src].unsqueeze(-1)  # [S, cap, 1]
            out.zero_()
            got = (hidden_states, routed, offs, tok, weights, dest)
            return got + (sorted_keys[pos] % n_slots,) if has_bias else got

        # the plan's outputs (and the hidden states) are a graph's static tensors once it replays, which the windows' graphs bind
        planned = graphs.run(("whole_plan", layer, cap, n_slots, plan.n_groups), (out,), plan_step,
                             (*uploaded, top_k_index, top_k_weights, hidden_states), fresh=False)
        xs_all, routed, offs, tok, weights, dest = planned[:6]
        slot_ids = planned[6] if has_bias else None
        px = compute.proxy(module, s.pool.slabs, n_slots)
        bound = (xs_all, offs, tok, weights, dest, out, slot_ids, *s.pool.slabs.values())
        by_group: dict[int, list[int]] = {}
        for j, (g, *_) in enumerate(plan.segments):
            by_group.setdefault(g, []).append(j)

        def window_step(j: int, lo: int, hi: int, f: int, c: int):
            xs = xs_all[tok[j, :c]]  # [c, H]
            y = compute.run_windows(px, xs, [{"lo": lo, "hi": hi, "a": 0, "b": c}], offs[f + 1 : f + 1 + hi - lo],
                                    None if slot_ids is None else slot_ids[j, :c])
            out.index_copy_(0, dest[j, :c], y * weights[j, :c])
            return out[:0]  # nothing of its own: a graph keeps its outputs, and y is [c, H]

        def run(g: int) -> None:
            for j in by_group.get(g, ()):
                _, lo, hi, f = plan.segments[j]
                c = T * min(k, hi - lo)
                graphs.run(("whole_window", layer, j, lo, hi, f, c), bound, lambda j=j, lo=lo, hi=hi, f=f, c=c: window_step(j, lo, hi, f, c), (),
                           fresh=False)

        self.streamed.run_parts(s, run, held_after=min(1, len(s.parts) - 1))
        return routed

    # -- counting --------------------------------------------------------------------------------
    def _defer(self, s: Stream, rows: torch.Tensor, experts: list[int]) -> None:
        """Copy the rows routed to each of ``experts`` to the host without a sync; ``settle`` counts the call."""
        w = s.whole
        w.experts = experts
        if rows.device.type == "cuda":
            w.rows = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            w.rows.copy_(rows, non_blocking=True)
        else:
            w.rows = rows.clone()
        w.done = self.mgr.streams.event()
        w.done.record(self.mgr.streams.current())
        self.unsettled.append(s)
        if s.layer == self.last_layer:
            # the forward's last pooled layer: count what has landed without waiting, overlapping the
            # device's last reads and kernels (inside the forward it would hold back the next layer's reads)
            self.settle(block=False)

    def settle(self, block: bool = True) -> None:
        """Count the calls whose rows per expert have reached the host, in call order: every one,
        waiting for them, when ``block`` (before any other call counts, and before stats)."""
        while self.unsettled:
            s = self.unsettled[0]
            if not block and not s.whole.done.query():
                return
            s.whole.done.synchronize()
            self.unsettled.popleft()
            self._count(s)

    def _count(self, s: Stream) -> None:
        """What a host-routed call counts at once: the cache's visit and lookups, the rebalancer's
        routing, the hits; and the experts read that no row was routed to."""
        mgr, w, layer = self.mgr, s.whole, s.layer
        used = sorted(e for e, n in zip(w.experts, w.rows.tolist()) if n > 0)
        mgr.count_call(layer, used, w.tokens, prefill=True)
        self.note_share(layer, used, w.tokens, w.top_k)
        cache, read, stats = mgr.caches[s.pool.index], set(w.read), mgr.stats_
        for e in used:
            key = ExpertKey(layer, e)
            if e in w.took or e in read:
                cache.access(key)
            stats.lookup(mgr.table[key].home.value if e in read else "gpu")  # a quantized hot expert read is a gpu hit
        for e in read.difference(used):
            r = mgr.table[ExpertKey(layer, e)]
            if r.home is not Home.GPU:  # read in vain over PCIe (a quantized hot one moved no bytes)
                stats.unused_reads += 1
                stats.unused_bytes += mgr.manifest.ref(ExpertKey(layer, e), mgr.staging.precision_of(r)).nbytes
