"""Symmetric per-row INT8: one fp32 scale per output row (absmax / 127).

A weight stored ``[out, in]`` gets a scale per row (``scale`` ``[out]``); one stored transposed,
``[in, out]`` (``columns=True``), a scale per column (``scale`` ``[1, out]``), so the scales
follow the output rows either way. A tensor of one row (a bias) is kept exact, in bf16
(``data``): one scale for a whole vector would save next to nothing and cost accuracy.
Dequantize is a broadcast multiply into ``out`` (int8 * fp32 -> bf16, in fp32, rounded once),
which runs on whichever device the fields sit on: on CUDA with Triton present through
``quant.int8_kernel`` (the same arithmetic, several times the memory rate; per-row scales only),
elsewhere ``torch.mul``. Rows (columns) of zeros get scale 1 so that no NaN can appear.
"""
from __future__ import annotations

import torch

from .core import FieldSpec, QuantizedTensor, register
from .launch import kernel_module

MAX_STACK = 65535  # the CUDA kernel's grid puts the stack on its second axis
# Fewer codes than this go through torch.mul even on CUDA. On the H200 (experiments/results/
# dequant_rate.json) one Qwen3-30B-A3B expert's gate and up codes (3.1 M) took 0.022 ms through
# torch.mul and 0.047 through the kernel, host launch included; eight experts' down codes (12.6 M)
# 0.068 against 0.050, and fifteen experts' gate and up codes 0.228 against 0.074.
KERNEL_MIN_CODES = 1 << 23


class Int8PerRow:
    name = "int8"
    lossless = False
    stacks = True
    per_output_row = True  # takes ``columns=True`` for weights stored [in, out]

    def fields(self, shape: tuple[int, ...], *, columns: bool = False) -> tuple[FieldSpec, ...]:
        shape = tuple(shape)
        if len(shape) < 2:  # one row: exact
            return (FieldSpec("data", torch.bfloat16, shape),)
        scale = (*shape[:-2], 1, shape[-1]) if columns else shape[:-1]
        return (
            FieldSpec("qdata", torch.int8, shape),
            FieldSpec("scale", torch.float32, scale),
        )

    def quantize(self, weight: torch.Tensor, *, columns: bool = False) -> QuantizedTensor:
        if weight.dim() < 2:
            return QuantizedTensor(self.name, tuple(weight.shape), {"data": weight.detach().to(torch.bfloat16).contiguous()})
        w = weight.detach().to(torch.float32, copy=True)  # [*rows, C], the one full-size temporary
        absmax = w.abs().amax(dim=-2 if columns else -1, keepdim=True)  # [*rows, 1] or [..., 1, C]
        scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
        qdata = w.div_(scale).round_().clamp_(-127, 127).to(torch.int8)  # [*rows, C]
        scale = scale if columns else scale.squeeze(-1)  # [..., 1, C] or [*rows]
        return QuantizedTensor(self.name, tuple(weight.shape), {"qdata": qdata.contiguous(), "scale": scale.contiguous()})

    def prepare(self, q: QuantizedTensor) -> QuantizedTensor:
        """The scale as ``[*rows, 1]`` (or ``[..., 1, C]``), broadcast as it is: one launch per dequantization."""
        if "data" in q.data:
            return q
        scale = q.data["scale"]
        if scale.dim() == q.data["qdata"].dim():
            return q
        return QuantizedTensor(q.scheme, q.shape, {"qdata": q.data["qdata"], "scale": scale.unsqueeze(-1)})

    def dequantize(self, q: QuantizedTensor, *, out: torch.Tensor) -> torch.Tensor:
        if "data" in q.data:  # kept exact
            return out.copy_(q.data["data"], non_blocking=True)
        qdata, scale = q.data["qdata"], q.data["scale"]
        if scale.dim() < qdata.dim():  # not prepared
            scale = scale.unsqueeze(-1)
        layout = _kernel_layout(qdata, scale, out)
        if layout is not None:
            _launch(qdata, layout[0], scale, layout[1], out, layout[2], *layout[3:])
            return out
        return torch.mul(qdata, scale, out=out)  # [*rows, C]


register(Int8PerRow())


def kernel_available() -> bool:
    """True when the Triton kernel can run (CUDA and Triton present)."""
    global _launch
    module = kernel_module("int8_kernel")
    if module is not None and _launch is None:
        _launch = module.launch
    return module is not None


_launch = None  # quant.int8_kernel.launch, once kernel_available() found it


def _kernel_layout(qdata: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> tuple[int, ...] | None:
    """The kernel's view of a dequantization (``stack_layout``), or None where ``torch.mul`` runs
    it: off CUDA, without Triton, for fewer than ``KERNEL_MIN_CODES``
    codes, or for dtypes other than int8 codes, fp32 scales and a bf16 or fp16 output."""
    if out.device.type != "cuda" or qdata.numel() < KERNEL_MIN_CODES:
        return None
    if qdata.device != out.device or scale.device != out.device:
        return None
    if qdata.dtype != torch.int8 or scale.dtype != torch.float32 or out.dtype not in (torch.bfloat16, torch.float16):
        return None
    layout = stack_layout(qdata, scale, out)
    return layout if layout is not None and kernel_available() else None


def stack_layout(qdata: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> tuple[int, ...] | None:
    """Codes, scales ``[*rows, 1]`` and output as the kernel addresses them, or None: each a stack
    (at most one leading dimension, at most ``MAX_STACK`` long) of ``[R, C]`` elements with
    contiguous rows, one scale per row. Returns the three stack strides (in elements), the stack
    size, the codes per element and ``C``: element ``j``'s code ``i`` is at ``qdata``'s first
    element plus ``j * stride + i``, its scale at ``j * stride + i // C``."""
    if qdata.dim() not in (2, 3) or out.shape != qdata.shape or scale.shape != (*qdata.shape[:-1], 1):
        return None
    rows, cols = qdata.shape[-2:]
    stack = qdata.shape[0] if qdata.dim() == 3 else 1
    if rows * cols == 0 or not 0 < stack <= MAX_STACK:
        return None
    for t, row_stride in ((qdata, cols), (out, cols), (scale, 1)):
        if rows > 1 and t.stride(-2) != row_stride or t is not scale and cols > 1 and t.stride(-1) != 1:
            return None
    if qdata.dim() == 2:
        return (0, 0, 0, 1, rows * cols, cols)
    return (qdata.stride(0), scale.stride(0), out.stride(0), stack, rows * cols, cols)
