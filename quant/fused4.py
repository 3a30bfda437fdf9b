"""Fused int4 products: each pick's input row times its expert's int4 weight, read in place from the GPU's blob pool.

Owns ``linear`` (the Triton kernel ``quant.fused4_kernel`` on CUDA, else ``linear_reference``)
and ``qualifies``, which tensors it takes.

Why: decoding a quantized hot expert into a bf16 slot before its product writes the slot and
reads it again, four times its int4 bytes each way, to multiply a handful of rows; a fused
product reads the int4 bytes once. On the H200, one token's two Mixtral-8x7B experts (96 MB of
int4 each, 352 MB in bf16) took 0.179 ms fused, 0.211 in bf16 in place and 0.471 decoded into
slots first (``experiments/results/fused4_rate.json``); the kernel is bound by its arithmetic
there, its bytes bound being 0.046 ms.

What it computes: ``out[j] = x[j // per] @ W[picks[j]]^T``, where ``W[e]`` is expert ``e``'s int4
weight as ``quant.int4`` decodes it in fp32 (the slots hold it rounded to bf16), products and
sums in fp32 (each group's scale and zero point factored out of its sum, ``quant.fused4_kernel``),
rounded once to bf16. Against the slot path, that is one rounding fewer, per weight, and another
order of the sums. Taken: int4 weights stored ``[out, in]`` (not ``codes_t``) whose group is a
power of two up to ``BK`` inputs.
"""
from __future__ import annotations

import torch

from .direct import DirectTensor, four_bit_fields, kernel_available

BK = 1024  # inputs a program of the kernel reads per step (``quant.fused4_kernel``)


def qualifies(t: DirectTensor) -> bool:
    """Whether ``linear`` takes tensor ``t``: int4, stored ``[out, in]``, a power-of-two group that
    divides ``BK``, and under 2**31 codes (the kernel's offsets are 32-bit)."""
    g = t.group
    return t.kind == "int4" and not t.transposed and 0 < g <= BK and g & (g - 1) == 0 and t.rows * t.cols_n < 2**31


def linear(x: torch.Tensor, per: int, picks: torch.Tensor, starts: torch.Tensor, dev: torch.Tensor, t: DirectTensor) -> torch.Tensor:
    """bf16 ``[m, rows]``: pick ``j`` (of ``m``, int64 ``picks``) multiplies row ``j // per`` of
    ``x`` (bf16 ``[n, cols]``) by its expert's weight ``t``, read from ``dev`` at ``-1 - starts[e]``."""
    if not qualifies(t):
        raise ValueError(f"fused int4: a {t.kind or 'bf16/int8'} tensor of {t.rows} x {t.cols_n} with group {t.group}; "
                         f"it takes int4 stored [out, in] with a power-of-two group up to {BK}")
    x = x.contiguous()
    out = torch.empty((picks.numel(), t.rows), dtype=torch.bfloat16, device=x.device)
    if x.device.type == "cuda" and kernel_available():
        from .fused4_kernel import launch

        launch(x, per, picks, starts, dev, t, out)
        return out
    return linear_reference(x, per, picks, starts, dev, t, out)


def linear_reference(x: torch.Tensor, per: int, picks: torch.Tensor, starts: torch.Tensor, dev: torch.Tensor, t: DirectTensor,
                     out: torch.Tensor) -> torch.Tensor:
    """``linear`` with torch operations, one pick at a time (brings the picks to the host): each
    weight decoded in fp32 by ``quant.int4`` itself, then an fp32 product rounded to bf16."""
    from .int4 import decode

    st = starts.tolist()
    for j, e in enumerate(picks.tolist()):
        f = four_bit_fields(dev, -1 - st[e], t)
        out[j] = (x[j // per].float() @ decode(f["codes"], f["scale"], f["zero"], f["row_scale"]).T).to(torch.bfloat16)
    return out
