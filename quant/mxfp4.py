"""MXFP4 as gpt-oss checkpoints store it: FP4 (E2M1) codes, two per byte, one E8M0 exponent per block of 32.

Layout (one expert's tensor, as the checkpoint holds it): ``blocks`` uint8 ``[N, K/32, 16]`` and
``scales`` uint8 ``[N, K/32]``, where ``K`` is the input dimension the blocks run along and ``N``
the output rows. Byte ``b`` of a block holds value ``2b`` in its low nibble and ``2b + 1`` in its
high nibble; a nibble is a sign bit and a 3-bit magnitude index into ``0, .5, 1, 1.5, 2, 3, 4, 6``;
a scale byte ``s`` multiplies its block by ``2**(s - 127)``. Decoded, the tensor takes the experts
module's (transposed) layout ``[K, N]``, as transformers' gpt-oss conversion gives it.

Two uses:
- ``decode`` / ``dequantize``: the checkpoint's bytes -> bf16, bit for bit what transformers'
  ``convert_moe_packed_tensors`` gives (each value is exact in bf16) for every scale byte but
  255, which E8M0 defines as NaN (transformers reads it as 2**128; reading a checkpoint refuses
  it). Torch ops only, so the same code runs on any device.
- the ``mxfp4`` precision: blobs that keep MXFP4 as the checkpoint stores it (4.25 bits per
  weight, no loss against it), dequantized into bf16 slots. Its ``quantize`` takes only weights
  that are exactly MXFP4 (blocks of 32 along dim -2 of the module layout) and refuses others,
  so a pack from a checkpoint that is not MXFP4 fails instead of silently losing precision.
  Tensors of one dimension (biases, which gpt-oss stores in bf16) are kept in bf16.

``encode`` is the plain rounding encoder (nearest value, ties to the smaller magnitude; the
smallest exponent that holds the block's largest magnitude): it makes test checkpoints, and
re-encodes decoded weights without loss (those of scale bytes up to 252: above, a value can
overflow bf16 to inf, in transformers' decoding too, and the precision refuses it).
"""
from __future__ import annotations

import torch

from .core import FieldSpec, QuantizedTensor, register

BLOCK = 32  # values per block (one scale byte)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
NAN_SCALE = 255  # E8M0's one NaN encoding; transformers reads it as 2**128 instead, so the sources refuse it
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between consecutive magnitudes

_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs bf16 [256, 2]: a byte's low and high nibble values; scales bf16 [256]: 2**(s - 127),
    NaN for 255), built once per device, at its first dequantization there (a copy to the device: not
    inside a CUDA graph capture). Every entry is exact in bf16 (2**-127 is a bf16 subnormal)."""
    tables = _TABLES.get(device)
    if tables is None:
        fp4 = torch.tensor(FP4_VALUES, dtype=torch.float64)
        byte = torch.arange(256)
        pairs = torch.stack([fp4[byte & 15], fp4[byte >> 4]], dim=1).to(torch.bfloat16)  # [256, 2]
        scales = torch.tensor([2.0 ** (s - SCALE_BIAS) if s != NAN_SCALE else float("nan") for s in range(256)], dtype=torch.float64)
        tables = (pairs.to(device), scales.to(torch.bfloat16).to(device))
        _TABLES[device] = tables
    return tables


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """``blocks`` uint8 ``[*lead, N, G, 16]`` and ``scales`` uint8 ``[*lead, N, G]`` -> ``out``
    bf16 ``[*lead, G * 32, N]`` (the transposed module layout), on their device.

    Each value is ``fp4 * 2**(s - 127)``: the product of two bf16 numbers whose exact result is a
    bf16 number, so the rounding of the multiply never acts."""
    *lead, n, g, half = blocks.shape
    if half != BLOCK // 2 or tuple(scales.shape) != (*lead, n, g) or tuple(out.shape) != (*lead, g * BLOCK, n):
        raise ValueError(f"mxfp4: blocks {tuple(blocks.shape)}, scales {tuple(scales.shape)} and out {tuple(out.shape)} do not "
                         f"match (expected [*lead, N, G, 16], [*lead, N, G] and [*lead, G*32, N])")
    pairs, powers = _tables(blocks.device)
    values = pairs.index_select(0, blocks.reshape(-1).to(torch.int32)).view(*lead, n, g, BLOCK)  # [*lead, N, G, 32]
    factor = powers.index_select(0, scales.reshape(-1).to(torch.int32)).view(*lead, n, g, 1)  # [*lead, N, G, 1]
    target = out.transpose(-1, -2).unflatten(-1, (g, BLOCK))  # [*lead, N, G, 32], a view of out
    torch.mul(values, factor, out=target)
    return out


def decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``dequantize`` into a fresh contiguous bf16 tensor ``[*lead, G * 32, N]``."""
    *lead, n, g, _ = blocks.shape
    out = torch.empty((*lead, g * BLOCK, n), dtype=torch.bfloat16, device=blocks.device)
    return dequantize(blocks, scales, out=out)


def encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[*lead, K, N]`` (K a multiple of 32) -> (blocks uint8 ``[*lead, N, K/32, 16]``,
    scales uint8 ``[*lead, N, K/32]``), rounding to the nearest FP4 value of each block's grid.

    A block's exponent is the smallest ``e`` with ``max|w| <= 6 * 2**e`` (clamped to -127..127):
    a block decoded from MXFP4 is then re-encoded exactly, whatever exponent its source chose."""
    *lead, k, n = weight.shape
    if k % BLOCK:
        raise ValueError(f"mxfp4: dimension -2 of a {tuple(weight.shape)} tensor is not a multiple of {BLOCK}")
    w = weight.detach().to(torch.float32).transpose(-1, -2).reshape(*lead, n, k // BLOCK, BLOCK).contiguous()  # [*lead, N, G, 32]
    mantissa, exponent = torch.frexp(w.abs().amax(dim=-1))  # amax = m * 2**x, m in [0.5, 1)
    e = (exponent - 3 + (mantissa > 0.75).to(exponent.dtype)).clamp_(-SCALE_BIAS, SCALE_BIAS)  # [*lead, N, G]
    scaled = torch.ldexp(w.abs(), -e.unsqueeze(-1))  # [*lead, N, G, 32], magnitudes on the grid 0..6
    boundaries = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=w.device)
    codes = torch.bucketize(scaled, boundaries).to(torch.uint8) | (torch.signbit(w).to(torch.uint8) << 3)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [*lead, N, G, 16]
    return blocks.contiguous(), (e + SCALE_BIAS).to(torch.uint8).contiguous()


class Mxfp4:
    """The ``mxfp4`` precision: blocks and scales as the checkpoint stores them (biases in bf16)."""

    name = "mxfp4"
    lossless = False  # a blob is not the slot's bytes: it is dequantized into the slot
    stacks = True

    def fields(self, shape: tuple[int, ...]) -> tuple[FieldSpec, ...]:
        shape = tuple(shape)
        if len(shape) == 1:
            return (FieldSpec("data", torch.bfloat16, shape),)
        *lead, k, n = shape
        if k % BLOCK:
            raise ValueError(f"precision 'mxfp4' needs dimension -2 of each weight to be a multiple of {BLOCK}; "
                             f"a {shape} tensor is not")
        return (FieldSpec("blocks", torch.uint8, (*lead, n, k // BLOCK, BLOCK // 2)),
                FieldSpec("scales", torch.uint8, (*lead, n, k // BLOCK)))

    def quantize(self, weight: torch.Tensor) -> QuantizedTensor:
        """The weight's MXFP4 encoding; a ValueError when it is not exactly MXFP4 (the check decodes
        it again and compares every value, its sign included)."""
        shape = tuple(weight.shape)
        if weight.dim() == 1:
            return QuantizedTensor(self.name, shape, {"data": weight.detach().to(torch.bfloat16).contiguous()})
        self.fields(shape)  # the shape check
        blocks, scales = encode(weight)
        back = decode(blocks, scales)
        w = weight.detach()
        if not (torch.equal(back.to(torch.float32), w.to(torch.float32)) and torch.equal(torch.signbit(back), torch.signbit(w))):
            raise ValueError(
                f"precision 'mxfp4' keeps MXFP4 weights as the checkpoint stores them, without loss, and this {shape} "
                f"weight is not MXFP4 (blocks of {BLOCK} along its input dimension): pack it from an MXFP4 checkpoint, "
                f"or choose another precision (bf16, int8)"
            )
        return QuantizedTensor(self.name, shape, {"blocks": blocks, "scales": scales})

    def prepare(self, q: QuantizedTensor) -> QuantizedTensor:
        return q

    def dequantize(self, q: QuantizedTensor, *, out: torch.Tensor) -> torch.Tensor:
        if "data" in q.data:
            return out.copy_(q.data["data"])
        return dequantize(q.data["blocks"], q.data["scales"], out=out)


register(Mxfp4())
