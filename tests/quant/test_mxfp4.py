"""quant.mxfp4: decoding gpt-oss's MXFP4 bit for bit as transformers does, the encoder, and the
``mxfp4`` precision (lossless against MXFP4 weights, refusing any other)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from tiers import quant
from tiers.quant import QuantizedTensor, mxfp4


def random_mxfp4(lead=(3,), n=40, groups=4, seed=0, scales=(0, 254)):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*lead, n, groups, 16), dtype=torch.uint8, generator=g)
    s = torch.randint(scales[0], scales[1] + 1, (*lead, n, groups), dtype=torch.uint8, generator=g)
    return blocks, s


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A plain dequantizer from the format's definition, value by value in float64: byte b holds
    value 2b (low nibble) and 2b + 1 (high nibble), times 2**(scale - 127), then [.., K, N]."""
    fp4 = torch.tensor(FP4_VALUES, dtype=torch.float64)
    lo, hi = fp4[(blocks & 15).long()], fp4[(blocks >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).flatten(-2)  # [*lead, N, G, 32]
    vals = vals * torch.pow(2.0, scales.to(torch.float64) - 127).unsqueeze(-1)
    return vals.flatten(-2).transpose(-1, -2).to(torch.bfloat16)


# -- decoding against transformers ----------------------------------------------------------------
def test_decode_equals_transformers_bit_for_bit_for_every_scale_but_nan():
    blocks, _ = random_mxfp4(lead=(2,), n=255, groups=2, seed=1)
    scales = torch.arange(255, dtype=torch.uint8).repeat(2, 2, 1).transpose(-1, -2).contiguous()  # every byte 0..254
    assert scales.shape == (2, 255, 2)
    ours = mxfp4.decode(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert ours.shape == theirs.shape == (2, 64, 255)
    assert torch.equal(bits(ours), bits(theirs))
    assert torch.equal(bits(ours), bits(reference(blocks, scales)))


def test_decode_layout_nibble_order_and_transpose():
    """One expert, one row, one block: byte 0 = 0x71 holds value 0 = +0.5 (low nibble 1) and
    value 1 = +6 (high nibble 7); scale 128 doubles them; the block runs down column 0."""
    blocks = torch.zeros((1, 1, 16), dtype=torch.uint8)
    blocks[0, 0, 0] = 0x71
    blocks[0, 0, 15] = 0x9A  # value 30 = -1 (0xA), value 31 = -0.5 (0x9)
    out = mxfp4.decode(blocks, torch.full((1, 1), 128, dtype=torch.uint8))
    assert out.shape == (32, 1)
    want = torch.zeros(32)
    want[0], want[1], want[30], want[31] = 1.0, 12.0, -2.0, -1.0
    assert torch.equal(out[:, 0].float(), want)


def test_nan_scale_decodes_to_nan():
    blocks, scales = random_mxfp4(n=2, groups=1)
    scales[0, 0, 0] = mxfp4.NAN_SCALE
    out = mxfp4.decode(blocks, scales)
    assert out[0, :32, 0].isnan().all() and not out[0, :, 1].isnan().any()


def test_dequantize_checks_shapes():
    blocks, scales = random_mxfp4()
    with pytest.raises(ValueError, match=r"do not match \(expected \[\*lead, N, G, 16\]"):
        mxfp4.dequantize(blocks, scales, out=torch.empty((3, 40, 128), dtype=torch.bfloat16))


# -- the encoder ----------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lo=st.integers(0, 252), span=st.integers(0, 40))
def test_decoded_mxfp4_reencodes_exactly(seed, lo, span):
    """Whatever exponents the source chose (the largest code of a block need not be 6), its
    decoded values re-encode to the same values, signs of zero included. (Scale bytes above 252
    can overflow bf16: 6 * 2**126 is inf, in transformers' decoding too.)"""
    blocks, scales = random_mxfp4(lead=(2,), n=5, groups=3, seed=seed, scales=(lo, min(252, lo + span)))
    blocks[0, 0] &= 0x33  # small codes under a large exponent: a non-canonical block
    decoded = mxfp4.decode(blocks, scales)
    again = mxfp4.decode(*mxfp4.encode(decoded))
    assert torch.equal(bits(again), bits(decoded))


def test_encoding_is_stable_after_one_pass():
    """Encoding what an encoding decodes to gives the same bytes once the encoding has been through
    one round: a pack from a checkpoint in that form keeps its blocks and scales byte for byte."""
    w = torch.randn(2, 64, 24).to(torch.bfloat16)
    blocks, scales = mxfp4.encode(mxfp4.decode(*mxfp4.encode(w)))
    assert blocks.shape == (2, 24, 2, 16) and scales.shape == (2, 24, 2)
    again_b, again_s = mxfp4.encode(mxfp4.decode(blocks, scales))
    assert torch.equal(again_b, blocks) and torch.equal(again_s, scales)


def test_encoder_rounds_to_nearest():
    """4-bit floats with an exponent per 32 values: about 16-19 dB on Gaussian weights, and each
    value within half a grid step (at most 1 at the 4..6 step) times its block's scale."""
    w = torch.randn(256, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    blocks, scales = mxfp4.encode(w)
    back = mxfp4.decode(blocks, scales)
    assert 14.0 < quant.sqnr_db(w, back) < 22.0
    step = torch.pow(2.0, scales.float() - 127).repeat_interleave(32, dim=-1).t()  # [K, N]
    assert ((back.float() - w.float()).abs() <= step * 1.0 + 1e-30).all()


# -- the precision --------------------------------------------------------------------------------
def test_precision_fields_are_425_bits_per_weight():
    s = quant.get_scheme("mxfp4")
    fields = s.fields((2880, 5760))
    assert [(f.name, f.dtype, f.shape) for f in fields] == [("blocks", torch.uint8, (5760, 90, 16)), ("scales", torch.uint8, (5760, 90))]
    assert sum(f.nbytes for f in fields) * 8 / (2880 * 5760) == 4.25
    assert [(f.name, f.dtype) for f in s.fields((5760,))] == [("data", torch.bfloat16)]
    assert not s.lossless and s.stacks
    with pytest.raises(ValueError, match=r"multiple of 32; a \(48, 64\) tensor is not"):
        s.fields((48, 64))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_precision_roundtrip_is_exact_and_stacks(device):
    s = quant.get_scheme("mxfp4")
    blocks, scales = random_mxfp4(lead=(4,), n=24, groups=2, seed=5, scales=(100, 140))
    weights = mxfp4.decode(blocks, scales)  # [4, 64, 24], exactly MXFP4
    qs = [s.quantize(weights[i]) for i in range(4)]
    stacked = QuantizedTensor("mxfp4", (4, 64, 24), {k: torch.stack([q.data[k] for q in qs]).to(device) for k in ("blocks", "scales")})
    out = torch.full((4, 64, 24), float("nan"), dtype=torch.bfloat16, device=device)
    s.dequantize(s.prepare(stacked), out=out)
    assert torch.equal(bits(out.cpu()), bits(weights))
    one = torch.empty((64, 24), dtype=torch.bfloat16, device=device)
    q = QuantizedTensor("mxfp4", (64, 24), {k: v.to(device) for k, v in qs[2].data.items()})
    s.dequantize(q, out=one)
    assert torch.equal(bits(one.cpu()), bits(weights[2]))
    bias = torch.randn(24).to(torch.bfloat16)
    qb = s.quantize(bias)
    back = torch.empty(24, dtype=torch.bfloat16, device=device)
    s.dequantize(QuantizedTensor("mxfp4", (24,), {"data": qb.data["data"].to(device)}), out=back)
    assert torch.equal(back.cpu(), bias)


def test_precision_refuses_a_weight_that_is_not_mxfp4():
    s = quant.get_scheme("mxfp4")
    weights = mxfp4.decode(*random_mxfp4(lead=(), n=8, groups=2))  # [64, 8]
    s.quantize(weights)  # exactly MXFP4: accepted
    off = weights.clone()
    off[3, 5] = off[3, 5] * 1.0078125 + 0.001  # one value off the grid
    with pytest.raises(ValueError) as e:
        s.quantize(off)
    assert str(e.value) == (
        "precision 'mxfp4' keeps MXFP4 weights as the checkpoint stores them, without loss, and this (64, 8) weight is not "
        "MXFP4 (blocks of 32 along its input dimension): pack it from an MXFP4 checkpoint, or choose another precision (bf16, int8)"
    )
    across = mxfp4.decode(*random_mxfp4(lead=(), n=64, groups=1, scales=(120, 130))).t().contiguous()  # [64, 32]
    with pytest.raises(ValueError, match="is not MXFP4"):  # MXFP4 blocks along dim -1, not along the input dimension
        s.quantize(across)
    assert math.isinf(quant.sqnr_db(weights, weights))


def test_precision_keeps_negative_zero():
    s = quant.get_scheme("mxfp4")
    w = torch.zeros(32, 2, dtype=torch.bfloat16)
    w[0, 0], w[1, 0] = -0.0, 3.0
    q = s.quantize(w)
    out = torch.empty_like(w)
    s.dequantize(q, out=out)
    assert torch.equal(bits(out), bits(w))
