"""Group-wise asymmetric INT4: 4-bit codes, with an fp16 scale and an 8-bit zero point per group along the input axis.

Layout, for a weight the module stores ``[out, in]`` (``[*lead, R, C]``, groups along its rows):
``codes`` uint8 ``[*lead, R, C/2]`` (byte ``b`` of a row holds element ``2b`` in its low nibble
and ``2b + 1`` in its high one), ``scale`` fp16 ``[*lead, R, C/G]`` and ``zero`` uint8
``[*lead, R, C/G]``. A weight stored ``[in, out]`` (``columns=True``: GPT-OSS) is encoded as its
transpose, so its groups also run along the input axis, in ``codes_t`` (the other field name
says which of the two a square weight is). A tensor of one row (a bias) is kept exact, in bf16
(``data``), as ``quant.int8`` keeps it.

Element ``c`` of row ``r`` decodes to ``(q - zero / 16) * scale`` in fp32, rounded once to bf16;
its group is ``c // G``. ``G`` is the largest divisor of the row length ``C`` not above the
group size asked for (``GROUP`` unless set: the YAML's ``tiers.int4.group``), so a row holds
whole groups and the group size follows from the field shapes. Bits per weight: ``4 + 24 / G``
(4.375 at 64).

The fit (``fit``), per group, without calibration data: round-to-nearest from the group's range
(zero included), then alternating least squares, which minimizes the group's squared error:
with the codes fixed, the best scale and offset are a 2x2 linear solve; with those fixed, the
best codes are the rounded ones. The result is kept only where its error, after the scale is
rounded to fp16 and the zero point to 1/16 of a step, is below round-to-nearest's. A group whose
scale rounds to 0 in fp16 (a range under about 4e-7) decodes to zeros; one whose scale fp16 cannot
hold (a range above 15 x 65504) would decode to NaN, and its weight is refused (a ValueError). On the
trained model in ../shared/models (docs/results.md) this took the mean KL per byte of the
experts' round-to-nearest at group 64 from 0.0136 to 0.0120.
"""
from __future__ import annotations

import torch

from .core import FieldSpec, QuantizedTensor, register

GROUP = 64  # group size when none is set
ZERO_STEPS = 16  # a zero point is stored in 1/16 of a code step: uint8 0..255 is 0..15.9375
LEVELS = 15  # the largest code
FIT_ITERS = 12
FP16_MAX = torch.finfo(torch.float16).max


def group_of(cols: int, group: int) -> int:
    """The group size a row of ``cols`` elements gets for ``group`` asked: its largest divisor not
    above ``group``. A ValueError when that is under half of ``min(group, cols)`` (a row length
    with no divisor near the group size: 4 times the scale bytes)."""
    if group < 2:
        raise ValueError(f"int4: group size {group}; expected at least 2")
    g = next(d for d in range(min(group, cols), 0, -1) if cols % d == 0)
    if 2 * g < min(group, cols):
        raise ValueError(f"int4: a row of {cols} elements has no divisor near the group size {group} (the nearest is {g}); "
                         f"choose another tiers.int4.group")
    return g


def _rtn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest's scale and offset (value = scale * code + offset) of each row of ``x``
    ``[n, G]``, from its range with 0 included, so that the zero point lies in 0..15."""
    lo = x.amin(dim=1, keepdim=True).clamp(max=0)
    hi = x.amax(dim=1, keepdim=True).clamp(min=0)
    scale = (hi - lo) / LEVELS
    return torch.where(scale > 0, scale, torch.ones_like(scale)), lo


def _least_squares(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``FIT_ITERS`` rounds of: codes for the current scale and offset, then the scale and offset
    that minimize the squared error for those codes (kept where the solve is degenerate or
    gives a scale that is not positive)."""
    n = x.shape[1]
    sx = x.sum(dim=1, keepdim=True)
    for _ in range(FIT_ITERS):
        q = ((x - offset) / scale).round_().clamp_(0, LEVELS)
        sq, sqq, sqx = q.sum(dim=1, keepdim=True), (q * q).sum(dim=1, keepdim=True), (q * x).sum(dim=1, keepdim=True)
        det = n * sqq - sq * sq
        s = (n * sqx - sq * sx) / torch.where(det > 0, det, torch.ones_like(det))
        ok = (det > 0) & (s > 0)
        scale = torch.where(ok, s, scale)
        offset = torch.where(ok, (sx - s * sq) / n, offset)
    return scale, offset


def round_codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The nearest codes (float, 0..15) of ``x`` for a stored fp16 ``scale`` and zero point ``zero``
    (in 1/16 steps), both broadcast against ``x``."""
    s = scale.to(torch.float32)
    return torch.where(s > 0, x / s + zero.to(torch.float32) / ZERO_STEPS, 0.0).round_().clamp_(0, LEVELS)  # a 0 scale: codes 0


def _stored(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The stored form of a fit: fp16 scale, zero point in 1/16 steps, codes for those; and the
    squared error of each row as decoded."""
    s16 = scale.to(torch.float16)
    s = s16.to(torch.float32)
    live = s > 0  # [n, 1]; a scale under fp16's smallest step is 0: that group decodes to zeros, its codes and zero point 0
    zero = torch.where(live, -offset / s * ZERO_STEPS, 0.0).round_().clamp_(0, 255)
    q = round_codes(x, s16, zero)
    err = ((q - zero / ZERO_STEPS) * s - x).pow_(2).sum(dim=1, keepdim=True)
    return q, s16, zero, err


