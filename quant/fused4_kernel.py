"""The Triton kernel behind ``quant.fused4.linear`` (imported only where Triton is present).

Grid: (picks, output rows / ``BN``). Program (j, n) reads rows ``n * BN ...`` of pick ``j``'s int4
weight in place in the GPU's blob pool, ``BK`` inputs at a time (codes, then each group's scale
and zero point once), decodes them exactly as ``quant.int4`` does (fp32, rounded once to bf16),
multiplies them by the pick's input row and sums in fp32; the row sums are rounded once to bf16.
Fused multiply-adds are off, as in ``quant.direct4_kernel``, so the weights round as torch's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .direct_kernel import launch_key
from .launch import triton_relauncher

BN, BK, WARPS = 16, 512, 4  # output rows and inputs a program reads per step, and its warps


@triton.jit
def _linear4(x, picks, starts, dev, out, codes, scale, zero, R, C, per,
             G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    j = tl.program_id(0)
    r = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN] output rows; int32 offsets (``quant.fused4.qualifies`` checks)
    rm = r < R
    st = tl.load(starts + tl.load(picks + j))
    base = tl.multiple_of(dev + (-1 - st), 16)  # blobs start 4 KiB apart in the blob pool
    xr = x + (j // per) * C
    half = C // 2
    ng = C // G
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k in range(0, C, BK):
        gi = k // G + tl.arange(0, BK // G)  # [BK/G] groups of this step
        gm = rm[:, None] & (gi[None, :] < ng)
        s = tl.load((base + scale).to(tl.pointer_type(tl.float16)) + r[:, None] * ng + gi[None, :], mask=gm, other=0.0)
        z = tl.load((base + zero) + r[:, None] * ng + gi[None, :], mask=gm, other=0).to(tl.float32) / 16.0
        b = k // 2 + tl.arange(0, BK // 2)
        byte = tl.load((base + codes) + r[:, None] * half + b[None, :], mask=rm[:, None] & (b[None, :] < half), other=0)
        q = tl.reshape(tl.join(byte & 15, byte >> 4), (BN, BK // G, G))  # element 2b in the low nibble
        w = ((q.to(tl.float32) - z[:, :, None]) * s.to(tl.float32)[:, :, None]).to(tl.bfloat16)
        c = k + tl.arange(0, BK)
        xv = tl.load(xr + c, mask=c < C, other=0.0).to(tl.float32)
        acc += tl.reshape(w, (BN, BK)).to(tl.float32) * xv[None, :]
    tl.store(out + j * R + r, tl.sum(acc, axis=1).to(tl.bfloat16), mask=rm)


_RELAUNCH: dict[tuple, object] = {}


def launch(x: torch.Tensor, per: int, picks: torch.Tensor, starts: torch.Tensor, dev: torch.Tensor, t, out: torch.Tensor,
           bn: int = BN, bk: int = BK, warps: int = WARPS) -> None:
    """``out[j] = x[j // per] @ W[picks[j]]^T`` for the int4 tensor ``t`` (a ``DirectTensor``) of
    each pick's blob in ``dev`` (``starts`` negative, as ``quant.direct`` keeps quantized hot ones)."""
    key = (t.group, bn, bk, warps)
    relaunch = _RELAUNCH.get(key)
    if relaunch is None:
        relaunch = _RELAUNCH[key] = triton_relauncher(_linear4, dict(G=t.group, BN=bn, BK=bk, num_warps=warps,
                                                                     enable_fp_fusion=False))
    dynamic = (x, picks, starts, dev, out)
    ints = (t.data, t.scale, t.zero, t.rows, t.cols_n, per)  # Triton specializes on them (== 1, % 16): part of the key
    relaunch((picks.numel(), triton.cdiv(t.rows, bn)), (*dynamic, *ints), (launch_key(dynamic), ints))
