"""NF4 as bitsandbytes stores it (QLoRA's 4-bit NormalFloat), with its absmax statistics double-quantized.

Layout of a weight of ``numel`` elements, in the module's own memory order (blocks of 64
consecutive elements, whichever axis they run along, as bitsandbytes blocks a tensor):
``codes`` uint8 ``[numel/2]`` (byte ``b`` holds element ``2b`` in its high nibble and ``2b + 1``
in its low one, bitsandbytes' order), ``qabsmax`` uint8 ``[blocks]``, ``absmax2`` fp32
``[ceil(blocks/256)]`` and ``offset`` fp32 ``[1]``: bitsandbytes' ``compress_statistics``, where
each block's absmax, less their mean (``offset``), is quantized blockwise to 8 bits (its dynamic
map, 256 absmaxes a block). Bits per weight: about 4.13. A tensor of one row (a bias) is kept
exact, in bf16 (``data``).

Decoding an element: ``NF4[q] * (DYNAMIC[qabsmax] * absmax2 + offset)``, in fp32, rounded once
to the output dtype: what ``bitsandbytes.functional.dequantize_4bit`` computes. On CUDA the
dequantization is bitsandbytes' own kernel; elsewhere these torch operations, equal to it bit for
bit (the tests compare them), and equal to bitsandbytes' CPU ``dequantize_4bit`` only where each
row is a whole number of blocks: that one (0.50) decodes other tensors wrongly (a 1000 x 96 weight
came back at 12 dB where its encoding holds 20.8). Encoding picks each element's nearest NF4 value
in torch, on whichever device the weight is, equal field for field to bitsandbytes'
``quantize_4bit(w.reshape(-1, w.shape[-1]), blocksize=64, quant_type="nf4",
compress_statistics=True)`` (the tests compare them); the absmax statistics go through its
``quantize_blockwise``.
bitsandbytes is imported on first use (its import is slow).
"""
from __future__ import annotations

import math

import torch

from .core import FieldSpec, QuantizedTensor, register

BLOCK = 64
STATS_BLOCK = 256  # absmaxes per block of the double quantization
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635, -0.18477343022823334,
       -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
       0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)


def _functional():
    import bitsandbytes.functional as F  # lazy: slow import

    return F


