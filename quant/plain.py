"""The lossless scheme: weights kept in bf16, the compute dtype. Dequantize is a copy."""
from __future__ import annotations

import torch

from .core import FieldSpec, QuantizedTensor, register


class Bf16:
    name = "bf16"
    lossless = True
    stacks = True

    def fields(self, shape: tuple[int, ...]) -> tuple[FieldSpec, ...]:
        return (FieldSpec("data", torch.bfloat16, tuple(shape)),)

    def quantize(self, weight: torch.Tensor) -> QuantizedTensor:
        data = weight.detach().to(torch.bfloat16).contiguous()  # [*shape]
        return QuantizedTensor(self.name, tuple(weight.shape), {"data": data})

    def prepare(self, q: QuantizedTensor) -> QuantizedTensor:
        return q

    def dequantize(self, q: QuantizedTensor, *, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(q.data["data"], non_blocking=True)


register(Bf16())
