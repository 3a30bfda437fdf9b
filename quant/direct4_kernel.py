"""The Triton kernel behind ``quant.direct.fetch`` for 4-bit experts (int4, nf4, mxfp4; imported only where Triton is present).

Grid and pick handling as ``quant.direct_kernel``: program (j, b) decodes tile ``b`` of pick
``j``'s expert, the tiles of its tensors (at most three, of one encoding) one after another.
A tensor is read as its storage, ``R`` rows of ``C`` 4-bit codes (two a byte, a row's bytes
contiguous, so a tile's reads from pinned memory are whole runs of bytes), and each tile of
``TR`` x ``TC`` codes is written into the slot in the module's layout: in place, or transposed
(``[C, R]``: int4's ``codes_t`` and MXFP4, whose rows are the outputs). Element ``f = r * C + c``
of the storage belongs to group ``f // G``. Values, in fp32 and rounded once to bf16, as the
schemes' own torch dequantization computes them (``quant.int4``, ``quant.nf4``, ``quant.mxfp4``);
fused multiply-adds are off, so that NF4's ``DYNAMIC[qabsmax] * absmax2 + offset`` rounds twice
as torch's does.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .direct import MAX_BLOCKS, TILE_C, TILE_R
from .direct_kernel import base_of, launch_key, pick, plan_of
from .launch import triton_relauncher

WARPS = 8  # with TILE_R x TILE_C: 8 x 2048 codes on 8 warps read pinned experts fastest (experiments/results/direct4_rate-wide.json)
INT4, NF4, MXFP4 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
KINDS = {"int4": 0, "nf4": 1, "mxfp4": 2}


@triton.jit
def _tile(src, codes, scale, zero, extra, tables, out, t, R, C, G, tiles_c,
          KIND: tl.constexpr, TRANS: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr, GQ: tl.constexpr):
    tr = t // tiles_c
    tc = t % tiles_c
    r = tr * TR + tl.arange(0, TR)  # [TR]; int32 offsets: a tensor holds under 2**31 codes (``_Plan`` checks)
    c = tc * TC + tl.arange(0, TC)  # [TC]
    m = (r[:, None] < R) & (c[None, :] < C)
    # the statistics are loaded first, so that their reads from pinned memory overlap the codes'
    if GQ > 0:  # whole groups of GQ codes along a row: a statistic per group, broadcast over its codes
        NG: tl.constexpr = TC // GQ
        gc = tc * NG + tl.arange(0, NG)
        a, z = _stats(src, scale, zero, extra, tables, r[:, None] * (C // GQ) + gc[None, :], (r[:, None] < R) & (gc[None, :] < C // GQ),
                      C // GQ, KIND)
        a, z = a[:, :, None], z[:, :, None]
    else:  # element f = r * C + c of the storage is in group f // G
        a, z = _stats(src, scale, zero, extra, tables, (r[:, None] * C + c[None, :]) // G, m, C // G, KIND)
    b = tc * (TC // 2) + tl.arange(0, TC // 2)  # [TC/2] bytes of a row
    half = C // 2
    byte = tl.load((src + codes) + r[:, None] * half + b[None, :], mask=(r[:, None] < R) & (b[None, :] < half), other=0)
    if KIND == NF4:  # bitsandbytes: the first element in the high nibble
        q = tl.join(byte >> 4, byte & 15)
    else:
        q = tl.join(byte & 15, byte >> 4)
    if GQ > 0:
        q = tl.reshape(q, (TR, TC // GQ, GQ))
    else:
        q = tl.reshape(q, (TR, TC))
    if KIND == INT4:
        v = (q.to(tl.float32) - z) * a
    else:
        v = tl.load(tables + q.to(tl.int32)) * a
    v = tl.reshape(v, (TR, TC)).to(tl.bfloat16)
    if TRANS:
        tl.store(out + c[:, None] * R + r[None, :], tl.trans(v), mask=tl.trans(m))
    else:
        tl.store(out + r[:, None] * C + c[None, :], v, mask=m)


@triton.jit
def _stats(src, scale, zero, extra, tables, g, m, ng, KIND: tl.constexpr):
    """fp32 statistics of groups ``g`` (``ng`` a row): int4's scale and zero point (in codes),
    NF4's absmax and MXFP4's power of two (each with a zero beside it)."""
    if KIND == INT4:  # its scale: the row's scale times its code's value (``tables[16:]``), one fp32 product
        row, gi = g // ng, g % ng
        k = tl.load((src + scale) + g, mask=m, other=0).to(tl.int32)
        rs = tl.load((src + extra).to(tl.pointer_type(tl.float32)) + row, mask=m, other=0.0)
        zb = tl.load((src + zero) + row * ((ng + 1) // 2) + gi // 2, mask=m, other=0).to(tl.int32)  # two zero points a byte
        z = ((zb >> ((gi % 2) * 4)) & 15).to(tl.float32)
        return rs * tl.load(tables + 16 + k, mask=m, other=0.0), z
    elif KIND == NF4:
        qa = tl.load((src + scale) + g, mask=m, other=0).to(tl.int32)
        a2 = tl.load((src + zero).to(tl.pointer_type(tl.float32)) + g // 256, mask=m, other=0.0)
        off = tl.load((src + extra).to(tl.pointer_type(tl.float32)))
        absmax = tl.load(tables + 16 + qa, mask=m, other=0.0) * a2
        return absmax + off, a2 * 0.0
    else:  # MXFP4: 2 ** (e - 127), built from its bits (e = 0: the subnormal 2**-127)
        e = tl.load((src + scale) + g, mask=m, other=127).to(tl.int32)
        bits = tl.where(e == 0, 0x00400000, e << 23)
        p = bits.to(tl.float32, bitcast=True)
        return p, p * 0.0


@triton.jit
def _fetch4(src, dev, starts, resident, picks, dst, ids, counts, usage, tables,
            out0, k0, s0, z0, x0, n0, R0, C0, G0, tc0, nt0,
            out1, k1, s1, z1, x1, n1, R1, C1, G1, tc1, nt1,
            out2, k2, s2, z2, x2, n2, R2, C2, G2, tc2,
            KIND: tl.constexpr, TRANS: tl.constexpr, USAGE: tl.constexpr, PLANNED: tl.constexpr,
            TR: tl.constexpr, TC: tl.constexpr, GQ: tl.constexpr):
    j = tl.program_id(0)
    b = tl.program_id(1)
    e, slot, go = pick(j, b, picks, resident, dst, ids, counts, usage, USAGE, PLANNED)
    if go:
        base = base_of(src, dev, starts, e)
        if b < nt0:
            _tile(base, k0, s0, z0, x0, tables, out0 + slot * n0, b, R0, C0, G0, tc0, KIND, TRANS, TR, TC, GQ)
        elif b < nt0 + nt1:
            _tile(base, k1, s1, z1, x1, tables, out1 + slot * n1, b - nt0, R1, C1, G1, tc1, KIND, TRANS, TR, TC, GQ)
        else:
            _tile(base, k2, s2, z2, x2, tables, out2 + slot * n2, b - nt0 - nt1, R2, C2, G2, tc2, KIND, TRANS, TR, TC, GQ)


_TABLES: dict[torch.device, torch.Tensor] = {}


def _tables(kind: str, device: torch.device) -> torch.Tensor:
    """fp32 ``[16 + 256]``: the kind's 16 code values, then its statistics' 256: bitsandbytes' dynamic
    map (NF4) or int4's scale codes' values (``quant.int4.SCALE_MAP``)."""
    key = (kind, device)
    got = _TABLES.get(key)
    if got is None:
        if kind == "nf4":
            from .nf4 import tables

            values, dynamic = tables(device)
        elif kind == "int4":
            from .int4 import scale_map

            values, dynamic = torch.arange(16, dtype=torch.float32, device=device), scale_map(device)
        else:
            from .mxfp4 import FP4_VALUES

            values = torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)
            dynamic = torch.zeros(256, dtype=torch.float32, device=device)
        got = _TABLES[key] = torch.cat([values.to(torch.float32), dynamic]).contiguous()
    return got


def spread_group(tensors) -> int:
    """The group size the kernel may take as a constant: one shared by every tensor, a power of
    two that divides their rows and the tile's codes, so that a tile holds whole groups and reads
    each group's statistics once; 0 where there is none (each code then finds its own group)."""
    groups = {t.group for t in tensors}
    g = groups.pop() if len(groups) == 1 else 0
    ok = g > 0 and g & (g - 1) == 0 and TILE_C % g == 0 and all(t.cols_n % g == 0 for t in tensors)
    return g if ok else 0


