"""The Triton kernel behind ``quant.direct.fetch`` (imported only where Triton is present).

Grid: (picks, blocks): program (j, b) decodes block ``b`` of pick ``j``'s expert, the blocks of
the expert's tensors one after another; programs of resident picks only look the pick up.
Program (j, 0) also writes ``ids[j]`` and counts the pick (and its expert, with ``usage``).
Measured on an H200 (PCIe 5 x16), reading INT8 experts of Qwen3-30B-A3B shapes this way moves
46-47 GB/s for 4 experts and 50 GB/s for 32, against 55 GB/s for one large copy-engine copy
(``experiments/zero_copy_probe.py``). Launches after the first two of a specialization skip Triton's
per-call dispatch (``quant.launch``).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .direct import BLOCK, MAX_BLOCKS
from .launch import triton_relauncher

WARPS = 8


@triton.jit
def _block(src, data, scale, out, b, n, cols, QUANT: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr):
    i = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    if QUANT:
        q = tl.load((src + data).to(tl.pointer_type(tl.int8)) + i, mask=m, other=0)
        if COLS:  # a scale per column: element i's is i % cols
            s = tl.load((src + scale).to(tl.pointer_type(tl.float32)) + i % cols, mask=m, other=0.0)
        else:  # a scale per row
            s = tl.load((src + scale).to(tl.pointer_type(tl.float32)) + i // cols, mask=m, other=0.0)
        v = (q.to(tl.float32) * s).to(tl.bfloat16)
    else:
        v = tl.load((src + data).to(tl.pointer_type(tl.bfloat16)) + i, mask=m, other=0.0)
    tl.store(out + i, v, mask=m)


@triton.jit
def pick(j, b, picks, resident, dst, ids, counts, usage, USAGE: tl.constexpr, PLANNED: tl.constexpr):
    """Pick ``j``'s expert, its slot and whether program (j, b) decodes into it; program (j, 0)
    of an unplanned launch also writes ``ids[j]`` and counts the pick (shared by the 4-bit kernel)."""
    e = tl.load(picks + j)
    if PLANNED:  # ``plan`` decided: decode into dst[j] when it is a slot; resident, ids, counts unused
        slot = tl.load(dst + j).to(tl.int64)
        go = slot >= 0
    else:
        r = tl.load(resident + e)
        slot = tl.where(r >= 0, r, tl.load(dst + j)).to(tl.int64)
        go = r < 0
        if b == 0:
            tl.store(ids + j, slot)
            tl.atomic_add(counts + (r < 0).to(tl.int32), 1)
            if USAGE:
                tl.atomic_add(usage + e, 1)
    return e, slot, go


@triton.jit
def base_of(src, dev, starts, e):
    """Where expert ``e``'s blob starts: ``src`` plus its start, or, for a negative start, ``dev``
    plus ``-1 - start`` (``quant.direct``'s two sources); a multiple of 16 bytes."""
    st = tl.load(starts + e)
    # blobs start 4 KiB apart in both pools: telling the compiler lets it read and write in vectors
    return tl.multiple_of(tl.where(st >= 0, src + st, dev + (-1 - st)), 16)


@triton.jit
def _fetch(src, dev, starts, resident, picks, dst, ids, counts, usage,
           out0, d0, s0, n0, c0, nb0,
           out1, d1, s1, n1, c1, nb1,
           out2, d2, s2, n2, c2,
           QUANT: tl.constexpr, COLS: tl.constexpr, USAGE: tl.constexpr, PLANNED: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    b = tl.program_id(1)
    e, slot, go = pick(j, b, picks, resident, dst, ids, counts, usage, USAGE, PLANNED)
    if go:
        base = base_of(src, dev, starts, e)
        if b < nb0:
            _block(base, d0, s0, out0 + slot * n0, b, n0, c0, QUANT, COLS, BLOCK)
        elif b < nb0 + nb1:
            _block(base, d1, s1, out1 + slot * n1, b - nb0, n1, c1, QUANT, COLS, BLOCK)
        else:
            _block(base, d2, s2, out2 + slot * n2, b - nb0 - nb1, n2, c2, QUANT, COLS, BLOCK)


class _Plan:
    """What a launch over one expert's tensors keeps: the arguments that never change (slabs,
    offsets, sizes), the blocks per pick, and the relauncher for the kernel's specializations."""

    def __init__(self, tensors):
        self.fixed, self.blocks = [], 0
        for i in range(3):
            t = tensors[min(i, len(tensors) - 1)]
            n = math.prod(t.out.shape[1:])
            nb = triton.cdiv(n, BLOCK) if i < len(tensors) else 0
            self.blocks += nb
            self.fixed += [t.out, t.data, t.scale or 0, n, t.out.shape[-1]] + ([nb] if i < 2 else [])
        if self.blocks > MAX_BLOCKS:
            raise ValueError(f"direct fetch: an expert of {self.blocks} blocks of {BLOCK} elements, at most {MAX_BLOCKS} fit one launch")
        encodings = {t.encoding for t in tensors}
        if len(encodings) != 1:
            raise ValueError(f"direct fetch: one launch decodes tensors of one encoding, got {sorted(encodings)}")
        self.quant, cols = tensors[0].encoding
        kw = dict(QUANT=self.quant, COLS=cols, BLOCK=BLOCK, num_warps=WARPS)
        self.relaunch = {usage: triton_relauncher(_fetch, dict(kw, USAGE=usage, PLANNED=False)) for usage in (False, True)}
        self.relaunch["planned"] = triton_relauncher(_fetch, dict(kw, USAGE=False, PLANNED=True))


def plan_of(tensors, make=None):
    """The launch plan of ``tensors`` (``make(tensors)``, this module's ``_Plan`` by default), made
    once for a ``DirectExpert``, which keeps it."""
    plan = getattr(tensors, "launch_plan", None)
    if plan is None:
        plan = (make or _Plan)(tensors)
        if hasattr(tensors, "launch_plan"):  # a DirectExpert keeps it
            tensors.launch_plan = plan
    return plan


def launch_key(tensors) -> tuple:
    """What decides Triton's compiled kernel among the arguments that vary: dtypes and 16-byte alignment."""
    return tuple((t.dtype, t.data_ptr() & 15 == 0) for t in tensors)


def launch(src: torch.Tensor, dev: torch.Tensor, starts: torch.Tensor, resident: torch.Tensor, picks: torch.Tensor, dst: torch.Tensor,
           ids: torch.Tensor, counts: torch.Tensor, tensors, usage: torch.Tensor | None) -> None:
    plan = plan_of(tensors)
    dynamic = (src, dev, starts, resident, picks, dst, ids, counts, counts if usage is None else usage)
    plan.relaunch[usage is not None]((picks.numel(), plan.blocks), (*dynamic, *plan.fixed), launch_key(dynamic))


def launch_planned(src: torch.Tensor, dev: torch.Tensor, starts: torch.Tensor, picks: torch.Tensor, dst: torch.Tensor, tensors) -> None:
    plan = plan_of(tensors)
    # the unused resident, ids, counts and usage get tensors of their dtypes
    dynamic = (src, dev, starts, dst, picks, dst, starts, starts, starts)
    plan.relaunch["planned"]((picks.numel(), plan.blocks), (*dynamic, *plan.fixed), launch_key(dynamic))


@triton.jit(do_not_specialize=["m", "row", "rows", "width"])
def _plan_picks(picks, m, resident, slots, owner, stamp, clock, ids, dst, counts, usage, row, rows, width,
                R: tl.constexpr, RP: tl.constexpr, USAGE: tl.constexpr, DEV: tl.constexpr):
    """One program: the picks in order, the cache's lanes as a vector (``quant.direct.plan``).

    Every global read happens before the loop (the picks, their resident slots, the cache) and
    every write after it: the loop is register work only. A load inside it puts its memory latency
    on the critical path once per pick: on the H200, 8 picks over 16 lanes took 11.6 us a call
    that way and take 7.9 now (``experiments/results/plan_probe.json``)."""
    lane = tl.arange(0, RP)
    live = lane < R
    own = tl.load(owner + lane, mask=live, other=-1)
    stp = tl.load(stamp + lane, mask=live, other=0)
    slot_of = tl.load(slots + lane, mask=live, other=0).to(tl.int64)
    given = lane < m  # picks lanes (m <= R <= RP, which ``plan`` checks)
    pick_v = tl.load(picks + lane, mask=given, other=0).to(tl.int64)
    hot_v = tl.load(resident + pick_v, mask=given, other=-1).to(tl.int64)
    ids_v = hot_v
    dst_v = tl.full((RP,), -1, tl.int64)
    used = lane >= R  # dead lanes count as used: never a victim
    now = tl.load(clock)
    start = now
    resident_n = now * 0
    cached_n = now * 0
    dev_n = now * 0  # misses decoded from the second source (``resident`` -2), counted with DEV
    row64 = row.to(tl.int64)
    for j in range(0, m):
        this = lane == j
        e = tl.sum(tl.where(this, pick_v, 0), axis=0)
        h = tl.sum(tl.where(this, hot_v, 0), axis=0)
        cell = row64 * width + e
        hot = h >= 0
        cold = h < 0
        match = (own == cell) & live
        found = tl.max(match.to(tl.int32), axis=0) > 0
        absent = tl.max(match.to(tl.int32), axis=0) == 0
        # the victim: the row that comes back last (an empty lane beyond any), then the oldest stamp
        back = tl.where(own < 0, rows + 1, ((own // width) - row64 - 1 + rows) % rows + 1)
        back = tl.where(used, -1, back)
        far = tl.max(back, axis=0)
        age = tl.where(back == far, stp, 0x7FFFFFFFFFFFFFFF)
        at = tl.where(found, tl.argmax(match.to(tl.int32), axis=0), tl.argmin(age, axis=0))
        chosen = lane == at
        slot = tl.sum(tl.where(chosen, slot_of, 0), axis=0)
        miss = cold & absent
        touch = chosen & cold
        own = tl.where(touch & miss, cell, own)
        stp = tl.where(touch, start + j, stp)
        used = used | touch
        ids_v = tl.where(this, tl.where(hot, h, slot), ids_v)
        dst_v = tl.where(this, tl.where(miss, slot, -1), dst_v)
        resident_n += hot.to(tl.int64)
        cached_n += (found & cold).to(tl.int64)
        dev_n += (miss & (h == -2)).to(tl.int64)
    tl.store(ids + lane, ids_v, mask=given)
    tl.store(dst + lane, dst_v.to(tl.int32), mask=given)
    if USAGE:
        tl.atomic_add(usage + pick_v, 1, mask=given)
    tl.store(owner + lane, own, mask=live)
    tl.store(stamp + lane, stp, mask=live)
    tl.store(clock, start + m)
    tl.atomic_add(counts, resident_n)
    tl.atomic_add(counts + 1, m - resident_n - cached_n)
    tl.atomic_add(counts + 2, cached_n)
    if DEV:
        tl.atomic_add(counts + 3, dev_n)


_planners: dict[tuple[int, bool, bool], object] = {}  # (cache lanes, counting usage, counting dev decodes) -> relauncher


def launch_plan(cache, row: int, resident: torch.Tensor, picks: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor,
                usage: torch.Tensor | None) -> None:
    r, dev = cache.slots.numel(), counts.numel() >= 4
    key = (r, usage is not None, dev)
    run = _planners.get(key)
    if run is None:
        run = _planners[key] = triton_relauncher(_plan_picks, dict(R=r, RP=max(2, triton.next_power_of_2(r)), USAGE=usage is not None, DEV=dev,
                                                                   num_warps=1))
    tensors = (picks, resident, cache.slots, cache.owner, cache.stamp, cache.clock, ids, cache.dst, counts,
               counts if usage is None else usage)
    args = (picks, picks.numel(), resident, cache.slots, cache.owner, cache.stamp, cache.clock, ids, cache.dst, counts,
            counts if usage is None else usage, row, cache.rows, cache.width)
    run((1, 1), args, launch_key(tensors))
