"""bitsandbytes blockwise 8-bit (dynamic map, absmax per block of 256).

bitsandbytes is imported on first use only: the import costs seconds and logs a warning on
machines without CUDA. On CUDA the kernel writes straight into ``out``; the CPU backend has no
``out=`` variant, so there the result is copied in. A block is 256 elements in memory order,
whichever axis they run along (a transposed weight's blocks run along its output axis: an absmax
per 256 values is local either way). A tensor of one row (a bias) is kept exact, in bf16
(``data``), as ``quant.int8`` keeps it.
"""
from __future__ import annotations

import math

import torch

from .core import FieldSpec, QuantizedTensor, register

BLOCKSIZE = 256


def _functional():
    import bitsandbytes.functional as F  # lazy: slow import

    return F


class Blockwise8:
    name = "bnb8"
    lossless = False
    stacks = False

    def fields(self, shape: tuple[int, ...]) -> tuple[FieldSpec, ...]:
        if len(shape) < 2:  # one row: exact
            return (FieldSpec("data", torch.bfloat16, tuple(shape)),)
        numel = math.prod(shape)
        return (
            FieldSpec("codes", torch.uint8, (numel,)),
            FieldSpec("absmax", torch.float32, (math.ceil(numel / BLOCKSIZE),)),
            FieldSpec("code", torch.float32, (256,)),
        )

    def quantize(self, weight: torch.Tensor) -> QuantizedTensor:
        if weight.dim() < 2:
            return QuantizedTensor(self.name, tuple(weight.shape), {"data": weight.detach().to(torch.bfloat16).contiguous()})
        F = _functional()
        flat = weight.detach().to(torch.float32).contiguous().view(-1)  # [numel]
        codes, state = F.quantize_blockwise(flat, blocksize=BLOCKSIZE)
        data = {
            "codes": codes.contiguous(),
            "absmax": state.absmax.to(torch.float32).contiguous(),
            "code": state.code.to(torch.float32).contiguous(),
        }
        return QuantizedTensor(self.name, tuple(weight.shape), data)

    def prepare(self, q: QuantizedTensor) -> QuantizedTensor:
        return q

    def dequantize(self, q: QuantizedTensor, *, out: torch.Tensor) -> torch.Tensor:
        d = q.data
        if "data" in d:  # kept exact
            return out.copy_(d["data"], non_blocking=True)
        F = _functional()
        if out.device.type == "cuda":
            F.dequantize_blockwise(
                d["codes"], absmax=d["absmax"], code=d["code"], blocksize=BLOCKSIZE, out=out.view(-1)
            )
            return out
        flat = F.dequantize_blockwise(d["codes"], absmax=d["absmax"], code=d["code"], blocksize=BLOCKSIZE)
        return out.copy_(flat.view(out.shape))


register(Blockwise8())