class _Plan:
    """A launch over one expert's 4-bit tensors: the fixed arguments, the tiles per pick, and
    the relaunchers of the kernel's specializations."""

    def __init__(self, tensors):
        self.fixed, self.blocks = [], 0
        for i in range(3):
            t = tensors[min(i, len(tensors) - 1)]
            tiles_c = triton.cdiv(t.cols_n, TILE_C)
            nt = triton.cdiv(t.rows, TILE_R) * tiles_c if i < len(tensors) else 0
            self.blocks += nt
            self.fixed += [t.out, t.data, t.scale, t.zero, t.extra, math.prod(t.out.shape[1:]), t.rows, t.cols_n, t.group,
                           tiles_c] + ([nt] if i < 2 else [])
        if self.blocks > MAX_BLOCKS:
            raise ValueError(f"direct fetch: an expert of {self.blocks} tiles, at most {MAX_BLOCKS} fit one launch")
        if len({t.encoding for t in tensors}) != 1:
            raise ValueError("direct fetch: one launch decodes tensors of one encoding")
        if any(t.rows * t.cols_n >= 2**31 for t in tensors):
            raise ValueError("direct fetch: a 4-bit tensor of 2**31 codes or more; the kernel's offsets are 32-bit")
        kind, trans = tensors[0].kind, tensors[0].transposed
        self.tables = _tables(kind, tensors[0].out.device)
        kw = dict(KIND=KINDS[kind], TRANS=trans, TR=TILE_R, TC=TILE_C, GQ=spread_group(tensors), num_warps=WARPS,
                  enable_fp_fusion=False)
        self.relaunch = {usage: triton_relauncher(_fetch4, dict(kw, USAGE=usage, PLANNED=False)) for usage in (False, True)}
        self.relaunch["planned"] = triton_relauncher(_fetch4, dict(kw, USAGE=False, PLANNED=True))


def launch(src: torch.Tensor, dev: torch.Tensor, starts: torch.Tensor, resident: torch.Tensor, picks: torch.Tensor, dst: torch.Tensor,
           ids: torch.Tensor, counts: torch.Tensor, tensors, usage: torch.Tensor | None) -> None:
    plan = plan_of(tensors, _Plan)
    dynamic = (src, dev, starts, resident, picks, dst, ids, counts, counts if usage is None else usage, plan.tables)
    plan.relaunch[usage is not None]((picks.numel(), plan.blocks), (*dynamic, *plan.fixed), launch_key(dynamic))


def launch_planned(src: torch.Tensor, dev: torch.Tensor, starts: torch.Tensor, picks: torch.Tensor, dst: torch.Tensor, tensors) -> None:
    plan = plan_of(tensors, _Plan)
    dynamic = (src, dev, starts, dst, picks, dst, starts, starts, starts, plan.tables)
    plan.relaunch["planned"]((picks.numel(), plan.blocks), (*dynamic, *plan.fixed), launch_key(dynamic))
