"""Symmetric per-row INT8: one fp32 scale per output row (absmax / 127).

Dequantize is a single broadcast multiply into ``out`` (int8 * fp32 -> bf16), which runs on
whichever device the fields sit on. Rows of zeros get scale 1 so that no NaN can appear.
"""
from __future__ import annotations

import torch

from quant.core import FieldSpec, QuantizedTensor, register


class Int8PerRow:
    name = "int8"
    lossless = False
    stacks = True

    def fields(self, shape: tuple[int, ...]) -> tuple[FieldSpec, ...]:
        shape = tuple(shape)
        return (
            FieldSpec("qdata", torch.int8, shape),
            FieldSpec("scale", torch.float32, shape[:-1]),
        )

    def quantize(self, weight: torch.Tensor) -> QuantizedTensor:
        w = weight.detach().to(torch.float32, copy=True)  # [*rows, C], the one full-size temporary
        absmax = w.abs().amax(dim=-1)  # [*rows]
        scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))  # [*rows]
        qdata = w.div_(scale.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)  # [*rows, C]
        return QuantizedTensor(self.name, tuple(weight.shape), {"qdata": qdata.contiguous(), "scale": scale.contiguous()})

    def prepare(self, q: QuantizedTensor) -> QuantizedTensor:
        """The scale as ``[*rows, 1]``, broadcast as it is: one launch per dequantization."""
        scale = q.data["scale"]
        if scale.dim() == q.data["qdata"].dim():
            return q
        return QuantizedTensor(q.scheme, q.shape, {"qdata": q.data["qdata"], "scale": scale.unsqueeze(-1)})

    def dequantize(self, q: QuantizedTensor, *, out: torch.Tensor) -> torch.Tensor:
        qdata, scale = q.data["qdata"], q.data["scale"]
        if scale.dim() < qdata.dim():  # not prepared
            scale = scale.unsqueeze(-1)
        return torch.mul(qdata, scale, out=out)  # [*rows, C]


register(Int8PerRow())
