"""quant.fp8: block-scaled FP8 (DeepSeek-V3's weight + weight_scale_inv) decoded as transformers decodes it.

The reference is ``Fp8Dequantize``, what transformers runs to load such a checkpoint dequantized:
fp32 products rounded once to bf16, as DeepSeek-V3's own dequantization computes. (transformers'
``_dequantize_fp8_weight``, used by its backward pass, multiplies in bf16 with the scale rounded
to bf16 first, and differs in the last bit for about half the values.)"""
from __future__ import annotations

import pytest
import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from tiers import quant
from tiers.quant import fp8


def gaussian(shape, seed=0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def reference(weight: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """Element by element from the definition: code * the scale of block (r // bR, c // bC), in float64."""
    rows, cols = weight.shape[-2:]
    r = torch.arange(rows) // block[0]
    c = torch.arange(cols) // block[1]
    scale = scale_inv.to(torch.float64)[..., r[:, None], c[None, :]]
    return (weight.to(torch.float64) * scale).to(torch.float32).to(torch.bfloat16)


@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((3, 64, 96), (32, 16))])
def test_decode_equals_transformers_bit_for_bit(shape, block):
    codes, scale_inv = fp8.encode(gaussian(shape, seed=1), block)
    ours = fp8.decode(codes, scale_inv, block)
    theirs = Fp8Dequantize(None)._dequantize_one(codes, scale_inv, output_dtype=torch.bfloat16)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))


@pytest.mark.parametrize("shape,block", [((200, 130), (128, 128)), ((2, 48, 70), (32, 32)), ((5, 7), (128, 128))])
def test_cut_blocks_decode_as_defined(shape, block):
    """Shapes that are not multiples of the block (DeepSeek-V3's last row and column of blocks
    are cut short): transformers' dequantization refuses these, so the reference is the definition."""
    codes, scale_inv = fp8.encode(gaussian(shape, seed=2), block)
    assert tuple(scale_inv.shape) == fp8.grid(shape, block)
    scale_inv = scale_inv * torch.linspace(0.5, 2.0, scale_inv.numel()).view(scale_inv.shape)  # distinct per block
    ours = fp8.decode(codes, scale_inv, block)
    assert torch.equal(ours.view(torch.int16), reference(codes, scale_inv, block).view(torch.int16))


def test_encoder_quality_and_zero_blocks():
    """e4m3 with a scale per 128 x 128 block: about 31 dB on Gaussian weights; a block of zeros
    decodes to zeros (its scale is 1, not 0/448)."""
    w = gaussian((256, 256), seed=3)
    w[:128, :128] = 0
    codes, scale_inv = fp8.encode(w)
    assert codes.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32 and scale_inv.shape == (2, 2)
    assert scale_inv[0, 0] == 1.0
    back = fp8.decode(codes, scale_inv)
    assert torch.equal(back[:128, :128], torch.zeros(128, 128, dtype=torch.bfloat16))
    assert 28.0 < quant.sqnr_db(w, back) < 36.0


def test_a_scale_grid_that_does_not_match_is_refused():
    codes, scale_inv = fp8.encode(gaussian((256, 384)))
    with pytest.raises(ValueError) as e:
        fp8.decode(codes, scale_inv[:, :2])
    assert str(e.value) == ("fp8: a weight of shape (256, 384) with blocks of [128, 128] needs weight_scale_inv of shape "
                            "[2, 3], got [2, 2]")
