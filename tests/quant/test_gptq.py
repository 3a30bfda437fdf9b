"""quant.gptq: GPTQ's rounding in int4's stored form, against int4's plain fit."""
from __future__ import annotations

import pytest
import torch

from tiers.quant import get_scheme, gptq, int4

INT4 = get_scheme("int4")


def _inputs(n: int, cols: int, seed: int) -> torch.Tensor:
    """``n`` correlated inputs ``[n, cols]``: one fixed mixing of the columns (seed 0), fresh draws per ``seed``,
    and input scales spread over two orders of magnitude."""
    g = torch.Generator().manual_seed(0)
    mix = torch.eye(cols) + torch.randn(cols, cols, generator=g) / cols**0.5  # [C, C]
    spread = torch.logspace(-1, 1, cols)[torch.randperm(cols, generator=g)]  # [C]
    return torch.randn(n, cols, generator=torch.Generator().manual_seed(seed)) @ mix * spread  # [n, C]


def _decoded(q) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    INT4.dequantize(q, out=out)
    return out.float()


def _weight(rows: int, cols: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(1)) * 0.05  # [R, C]


def test_gptq_output_error_is_below_the_plain_fit_on_its_inputs_and_on_fresh_ones():
    w = _weight(96, 128)  # [R, C]
    x = _inputs(2048, 128, seed=1)  # [n, C]
    held = _inputs(2048, 128, seed=2)
    plain, calibrated = _decoded(INT4.quantize(w)), _decoded(INT4.quantize(w, hessian=x.t() @ x))
    for inputs in (x, held):
        e_plain = ((w - plain) @ inputs.t()).norm()
        e_gptq = ((w - calibrated) @ inputs.t()).norm()
        assert e_gptq < 0.9 * e_plain, (e_gptq, e_plain)
    # the weights themselves move further: GPTQ trades weight error for output error
    assert (w - calibrated).norm() > (w - plain).norm()


@pytest.mark.parametrize("diagonal", ["identity", "scaled", "any"])
def test_a_diagonal_hessian_propagates_nothing_so_gptq_stores_the_plain_fit_exactly(diagonal):
    w = _weight(64, 128)
    h = {"identity": torch.eye(128), "scaled": 7.5 * torch.eye(128),
         "any": torch.diag(torch.rand(128, generator=torch.Generator().manual_seed(3)) + 0.1)}[diagonal]
    plain, calibrated = INT4.quantize(w), INT4.quantize(w, hessian=h)
    assert plain.data.keys() == calibrated.data.keys()
    for k in plain.data:
        assert torch.equal(plain.data[k], calibrated.data[k]), k


def test_stored_form_decodes_with_int4_decode_and_matches_the_scheme_fields():
    w = _weight(48, 160)  # 160 inputs: group 64 asked gives 40, 32 asked 32 (an odd count of groups: 5)
    x = _inputs(1024, 160, seed=1)
    for group, n in ((40, 4), (32, 5)):
        q, scale, zero, rs = gptq.quantize(w, x.t() @ x, group=group)
        assert q.shape == (48, 160) and scale.shape == zero.shape == (48, n) and rs.shape == (48,)
        assert scale.dtype == zero.dtype == torch.uint8 and rs.dtype == torch.float32 and zero.max() <= 15
        assert torch.equal(rs, int4.row_scales(w, group))  # from the weights as given
        assert q.min() >= 0 and q.max() <= 15 and torch.equal(q, q.round())
        packed = INT4.quantize(w, hessian=x.t() @ x, group=64 if group == 40 else 32)
        assert torch.equal(packed.data["codes"], int4.pack_codes(q))
        assert torch.equal(packed.data["scale"], scale) and torch.equal(packed.data["zero"], int4.pack_zero(zero))
        assert torch.equal(packed.data["row_scale"], rs)
        s = rs[:, None] * int4.SCALE_MAP[scale.long()]  # [R, groups]: one fp32 product
        by_hand = (q.view(48, n, group) - zero.float()[..., None]) * s[..., None]  # [R, groups, G]
        assert torch.equal(int4.decode(int4.pack_codes(q), scale, int4.pack_zero(zero), rs), by_hand.view(48, 160))


def test_a_transposed_weight_takes_the_hessian_over_its_input_axis():
    w = _weight(64, 128)  # [out, in]
    x = _inputs(1024, 128, seed=1)
    rows = INT4.quantize(w, hessian=x.t() @ x)
    cols = INT4.quantize(w.t().contiguous(), columns=True, hessian=x.t() @ x)  # stored [in, out], as GPT-OSS does
    assert torch.equal(rows.data["codes"], cols.data["codes_t"])
    for name in ("scale", "zero", "row_scale"):
        assert torch.equal(rows.data[name], cols.data[name]), name


def test_inputs_no_row_reached_are_dropped_and_the_rest_still_gain():
    w = _weight(64, 128)
    x = _inputs(2048, 128, seed=1)
    x[:, 5] = 0  # an input that is never on
    x[:, 70] = 0
    q = INT4.quantize(w, hessian=x.t() @ x)
    got = _decoded(q)
    assert torch.isfinite(got).all()
    assert ((w - got) @ x.t()).norm() < 0.9 * ((w - _decoded(INT4.quantize(w))) @ x.t()).norm()


def test_a_singular_hessian_is_damped_into_shape():
    w = _weight(32, 64)
    x = _inputs(8, 64, seed=1)  # 8 rows: X^T X has rank 8 of 64
    got = _decoded(INT4.quantize(w, hessian=x.t() @ x))
    assert torch.isfinite(got).all()
    assert ((w - got) @ x.t()).norm() < ((w - _decoded(INT4.quantize(w))) @ x.t()).norm()


def test_a_hessian_of_the_wrong_size_names_both_shapes():
    with pytest.raises(ValueError, match=r"a Hessian of shape \(64, 64\) for a \(32, 128\) weight with 128 inputs; expected \(128, 128\)"):
        INT4.quantize(_weight(32, 128), hessian=torch.eye(64))


def test_a_bias_ignores_the_hessian():
    b = torch.randn(48)
    assert torch.equal(INT4.quantize(b, hessian=torch.eye(48)).data["data"], b.to(torch.bfloat16))
