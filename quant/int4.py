"""Group-wise asymmetric INT4: 4-bit codes; per group an 8-bit scale code and a 4-bit zero point, per row one fp32 scale.

Layout, for a weight the module stores ``[out, in]`` (``[*lead, R, C]``, groups of ``G`` along its
rows): ``codes`` uint8 ``[*lead, R, C/2]`` (byte ``b`` of a row holds element ``2b`` in its low
nibble and ``2b + 1`` in its high one); ``scale`` uint8 ``[*lead, R, C/G]``, each group's scale
code ``k``; ``zero`` uint8 ``[*lead, R, ceil(C/G / 2)]``, each group's zero point, an integer
0..15, two a byte (group ``2i`` in byte ``i``'s low nibble, ``2i + 1`` in its high one; an odd
count leaves the last high nibble 0); ``row_scale`` float32 ``[*lead, R]``. A weight stored
``[in, out]`` (``columns=True``: GPT-OSS) is encoded as its transpose, so its groups also run
along the input axis, in ``codes_t`` (the other field name says which of the two a square weight
is). A tensor of one row (a bias) is kept exact, in bf16 (``data``), as ``quant.int8`` keeps it.

Element ``c`` of row ``r`` decodes to ``(q - z) * s`` in fp32, rounded once to bf16, where ``z``
and ``k`` are its group's (``c // G``) and ``s = row_scale[r] * SCALE_MAP[k]``, one fp32 product
computed first. ``SCALE_MAP[k] = 2 ** ((k - 255) / 24)`` rounded to fp32 (a fixed table: 24 codes
an octave, 1 at 255, about 1/1600 at 0). ``G`` is the largest divisor of the row length ``C`` not
above the group size asked for (``GROUP`` unless set: the YAML's ``tiers.int4.group``), so a row
holds whole groups and the group size follows from the field shapes. Bits per weight:
``4 + 12 / G + 32 / C`` (plus ``4 / C`` for an odd number of groups a row): at ``G`` = 32, 4.391
for rows of 2048 and 4.417 for rows of 768, 4.399 over Qwen3-30B-A3B's experts.

The fit (``fit``): a row's scale is ``MARGIN`` times its largest round-to-nearest group scale (the
group's range, zero included, over 15), so that a group whose best grid is wider than its range
(the zero point is a whole code) or that GPTQ's updates widen (``quant.gptq``) still finds its
scale. Per group, two scales: round-to-nearest's and the one alternating least squares reaches
from it (with the codes fixed, the best scale and offset are a 2x2 linear solve; with those
fixed, the best codes are the rounded ones); then the scale codes within ``SEARCH`` of the code
nearest either, each with the zero points within ``ZERO_SEARCH`` of the one that centres the
group's range, codes rounded, and the pair of least squared error is kept (so never worse than
round-to-nearest stored the same way); of zero points that decode the group alike, the lowest.
A row of zeros gets row scale 0 and decodes to zeros; a row whose range overflows fp32 is
refused (a ValueError).

On the trained model in ../shared/models, over 16 windows of 512 bytes of its eval.txt (mean KL
per byte, GPTQ calibrated on 64 windows the model sampled itself): 0.00779 at group 32, against
0.00740 for the former statistics (fp16 scale, zero point in 1/16 steps: 4 + 24 / G bits) at 32
(4.75 bits) and 0.00878 at 64 (4.375 bits); over four sampled texts 0.00791 on average
(0.00750-0.00831), against 0.00772 and 0.00872; uncalibrated 0.0108, against 0.0098 and 0.0112
(``python experiments/int4_compact.py``, experiments/results/int4_compact.json: arms ``shipped_g32``
for this code, ``compact_g32_log24_m1.5`` for the experiment's fit, which tried all 16 zero points).
GPTQ's figures are sensitive to near-ties in the fit: a search rescaled by ``1 / row_scale``
instead of a power of two decoded 90 of the model's 184,320 groups otherwise and moved the four
figures to 0.00784-0.00872 (0.00817 on average; arms ``noise_g32``).
"""
from __future__ import annotations

import torch

