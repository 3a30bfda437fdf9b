"""The Triton kernel behind ``quant.direct.fetch`` (imported only where Triton is present).

Grid: (picks, blocks): program (j, b) decodes block ``b`` of pick ``j``'s expert, the blocks of
the expert's tensors one after another; programs of resident picks only look the pick up.
Program (j, 0) also writes ``ids[j]`` and counts the pick (and its expert, with ``usage``).
Measured on an H200 (PCIe 5 x16), reading INT8 experts of Qwen3-30B-A3B shapes this way moves
46-47 GB/s for 4 experts and 50 GB/s for 32, against 55 GB/s for one large copy-engine copy
(``bench/zero_copy_probe.py``). Launches after the first two of a specialization skip Triton's
per-call dispatch (``quant.launch``).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from quant.direct import BLOCK, MAX_BLOCKS
from quant.launch import triton_relauncher

WARPS = 8


@triton.jit
def _block(src, data, scale, out, b, n, cols, QUANT: tl.constexpr, BLOCK: tl.constexpr):
    i = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    if QUANT:
        q = tl.load((src + data).to(tl.pointer_type(tl.int8)) + i, mask=m, other=0)
        s = tl.load((src + scale).to(tl.pointer_type(tl.float32)) + i // cols, mask=m, other=0.0)
        v = (q.to(tl.float32) * s).to(tl.bfloat16)
    else:
        v = tl.load((src + data).to(tl.pointer_type(tl.bfloat16)) + i, mask=m, other=0.0)
    tl.store(out + i, v, mask=m)


@triton.jit
def _fetch(src, starts, resident, picks, dst, ids, counts, usage,
           out0, d0, s0, n0, c0, nb0,
           out1, d1, s1, n1, c1, nb1,
           out2, d2, s2, n2, c2,
           QUANT: tl.constexpr, USAGE: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    b = tl.program_id(1)
    e = tl.load(picks + j)
    r = tl.load(resident + e)
    slot = tl.where(r >= 0, r, tl.load(dst + j)).to(tl.int64)
    if b == 0:
        tl.store(ids + j, slot)
        tl.atomic_add(counts + (r < 0).to(tl.int32), 1)
        if USAGE:
            tl.atomic_add(usage + e, 1)
    if r < 0:
        base = src + tl.load(starts + e)
        if b < nb0:
            _block(base, d0, s0, out0 + slot * n0, b, n0, c0, QUANT, BLOCK)
        elif b < nb0 + nb1:
            _block(base, d1, s1, out1 + slot * n1, b - nb0, n1, c1, QUANT, BLOCK)
        else:
            _block(base, d2, s2, out2 + slot * n2, b - nb0 - nb1, n2, c2, QUANT, BLOCK)


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
        self.quant = tensors[0].scale is not None
        self.relaunch = {usage: triton_relauncher(_fetch, dict(QUANT=self.quant, USAGE=usage, BLOCK=BLOCK, num_warps=WARPS))
                         for usage in (False, True)}


def launch(src: torch.Tensor, starts: torch.Tensor, resident: torch.Tensor, picks: torch.Tensor, dst: torch.Tensor,
           ids: torch.Tensor, counts: torch.Tensor, tensors, usage: torch.Tensor | None) -> None:
    plan = getattr(tensors, "launch_plan", None)
    if plan is None:
        plan = _Plan(tensors)
        if hasattr(tensors, "launch_plan"):  # a DirectExpert keeps it
            tensors.launch_plan = plan
    dynamic = (src, starts, resident, picks, dst, ids, counts, counts if usage is None else usage)
    # what decides Triton's compiled kernel among the arguments that vary: dtypes and 16-byte alignment
    key = tuple((t.dtype, t.data_ptr() & 15 == 0) for t in dynamic)
    plan.relaunch[usage is not None]((picks.numel(), plan.blocks), (*dynamic, *plan.fixed), key)