def fit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (float, 0..15) ``[n, G]``, scales fp16 ``[n, 1]`` and zero points uint8 ``[n, 1]``
    for the groups (rows) of ``x`` float32 ``[n, G]`` (see the module docstring); a ValueError where
    a group's range needs a scale above fp16's largest."""
    scale, offset = _rtn(x)
    if torch.isinf(scale.to(torch.float16)).any():  # an inf scale decodes to NaN
        span = (scale.max() * LEVELS).item()
        raise ValueError(f"a group spanning {span:.3g}, more than an fp16 scale holds over {LEVELS} codes "
                         f"({LEVELS} x {FP16_MAX:.0f} = {LEVELS * FP16_MAX:.0f}): choose another precision (bf16, int8)")
    base = _stored(x, scale, offset)
    fitted = _stored(x, *_least_squares(x, scale, offset))
    better = fitted[3] < base[3]  # [n, 1]
    q, s, z = (torch.where(better, a, b) for a, b in zip(fitted[:3], base[:3]))
    return q, s, z.to(torch.uint8)


def group_params(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fit``'s scales fp16 ``[n, 1]`` and zero points uint8 ``[n, 1]`` alone, for the groups (rows)
    of ``x`` float32 ``[n, G]``: what ``quant.gptq`` fits each group with before rounding its
    columns one by one (``round_codes``)."""
    _, s, z = fit(x)
    return s, z


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., C]`` (C even, values 0..15) -> uint8 ``[..., C/2]``, element 2b in the low nibble."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., C/2]`` -> float32 codes ``[..., C]``."""
    return torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2).to(torch.float32)


def decode(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """float32 ``[*lead, R, C]`` from the stored fields (each row's groups from the field shapes)."""
    q = unpack_codes(codes)  # [*lead, R, C]
    *lead, rows, cols = q.shape
    groups = scale.shape[-1]
    q = q.view(*lead, rows, groups, cols // groups)
    z = (zero.to(torch.float32) / ZERO_STEPS).unsqueeze(-1)
    return ((q - z) * scale.to(torch.float32).unsqueeze(-1)).view(*lead, rows, cols)


class Int4:
    """The ``int4`` precision (see the module docstring)."""

    name = "int4"
    lossless = False
    stacks = True
    per_output_row = True  # takes ``columns=True`` for weights stored [in, out]
    takes_group = True  # takes ``group=``, the group size asked for
    takes_hessian = True  # takes ``hessian=``, the inputs' X^T X (calibrated packs)
    default_group = GROUP

    def fields(self, shape: tuple[int, ...], *, columns: bool = False, group: int = GROUP) -> tuple[FieldSpec, ...]:
        shape = tuple(shape)
        if len(shape) < 2:  # one row: exact
            return (FieldSpec("data", torch.bfloat16, shape),)
        *lead, a, b = shape
        rows, cols = (b, a) if columns else (a, b)
        if cols % 2:
            raise ValueError(f"precision 'int4' packs two codes a byte along the input axis; a {shape} weight has {cols} "
                             f"inputs, an odd number")
        g = group_of(cols, group)
        return (FieldSpec("codes_t" if columns else "codes", torch.uint8, (*lead, rows, cols // 2)),
                FieldSpec("scale", torch.float16, (*lead, rows, cols // g)),
                FieldSpec("zero", torch.uint8, (*lead, rows, cols // g)))

    def quantize(self, weight: torch.Tensor, *, columns: bool = False, group: int = GROUP,
                 hessian: torch.Tensor | None = None) -> QuantizedTensor:
        """``hessian`` ``[C, C]`` over the input axis (``X^T X`` of the inputs the weight sees, for a
        ``columns=True`` weight too): GPTQ's rounding (``quant.gptq``) instead of the plain fit; the
        stored form is the same. A tensor of one row ignores it."""
        shape = tuple(weight.shape)
        if weight.dim() < 2:
            return QuantizedTensor(self.name, shape, {"data": weight.detach().to(torch.bfloat16).contiguous()})
        specs = self.fields(shape, columns=columns, group=group)
        w = weight.detach().to(torch.float32)
        w = w.transpose(-1, -2) if columns else w  # [*lead, R, C]
        groups = specs[1].shape[-1]
        try:
            if hessian is not None:
                from . import gptq  # it builds on this module's fit

                if tuple(hessian.shape) != (w.shape[-1],) * 2:
                    raise ValueError(f"int4: a Hessian of shape {tuple(hessian.shape)} for a {shape} weight with {w.shape[-1]} "
                                     f"inputs; expected {(w.shape[-1],) * 2}")
                q, s, z = gptq.quantize(w.reshape(-1, w.shape[-1]), hessian, w.shape[-1] // groups)
            else:
                q, s, z = fit(w.reshape(-1, w.shape[-1] // groups))
        except ValueError as e:
            if str(e).startswith("int4:"):
                raise
            raise ValueError(f"precision 'int4': a {shape} weight has {e}") from None
        return QuantizedTensor(self.name, shape, {specs[0].name: pack_codes(q.view(w.shape)).contiguous(),
                                                  "scale": s.view(specs[1].shape).contiguous(),
                                                  "zero": z.view(specs[2].shape).contiguous()})

    def prepare(self, q: QuantizedTensor) -> QuantizedTensor:
        return q

    def dequantize(self, q: QuantizedTensor, *, out: torch.Tensor) -> torch.Tensor:
        d = q.data
        if "data" in d:  # kept exact
            return out.copy_(d["data"], non_blocking=True)
        columns = "codes_t" in d
        values = decode(d["codes_t" if columns else "codes"], d["scale"], d["zero"])  # [*lead, R, C]
        (out.transpose(-1, -2) if columns else out).copy_(values)
        return out


register(Int4())