from .core import FieldSpec, QuantizedTensor, register

GROUP = 32  # group size when none is set
LEVELS = 15  # the largest code, and the largest zero point
OCTAVE = 24  # scale codes an octave
SCALE_MAP = torch.exp2((torch.arange(256, dtype=torch.float64) - 255) / OCTAVE).to(torch.float32)  # [256]
MARGIN = 1.5  # a row's scale over its largest round-to-nearest group scale (experiments/int4_compact.py)
# Scale codes tried either side of each of a group's two fits, and zero points either side of the
# one that centres the group's range: on the trained model trying all 16 zero points decoded to the
# same values. Of the zero points that decode a group the same (its codes not reaching 0), the
# lowest is kept, as the search over all 16 measured in experiments/int4_compact.py did: GPTQ
# rounds the group's later columns on that grid.
SEARCH = 8
ZERO_SEARCH = 1
FIT_ITERS = 12

_MAPS: dict[torch.device, torch.Tensor] = {}


def scale_map(device: torch.device) -> torch.Tensor:
    """``SCALE_MAP`` on ``device`` (copied there once)."""
    got = _MAPS.get(device)
    if got is None:
        got = _MAPS[device] = SCALE_MAP.to(device)
    return got


def group_of(cols: int, group: int) -> int:
    """The group size a row of ``cols`` elements gets for ``group`` asked: its largest divisor not
    above ``group``. A ValueError when that is under half of ``min(group, cols)`` (a row length
    with no divisor near the group size: 4 times the statistics' bytes)."""
    if group < 2:
        raise ValueError(f"int4: group size {group}; expected at least 2")
    g = next(d for d in range(min(group, cols), 0, -1) if cols % d == 0)
    if 2 * g < min(group, cols):
        raise ValueError(f"int4: a row of {cols} elements has no divisor near the group size {group} (the nearest is {g}); "
                         f"choose another tiers.int4.group")
    return g


