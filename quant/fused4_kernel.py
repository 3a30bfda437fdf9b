"""The Triton kernel behind ``quant.fused4.linear`` (imported only where Triton is present).

Grid: (picks, output rows / ``BN``). Program (j, n) reads rows ``n * BN ...`` of pick ``j``'s int4
weight in place in the GPU's blob pool, ``BK`` inputs at a time. A group's scale (its row's scale
times its code's value, ``quant.int4``) and zero point are factored out of its sum:
``sum((q - z) * s * x) = s * (sum(q * x) - z * sum(x))``, so each code costs a conversion and a
multiply-add, and each group's statistics are read once; all in fp32, the row sums rounded once
to bf16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .direct_kernel import launch_key
from .fused4 import BK
from .launch import triton_relauncher

# output rows a program reads, and its warps; with BK inputs a step, the fastest of nine shapes for
# Mixtral-8x7B's experts and for Qwen3-30B-A3B's (experiments/results/fused4_rate.json)
BN, WARPS = 16, 4


@triton.jit
def _linear4(x, picks, starts, dev, out, codes, scale, zero, rows, maps, R, C, per,
             G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    j = tl.program_id(0)
    r = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN] output rows; int32 offsets (``quant.fused4.qualifies`` checks)
    rm = r < R
    st = tl.load(starts + tl.load(picks + j))
    base = tl.multiple_of(dev + (-1 - st), 16)  # blobs start 4 KiB apart in the blob pool
    pairs = (x + (j // per) * C).to(tl.pointer_type(tl.int32))  # the input row as pairs of bf16 (C is even)
    rs = tl.load((base + rows).to(tl.pointer_type(tl.float32)) + r, mask=rm, other=0.0)  # [BN] row scales
    half = C // 2
    NG: tl.constexpr = BK // G
    ng = C // G
    acc = tl.zeros([BN, NG], dtype=tl.float32)
    for k in range(0, C, BK):
        b = k // 2 + tl.arange(0, BK // 2)  # [BK/2] bytes of a row: codes 2b (low nibble) and 2b + 1
        bm = b < half
        pair = tl.load(pairs + b, mask=bm, other=0)
        xe = (pair << 16).to(tl.float32, bitcast=True)  # x[2b]: a bf16's bits are an fp32's high half
        xo = (pair & -65536).to(tl.float32, bitcast=True)  # x[2b + 1]
        byte = tl.load((base + codes) + r[:, None] * half + b[None, :], mask=rm[:, None] & bm[None, :], other=0)
        p = (byte & 15).to(tl.float32) * xe[None, :] + (byte >> 4).to(tl.float32) * xo[None, :]  # [BN, BK/2]
        qx = tl.sum(tl.reshape(p, (BN, NG, G // 2)), axis=2)  # [BN, NG]: each group's sum of code x input
        xs = tl.sum(tl.reshape(xe + xo, (NG, G // 2)), axis=1)  # [NG]: each group's sum of inputs
        gi = k // G + tl.arange(0, NG)
        gm = rm[:, None] & (gi[None, :] < ng)
        code = tl.load((base + scale) + r[:, None] * ng + gi[None, :], mask=gm, other=0).to(tl.int32)
        s = rs[:, None] * tl.load(maps + code, mask=gm, other=0.0)  # the group's scale, as quant.int4 forms it
        zb = tl.load((base + zero) + r[:, None] * ((ng + 1) // 2) + (gi // 2)[None, :], mask=gm, other=0).to(tl.int32)
        z = ((zb >> ((gi % 2) * 4)[None, :]) & 15).to(tl.float32)  # two zero points a byte
        acc += s * (qx - z * xs[None, :])  # sum over a group of (q - z) * s * x
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
    from .int4 import scale_map

    dynamic = (x, picks, starts, dev, out)
    ints = (t.data, t.scale, t.zero, t.extra)  # offsets in a blob; then the scale codes' values, the shape and ``per``
    fixed = (*ints, scale_map(x.device), t.rows, t.cols_n, per)  # Triton specializes on ints (== 1, % 16): part of the key
    relaunch((picks.numel(), triton.cdiv(t.rows, bn)), (*dynamic, *fixed), (launch_key(dynamic), ints, t.rows, t.cols_n, per))
