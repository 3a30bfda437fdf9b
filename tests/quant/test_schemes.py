"""quant: the bf16 / int8 / bnb8 schemes, their field declarations, and sqnr_db."""
from __future__ import annotations

import math

import pytest
import torch

from tiers import quant
from tiers.quant import QuantizedTensor

LIGHT = ("bf16", "int8")  # schemes that need no bitsandbytes (slow import): tested on every device

# Measured on Gaussian [256, 512] bf16 weights, seeds 0..4: int8 per row gives 42.3-42.4 dB
# (absmax/127 step, then rounding into bf16); bnb8 blockwise gives 39.2-39.3 dB. The bounds
# sit about 4 dB and 3 dB below what is measured, so they catch a broken scale or rounding
# (which costs 6 dB per lost bit), not noise.
INT8_MIN_SQNR_DB = 38.0
BNB8_MIN_SQNR_DB = 36.0


def gaussian(shape=(256, 512), seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def roundtrip(name: str, w: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    s = quant.get_scheme(name)
    q = s.quantize(w)
    q = QuantizedTensor(q.scheme, q.shape, {k: v.to(device) for k, v in q.data.items()})
    out = torch.empty(w.shape, dtype=torch.bfloat16, device=device)
    s.dequantize(q, out=out)
    return out


# -- bf16 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(256, 512), (8, 96, 64), (7,)])
def test_bf16_roundtrip_is_exact(shape):
    w = gaussian(shape, seed=1)
    w.view(-1)[:4] = torch.tensor([0.0, -0.0, 1e-30, -3.0e38], dtype=torch.bfloat16)  # zeros, subnormal-ish, extreme
    out = roundtrip("bf16", w)
    assert torch.equal(out, w)
    assert torch.equal(out.view(torch.int16), w.view(torch.int16))  # bit for bit, -0.0 included
    assert quant.get_scheme("bf16").lossless
    assert quant.sqnr_db(w, out) == math.inf


# -- int8 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_int8_sqnr_on_gaussian(seed):
    w = gaussian((256, 512), seed=seed)
    out = roundtrip("int8", w)
    db = quant.sqnr_db(w, out)
    assert db >= INT8_MIN_SQNR_DB, f"int8 per-row SQNR {db:.2f} dB < {INT8_MIN_SQNR_DB} dB"
    assert db < 60.0  # sanity: int8 is lossy; 60+ dB would mean nothing was quantized
    assert not quant.get_scheme("int8").lossless


def test_int8_scale_is_per_row():
    """One row 1000x larger than the others must not crush the others' precision."""
    w = gaussian((64, 512), seed=4)
    w[0] *= 1000
    out = roundtrip("int8", w)
    q = quant.get_scheme("int8").quantize(w)
    assert q.data["scale"].shape == (64,)
    for r in (1, 17, 63):
        assert quant.sqnr_db(w[r], out[r]) >= INT8_MIN_SQNR_DB - 3, r  # per-row: a 512-sample row is noisier


def test_int8_extremes_hit_plus_minus_127():
    w = gaussian((16, 64), seed=5)
    q = quant.get_scheme("int8").quantize(w)
    assert q.data["qdata"].dtype == torch.int8
    assert torch.equal(q.data["qdata"].abs().amax(dim=-1), torch.full((16,), 127, dtype=torch.int8))


def test_int8_columns_scale_each_output_column():
    """A weight stored transposed, ``[in, out]`` (``columns=True``): one scale per column, so one
    output 1000x larger than the others does not crush the others' precision, and each column's
    largest code is +-127. A per-row scale here (the mutant) fails both."""
    s = quant.get_scheme("int8")
    w = gaussian((512, 64), seed=4)  # [in, out]
    w[:, 0] *= 1000
    q = s.quantize(w, columns=True)
    assert q.data["scale"].shape == (1, 64) and tuple(f.shape for f in s.fields((512, 64), columns=True)) == ((512, 64), (1, 64))
    assert torch.equal(q.data["qdata"].abs().amax(dim=0), torch.full((64,), 127, dtype=torch.int8))
    out = torch.empty_like(w)
    s.dequantize(s.prepare(q), out=out)
    for c in (1, 17, 63):
        assert quant.sqnr_db(w[:, c], out[:, c]) >= INT8_MIN_SQNR_DB - 3, c
    stacked = s.quantize(torch.stack([w, -w]), columns=True)  # [2, in, out]: scales [2, 1, out]
    back = torch.empty(2, 512, 64, dtype=torch.bfloat16)
    s.dequantize(stacked, out=back)
    assert stacked.data["scale"].shape == (2, 1, 64) and torch.equal(back[0], out) and torch.equal(back[1], -out)


@pytest.mark.parametrize("name", ["int8", "bnb8"])
def test_a_tensor_of_one_row_is_kept_exact(name):
    """Biases ``[n]`` stay bf16 under the lossy schemes: bit for bit, in one declared field."""
    if name == "bnb8":
        pytest.importorskip("bitsandbytes")
    s = quant.get_scheme(name)
    b = gaussian((96,), seed=3)
    assert [(f.name, f.dtype, f.shape) for f in s.fields((96,))] == [("data", torch.bfloat16, (96,))]
    out = torch.full((96,), float("nan"), dtype=torch.bfloat16)
    s.dequantize(s.prepare(s.quantize(b)), out=out)
    assert torch.equal(out.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("shape", [(6, 32), (3, 4, 32)])
def test_int8_zero_rows_give_zeros_not_nan(shape):
    w = gaussian(shape, seed=6)
    w[..., 1, :] = 0  # some all-zero rows
    out = roundtrip("int8", w)
    q = quant.get_scheme("int8").quantize(w)
    assert torch.isfinite(q.data["scale"]).all()
    # A zero scale would mean 0/0 (NaN) on the way in, cast to int8 by luck: zero rows get a positive scale.
    assert (q.data["scale"] > 0).all()
    assert torch.equal(q.data["qdata"][..., 1, :], torch.zeros_like(q.data["qdata"][..., 1, :]))
    assert torch.isfinite(out).all()
    assert torch.equal(out[..., 1, :], torch.zeros_like(out[..., 1, :]))
    assert quant.sqnr_db(w[..., 0, :], out[..., 0, :]) > 30


def test_int8_all_zero_tensor():
    w = torch.zeros(4, 8, dtype=torch.bfloat16)
    out = roundtrip("int8", w)
    assert not out.isnan().any()
    assert torch.equal(out, w)


# -- dequantize into out= ----------------------------------------------------------------------
@pytest.mark.parametrize("name", LIGHT)
def test_dequantize_writes_into_out(name, device):
    w = gaussian((32, 48), seed=7)
    s = quant.get_scheme(name)
    q = s.quantize(w)
    q = QuantizedTensor(q.scheme, q.shape, {k: v.to(device) for k, v in q.data.items()})
    slab = torch.full((3, 32, 48), float("nan"), dtype=torch.bfloat16, device=device)  # a slot in a slab
    out = slab[1]
    ptr = out.data_ptr()
    ret = s.dequantize(q, out=out)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    assert ret.data_ptr() == ptr and out.data_ptr() == ptr
    assert out.dtype == torch.bfloat16 and out.device.type == device.type
    assert torch.isnan(slab[0]).all() and torch.isnan(slab[2]).all()  # neighbours untouched
    assert torch.equal(out.cpu(), roundtrip(name, w))  # same result as on the CPU
    if name == "bf16":
        assert torch.equal(out.cpu(), w)
    else:
        assert quant.sqnr_db(w, out.cpu()) > 30


@pytest.mark.parametrize("name", LIGHT)
def test_prepared_and_stacked_dequantize_match_one_at_a_time(name, device):
    """``prepare`` gives views of the same memory that dequantize exactly as before; schemes that
    stack dequantize k experts stacked exactly as each alone."""
    s = quant.get_scheme(name)
    qs = [s.quantize(gaussian((32, 48), seed=20 + i)) for i in range(3)]
    alone = []
    for q in qs:
        q = QuantizedTensor(q.scheme, q.shape, {k: v.to(device) for k, v in q.data.items()})
        out = torch.empty((32, 48), dtype=torch.bfloat16, device=device)
        s.dequantize(q, out=out)
        p = s.prepare(q)
        assert {k: v.data_ptr() for k, v in p.data.items()} == {k: v.data_ptr() for k, v in q.data.items()}
        again = torch.empty_like(out)
        s.dequantize(p, out=again)
        assert torch.equal(again, out)
        alone.append(out)
    assert s.stacks
    stacked = QuantizedTensor(name, (3, 32, 48), {k: torch.stack([q.data[k] for q in qs]).to(device) for k in qs[0].data})
    for q in (stacked, s.prepare(stacked)):
        out = torch.empty((3, 32, 48), dtype=torch.bfloat16, device=device)
        s.dequantize(q, out=out)
        assert all(torch.equal(out[i], alone[i]) for i in range(3))


# -- fields(shape) -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", LIGHT)
@pytest.mark.parametrize("shape", [(96, 64), (64, 48), (2, 3, 5), (1, 1), (7,)])
def test_fields_match_the_quantized_tensors(name, shape):
    s = quant.get_scheme(name)
    w = gaussian(shape, seed=8)
    q = s.quantize(w)
    specs = s.fields(shape)
    assert q.scheme == name and q.shape == tuple(shape)
    assert {f.name for f in specs} == set(q.data)
    for f in specs:
        t = q.data[f.name]
        assert t.dtype == f.dtype, f.name
        assert tuple(t.shape) == f.shape, f.name
        assert t.numel() * t.element_size() == f.nbytes, f.name
        assert t.is_contiguous(), f.name
    assert q.nbytes == sum(f.nbytes for f in specs)


# -- bnb8 (bitsandbytes imports slowly: two tests) ---------------------------------------------
def test_bnb8_sqnr_and_fields():
    pytest.importorskip("bitsandbytes")
    s = quant.get_scheme("bnb8")
    assert not s.lossless
    w = gaussian((256, 512), seed=0)
    out = roundtrip("bnb8", w)
    db = quant.sqnr_db(w, out)
    assert db >= BNB8_MIN_SQNR_DB, f"bnb8 SQNR {db:.2f} dB < {BNB8_MIN_SQNR_DB} dB"
    assert db < 60.0
    # fields(shape) byte sizes equal the real tensors, also for numel not a multiple of the block.
    for shape in [(256, 512), (3, 100)]:
        q = s.quantize(gaussian(shape, seed=9))
        specs = s.fields(shape)
        assert {f.name for f in specs} == set(q.data)
        for f in specs:
            t = q.data[f.name]
            assert (t.dtype, tuple(t.shape)) == (f.dtype, f.shape), f.name
            assert t.numel() * t.element_size() == f.nbytes, f.name


def test_bnb8_dequantize_into_out_and_zero_blocks():
    pytest.importorskip("bitsandbytes")
    s = quant.get_scheme("bnb8")
    w = gaussian((4, 512), seed=10)
    w[1] = 0  # two whole 256-blocks of zeros
    q = s.quantize(w)
    out = torch.full((4, 512), float("nan"), dtype=torch.bfloat16)
    ptr = out.data_ptr()
    assert s.dequantize(q, out=out).data_ptr() == ptr
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros(512, dtype=torch.bfloat16))
    assert quant.sqnr_db(w, out) >= BNB8_MIN_SQNR_DB


# -- sqnr_db -----------------------------------------------------------------------------------
def test_sqnr_db_values():
    w = gaussian((64, 64), seed=11)
    assert quant.sqnr_db(w, w.clone()) == math.inf
    assert quant.sqnr_db(w.float(), w.float()) == math.inf
    ref = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert quant.sqnr_db(ref, ref * 1.1) == pytest.approx(20.0, abs=1e-9)  # noise = 1% of signal
    assert quant.sqnr_db(ref, ref * 1.01) == pytest.approx(40.0, abs=1e-9)
    assert quant.sqnr_db(torch.zeros(5), torch.ones(5)) == -math.inf


# -- registry ----------------------------------------------------------------------------------
def test_scheme_names():
    assert set(quant.scheme_names()) >= {"bf16", "int8", "bnb8"}
    for n in quant.scheme_names():
        assert quant.get_scheme(n).name == n


def test_unknown_precision_lists_known_ones():
    with pytest.raises(ValueError, match="fp4") as ei:
        quant.get_scheme("fp4")
    msg = str(ei.value)
    for n in ("bf16", "int8", "bnb8"):
        assert n in msg