def group_scale(row_scale: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """fp32 group scales ``row_scale * SCALE_MAP[k]`` (``row_scale`` broadcast against ``k``)."""
    return row_scale.to(torch.float32) * scale_map(k.device)[k.long()]


def row_scales(w: torch.Tensor, group: int) -> torch.Tensor:
    """fp32 ``[R]``: ``MARGIN`` times the largest round-to-nearest group scale of each row of ``w``
    ``[R, C]`` (0 for a row of zeros); a ValueError where that overflows fp32."""
    x = w.to(torch.float32).view(w.shape[0], -1, group)  # [R, C/G, G]
    span = x.amax(-1).clamp(min=0) - x.amin(-1).clamp(max=0)  # [R, C/G]
    rs = span.amax(-1) / LEVELS * MARGIN  # [R]
    if not torch.isfinite(rs).all():
        raise ValueError("a row whose range overflows float32 (values near 3.4e38): choose another precision (bf16, int8)")
    return rs


def _rtn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest's scale and offset (value = scale * code + offset) of each row of ``x``
    ``[n, G]``, from its range with 0 included."""
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


def _nearest_code(s: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """The scale code (int64) whose ``SCALE_MAP`` value is nearest ``s / row_scale`` in log, clamped to 0..255."""
    ratio = torch.where(row_scale > 0, s / row_scale, torch.ones_like(s))
    return (255 + OCTAVE * torch.log2(ratio)).round_().clamp_(0, 255).long()


def round_codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The nearest codes (float, 0..15) of ``x`` for an fp32 group ``scale`` (``group_scale``) and
    an integer zero point ``zero``, both broadcast against ``x``; a scale of 0 gives codes 0."""
    s = scale.to(torch.float32)
    return torch.where(s > 0, x / s + zero.to(torch.float32), 0.0).round_().clamp_(0, LEVELS)


def fit(x: torch.Tensor, row_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (float, 0..15) ``[n, G]``, scale codes uint8 ``[n, 1]`` and zero points uint8 ``[n, 1]``
    (0..15) for the groups (rows) of ``x`` float32 ``[n, G]`` whose rows' scale is ``row_scale``
    fp32 ``[n]`` (see the module docstring). The search runs on ``x`` times the power of two that
    brings each row scale into [0.5, 1): exact, so its choices are those on ``x`` itself, while
    squared errors neither underflow nor overflow fp32 whatever the weights' magnitude."""
    rs = row_scale.to(torch.float32)[:, None]  # [n, 1]
    live = rs > 0  # a row of zeros has row scale 0, and decodes to zeros whatever else is stored
    unit = torch.ldexp(torch.ones_like(rs), -torch.frexp(rs).exponent)  # [n, 1]: 2^-e, rs * 2^-e in [0.5, 1)
    u = x * unit  # [n, G]
    s0, off0 = _rtn(u)  # [n, 1] each
    s1, _ = _least_squares(u, s0, off0)
    r = rs * unit  # [n, 1]
    mid = (u.amax(dim=1, keepdim=True) + u.amin(dim=1, keepdim=True)) / 2  # [n, 1]
    steps = list(range(-ZERO_SEARCH, ZERO_SEARCH + 1))  # ascending: the lowest zero point wins ties, as in the search over all 16
    window = torch.tensor(steps, dtype=torch.float32, device=x.device)  # [Z]
    best = torch.full_like(rs, float("inf"))  # [n, 1]
    best_k = torch.zeros_like(rs, dtype=torch.long)
    best_z = torch.zeros_like(rs)
    c0, c1 = _nearest_code(s0, r), _nearest_code(s1, r)  # [n, 1] each
    lo, hi = (c0 - SEARCH).clamp(0, 255), (c0 + SEARCH).clamp(0, 255)  # the codes the first window tries
    for centre, first in ((c0, True), (c1, False)):
        for d in range(-SEARCH, SEARCH + 1):
            k = (centre + d).clamp_(0, 255)  # [n, 1]
            # the second window tries only codes the first did not: a code tried again errs as much, and is never taken
            rows = slice(None) if first else ((k < lo) | (k > hi))[:, 0].nonzero()[:, 0]
            if not first and rows.numel() == 0:
                continue
            e, z = _candidate(u[rows], rs[rows], unit[rows], mid[rows], window, k[rows])  # [m, 1] each
            take = e < best[rows]
            best[rows] = torch.where(take, e, best[rows])
            best_k[rows] = torch.where(take, k[rows], best_k[rows])
            best_z[rows] = torch.where(take, z, best_z[rows])
    best_k, best_z = torch.where(live, best_k, 0), torch.where(live, best_z, 0.0)  # a row of zeros: all fields 0
    q = round_codes(x, group_scale(rs, best_k), best_z)  # [n, G]
    low = torch.minimum(q.amin(dim=1, keepdim=True), best_z)  # [n, 1]: codes and zero point this much lower decode the same;
    return q - low, best_k.to(torch.uint8), (best_z - low).to(torch.uint8)  # the lowest such zero point is kept (see SEARCH)


def _candidate(u: torch.Tensor, rs: torch.Tensor, unit: torch.Tensor, mid: torch.Tensor, window: torch.Tensor,
               k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For scale codes ``k`` ``[n, 1]`` of the groups ``u`` ``[n, G]`` (``fit``'s rescaled groups, their
    row scales ``rs``, ``unit`` and midpoints ``mid``): the least squared error over the zero points
    ``window`` around the centring one, and that zero point (the first of equal errors), ``[n, 1]`` each."""
    m = group_scale(rs, k) * unit  # [n, 1]: the group scale, times 2^-e
    ok = m > 0
    us = torch.where(ok, u / m, 0.0)  # [n, G]
    zc = torch.where(ok, LEVELS / 2 - mid / m, 0.0).round_()  # [n, 1]: the zero point that centres the group
    z = (zc + window).clamp_(0, LEVELS)[:, :, None]  # [n, Z, 1]
    q = (us[:, None, :] + z).round_().clamp_(0, LEVELS)  # [n, Z, G]
    err = ((q - z) * m[:, :, None] - u[:, None, :]).pow_(2).sum(-1)  # [n, Z]
    e, i = err.min(dim=1, keepdim=True)  # [n, 1] each
    return e, z[:, :, 0].gather(1, i)


def group_params(x: torch.Tensor, row_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fit``'s scale codes uint8 ``[n, 1]`` and zero points uint8 ``[n, 1]`` alone, for the groups
    (rows) of ``x`` float32 ``[n, G]`` whose rows' scale is ``row_scale`` ``[n]``: what
    ``quant.gptq`` fits each group with before rounding its columns one by one (``round_codes``)."""
    _, k, z = fit(x, row_scale)
    return k, z


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., C]`` (C even, values 0..15) -> uint8 ``[..., C/2]``, element 2b in the low nibble."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., C/2]`` -> float32 codes ``[..., C]``."""
    return torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2).to(torch.float32)


def pack_zero(z: torch.Tensor) -> torch.Tensor:
    """Zero points ``[..., n]`` (0..15) -> uint8 ``[..., ceil(n / 2)]``, group 2i in byte i's low nibble."""
    z = z.to(torch.uint8)
    if z.shape[-1] % 2:
        z = torch.nn.functional.pad(z, (0, 1))
    return z[..., 0::2] | (z[..., 1::2] << 4)


def unpack_zero(zero: torch.Tensor, groups: int) -> torch.Tensor:
    """uint8 ``[..., ceil(groups / 2)]`` -> float32 zero points ``[..., groups]``."""
    return unpack_codes(zero)[..., :groups]


def decode(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """float32 ``[*lead, R, C]`` from the stored fields (each row's groups from the field shapes)."""
    q = unpack_codes(codes)  # [*lead, R, C]
    *lead, rows, cols = q.shape
    groups = scale.shape[-1]
    q = q.view(*lead, rows, groups, cols // groups)
    s = group_scale(row_scale.unsqueeze(-1), scale).unsqueeze(-1)  # [*lead, R, C/G, 1]
    z = unpack_zero(zero, groups).unsqueeze(-1)  # [*lead, R, C/G, 1]
    return ((q - z) * s).view(*lead, rows, cols)


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
                FieldSpec("scale", torch.uint8, (*lead, rows, cols // g)),
                FieldSpec("zero", torch.uint8, (*lead, rows, -(-cols // g // 2))),
                FieldSpec("row_scale", torch.float32, (*lead, rows)))

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
        cols = w.shape[-1]
        g = cols // specs[1].shape[-1]
        flat = w.reshape(-1, cols)  # [N, C]
        try:
            if hessian is not None:
                from . import gptq  # it builds on this module's fit

                if tuple(hessian.shape) != (cols, cols):
                    raise ValueError(f"int4: a Hessian of shape {tuple(hessian.shape)} for a {shape} weight with {cols} "
                                     f"inputs; expected {(cols, cols)}")
                q, k, z, rs = gptq.quantize(flat, hessian, g)
            else:
                rs = row_scales(flat, g)  # [N]
                q, k, z = fit(flat.reshape(-1, g), rs.repeat_interleave(cols // g))
        except ValueError as e:
            if str(e).startswith("int4:"):
                raise
            raise ValueError(f"precision 'int4': a {shape} weight has {e}") from None
        return QuantizedTensor(self.name, shape, {specs[0].name: pack_codes(q.view(w.shape)).contiguous(),
                                                  "scale": k.view(specs[1].shape).contiguous(),
                                                  "zero": pack_zero(z.view(specs[1].shape)).contiguous(),
                                                  "row_scale": rs.view(specs[3].shape).contiguous()})

    def prepare(self, q: QuantizedTensor) -> QuantizedTensor:
        return q

    def dequantize(self, q: QuantizedTensor, *, out: torch.Tensor) -> torch.Tensor:
        d = q.data
        if "data" in d:  # kept exact
            return out.copy_(d["data"], non_blocking=True)
        columns = "codes_t" in d
        values = decode(d["codes_t" if columns else "codes"], d["scale"], d["zero"], d["row_scale"])  # [*lead, R, C]
        (out.transpose(-1, -2) if columns else out).copy_(values)
        return out


register(Int4())
