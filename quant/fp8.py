"""Block-scaled FP8 as DeepSeek-V3 checkpoints store it: float8_e4m3fn weights, one fp32 ``weight_scale_inv`` per block.

A weight ``[*lead, R, C]`` comes with ``weight_scale_inv`` fp32 ``[*lead, ceil(R/bR), ceil(C/bC)]``
for blocks of ``bR x bC`` (the config's ``quantization_config.weight_block_size``, 128 x 128 in
DeepSeek-V3); the blocks on the last row and column may be cut short. The real weight is
``weight.float() * weight_scale_inv`` of its block, computed in fp32 and rounded once to the
compute dtype: what transformers' ``Fp8Dequantize`` computes when it loads such a checkpoint
dequantized. ``encode`` is the plain encoder (``amax / 448`` per block), for test checkpoints.
"""
from __future__ import annotations

import math

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
DEFAULT_BLOCK = (128, 128)


def grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The shape of ``weight_scale_inv`` for a weight of ``shape``: one entry per (cut) block."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def _expand(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """``scale`` [*lead, gR, gC] -> one entry per weight element [*lead, R, C]."""
    rows, cols = shape[-2:]
    return scale.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]


def decode(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The real weight in ``dtype``: fp32 products of each code and its block's scale, rounded once."""
    if weight.dim() < 2 or tuple(scale_inv.shape) != grid(tuple(weight.shape), block):
        raise ValueError(f"fp8: a weight of shape {tuple(weight.shape)} with blocks of {list(block)} needs weight_scale_inv "
                         f"of shape {list(grid(tuple(weight.shape), block)) if weight.dim() >= 2 else '[..., R, C]'}, "
                         f"got {list(scale_inv.shape)}")
    w = weight.to(torch.float32)  # [*lead, R, C], exact: every float8_e4m3fn is an fp32
    w.mul_(_expand(scale_inv.to(torch.float32), tuple(weight.shape), block))
    return w.to(dtype)


def encode(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [*lead, R, C] -> (float8_e4m3fn codes [*lead, R, C], weight_scale_inv fp32 [*lead, gR, gC]):
    each block scaled so that its largest magnitude is 448 (a block of zeros gets scale 1)."""
    w = weight.detach().to(torch.float32)
    shape = tuple(w.shape)
    g = grid(shape, block)
    rows, cols = shape[-2:]
    padded = torch.zeros((*shape[:-2], g[-2] * block[0], g[-1] * block[1]), dtype=torch.float32, device=w.device)
    padded[..., :rows, :cols] = w
    tiles = padded.unflatten(-1, (g[-1], block[1])).unflatten(-3, (g[-2], block[0]))  # [*lead, gR, bR, gC, bC]
    amax = tiles.abs().amax(dim=(-3, -1))  # [*lead, gR, gC]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (w / _expand(scale_inv, shape, block)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale_inv.contiguous()
