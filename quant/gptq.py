"""GPTQ's error-compensating rounding (Frantar et al. 2022) for ``quant.int4``'s stored form.

``quantize(weight, hessian, group)`` rounds a weight ``[R, C]`` (rows are outputs, columns inputs)
to int4 codes column by column, in order, and spreads each column's rounding error over the
columns not yet rounded, weighted by the inverse of ``hessian`` ``[C, C]`` (``X^T X`` of the
inputs ``X`` ``[n, C]`` the weight sees), so that the error of the outputs ``W X^T``, not of the
weights, is what is kept small. Each row's scale (``quant.int4.row_scales``) is taken from the
weights as given, before any column is rounded; each group's scale code and zero point are
fitted, at the group's first column, by int4's own fit (``quant.int4.group_params``) on the
group's weights as the errors of the earlier columns left them, within that row scale. The
result is exactly what ``quant.int4`` stores: codes 0..15, and per group of ``group`` inputs a
scale code ``k`` and an integer zero point ``z``, per row an fp32 ``row_scale``, decoding to
``(q - z) * row_scale * SCALE_MAP[k]``.

Standard GPTQ: an input no calibration row reached (zero on the diagonal) gets 1 there and its
weights are set to 0; ``damp`` times the diagonal's mean is added to the diagonal; the upper
Cholesky factor of the inverse carries the updates, applied lazily, a block of columns at a time
(blocks are whole groups, so a group's fit sees every update of the columns before it).

With a diagonal ``hessian`` (the identity included) nothing is propagated: every column is
rounded to the nearest code of its group's fit on the weights as given, which is what
``quant.int4.fit`` stores, code for code.
"""
from __future__ import annotations

import torch

from .int4 import group_params, group_scale, round_codes, row_scales

BLOCK = 128  # columns per lazy update (rounded down to whole groups, at least one)
DAMP_RETRIES = 4  # a Hessian Cholesky refuses even damped gets 10 times the damping, this many times


def _inverse_factor(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1`` ``[C, C]``."""
    h = hessian
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    step = damp * h.diagonal().mean()
    for _ in range(DAMP_RETRIES + 1):
        low, info = torch.linalg.cholesky_ex(h + step * eye)
        if int(info) == 0:
            inv = torch.cholesky_inverse(low)  # [C, C]
            up, info = torch.linalg.cholesky_ex(inv, upper=True)
            if int(info) == 0:
                return up
        step = step * 10
    raise ValueError(f"gptq: the Hessian ({h.shape[0]} inputs) is not positive definite even damped by {float(step):.3g}")


def quantize(weight: torch.Tensor, hessian: torch.Tensor, group: int, damp: float = 0.01
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (float, 0..15) ``[R, C]``, scale codes uint8 ``[R, C/G]``, zero points uint8 ``[R, C/G]``
    (0..15, one a byte) and row scales fp32 ``[R]`` of ``weight`` float32 ``[R, C]`` for the inputs'
    ``hessian`` float32 ``[C, C]``, in groups of ``group`` inputs (a divisor of C; see the module
    docstring)."""
    rows, cols = weight.shape
    assert cols % group == 0, f"group {group} does not divide the {cols} inputs"
    assert hessian.shape == (cols, cols), f"hessian {tuple(hessian.shape)} for {cols} inputs"
    w = weight.detach().to(torch.float32).clone()  # [R, C], rounded columns' errors added as it goes
    rs = row_scales(w, group)  # [R]
    h = hessian.detach().to(device=w.device, dtype=torch.float32).clone()  # [C, C]
    dead = h.diagonal() == 0  # [C]
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    u = _inverse_factor(h, damp)  # [C, C]
    q = torch.empty_like(w)  # [R, C]
    scale = torch.empty(rows, cols // group, dtype=torch.uint8, device=w.device)  # [R, C/G]
    zero = torch.empty(rows, cols // group, dtype=torch.uint8, device=w.device)  # [R, C/G]
    block = max(1, BLOCK // group) * group
    for a in range(0, cols, block):
        b = min(a + block, cols)
        wb = w[:, a:b]  # [R, B] a view: updates within the block land in w
        err = torch.empty_like(wb)  # [R, B]
        ub = u[a:b, a:b]  # [B, B]
        for i in range(b - a):
            if i % group == 0:
                k, z = group_params(wb[:, i:i + group], rs)  # [R, 1] each
                scale[:, (a + i) // group], zero[:, (a + i) // group] = k[:, 0], z[:, 0]
                sf, zf = group_scale(rs, k[:, 0]), z[:, 0].to(torch.float32)  # [R]
            col = wb[:, i]  # [R]
            qc = round_codes(col, sf, zf)  # [R]
            q[:, a + i] = qc
            e = (col - (qc - zf) * sf) / ub[i, i]  # [R]
            wb[:, i:].sub_(e[:, None] * ub[i, i:][None, :])  # [R, B - i]
            err[:, i] = e
        w[:, b:].sub_(err @ u[a:b, b:])  # [R, C - b]
    return q, scale, zero, rs