_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(NF4 values fp32 [16], bitsandbytes' signed dynamic 8-bit map fp32 [256]) on ``device``."""
    got = _TABLES.get(device)
    if got is None:
        dynamic = _functional().create_dynamic_map(signed=True).to(torch.float32)
        got = _TABLES[device] = (torch.tensor(NF4, dtype=torch.float32, device=device), dynamic.to(device))
    return got


def blocks_of(numel: int) -> int:
    return math.ceil(numel / BLOCK)


def encode(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The NF4 fields of ``weight`` (any shape, an even number of elements)."""
    flat = weight.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    padded = torch.nn.functional.pad(flat, (0, blocks_of(n) * BLOCK - n)).view(-1, BLOCK)  # [blocks, 64]
    absmax = padded.abs().amax(dim=1)  # [blocks]
    nf4, _ = tables(flat.device)
    scaled = padded / torch.where(absmax > 0, absmax, torch.ones_like(absmax)).unsqueeze(1)
    midpoints = (nf4[1:] + nf4[:-1]) / 2
    q = torch.bucketize(scaled, midpoints).to(torch.uint8).view(-1)[:n]  # the nearest value (at a midpoint, the lower: bitsandbytes thresholds with ">")
    codes = (q[0::2] << 4) | q[1::2]
    offset = absmax.mean()
    qabsmax, state = _functional().quantize_blockwise((absmax - offset).cpu(), blocksize=STATS_BLOCK)
    dev = flat.device
    return {"codes": codes.contiguous(), "qabsmax": qabsmax.to(dev), "absmax2": state.absmax.to(dev, torch.float32),
            "offset": offset.reshape(1)}


def absmax_of(qabsmax: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Each block's absmax, fp32 ``[*lead, blocks]``, from its double-quantized form."""
    _, dynamic = tables(qabsmax.device)
    *lead, blocks = qabsmax.shape
    padded = torch.nn.functional.pad(qabsmax, (0, absmax2.shape[-1] * STATS_BLOCK - blocks))
    v = dynamic[padded.long()].view(*lead, absmax2.shape[-1], STATS_BLOCK) * absmax2.unsqueeze(-1)
    return v.view(*lead, -1)[..., :blocks] + offset


def decode(fields: dict[str, torch.Tensor], numel: int) -> torch.Tensor:
    """float32 ``[*lead, numel]`` from the fields (leading dims: several experts stacked)."""
    nf4, _ = tables(fields["codes"].device)
    codes = fields["codes"]
    q = torch.stack([codes >> 4, codes & 15], dim=-1).flatten(-2).long()  # [*lead, numel]
    absmax = absmax_of(fields["qabsmax"], fields["absmax2"], fields["offset"])  # [*lead, blocks]
    lead = q.shape[:-1]
    padded = torch.nn.functional.pad(nf4[q], (0, absmax.shape[-1] * BLOCK - numel)).view(*lead, -1, BLOCK)
    return (padded * absmax.unsqueeze(-1)).view(*lead, -1)[..., :numel]


class Nf4:
    """The ``nf4`` precision (see the module docstring)."""

    name = "nf4"
    lossless = False
    stacks = True

    def fields(self, shape: tuple[int, ...]) -> tuple[FieldSpec, ...]:
        shape = tuple(shape)
        if len(shape) < 2:  # one row: exact
            return (FieldSpec("data", torch.bfloat16, shape),)
        numel = math.prod(shape)
        if numel % 2:
            raise ValueError(f"precision 'nf4' packs two codes a byte; a {shape} weight has an odd number of elements")
        blocks = blocks_of(numel)
        return (FieldSpec("codes", torch.uint8, (numel // 2,)), FieldSpec("qabsmax", torch.uint8, (blocks,)),
                FieldSpec("absmax2", torch.float32, (math.ceil(blocks / STATS_BLOCK),)), FieldSpec("offset", torch.float32, (1,)))

    def quantize(self, weight: torch.Tensor) -> QuantizedTensor:
        shape = tuple(weight.shape)
        if weight.dim() < 2:
            return QuantizedTensor(self.name, shape, {"data": weight.detach().to(torch.bfloat16).contiguous()})
        self.fields(shape)  # the shape check
        return QuantizedTensor(self.name, shape, encode(weight))

    def prepare(self, q: QuantizedTensor) -> QuantizedTensor:
        return q

    def dequantize(self, q: QuantizedTensor, *, out: torch.Tensor) -> torch.Tensor:
        d = q.data
        if "data" in d:  # kept exact
            return out.copy_(d["data"], non_blocking=True)
        lead = out.shape[: d["codes"].dim() - 1]  # experts stacked ahead of each field's one dimension
        numel = math.prod(out.shape[len(lead):])
        if out.device.type == "cuda" and not lead and out.is_contiguous():
            return _bnb_dequantize(d, out)
        out.copy_(decode(d, numel).view(out.shape))
        return out


def _bnb_dequantize(d: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' CUDA dequantization of one tensor's fields into ``out``."""
    F = _functional()
    nf4, dynamic = tables(out.device)
    state2 = F.QuantState(absmax=d["absmax2"], code=dynamic, blocksize=STATS_BLOCK, dtype=torch.float32)
    state = F.QuantState(absmax=d["qabsmax"], shape=out.shape, dtype=out.dtype, blocksize=BLOCK, code=nf4, quant_type="nf4",
                         offset=d["offset"][0], state2=state2)
    F.dequantize_4bit(d["codes"].view(-1, 1), state, out=out)
    return out


register(Nf4())
