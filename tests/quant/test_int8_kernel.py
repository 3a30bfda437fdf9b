"""quant.int8 on CUDA: the Triton dequantization kernel, its layout rule, and its agreement with torch.mul.

The CPU tests check ``stack_layout``: for the views the engine dequantizes (stacks of experts
read out of transit rows, a blob per row, so codes and scales are strided across the stack),
reading memory the way the kernel addresses it gives what ``torch.mul`` gives, and layouts the
kernel cannot address are left to ``torch.mul``. The CUDA tests run the kernel itself and
compare it bit for bit with ``torch.mul`` on the same device.
"""
from __future__ import annotations

import pytest
import torch

from tiers import quant
from tiers.quant import QuantizedTensor
from tiers.quant import int8 as int8_mod

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def blob_stack(k: int, rows: int, cols: int, pad: int = 40, device: str = "cpu", seed: int = 0):
    """k experts' codes and scales in rows of one byte buffer, as transit rows hold blobs: codes,
    then ``pad`` bytes, then the fp32 scales (rows padded to 16 bytes). Returns the codes
    ``[k, rows, cols]`` and scales ``[k, rows, 1]`` views and their dense copies."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (k, rows, cols), generator=g, dtype=torch.int8)
    scales = torch.rand((k, rows), generator=g) * 0.05 + 1e-3
    at = (rows * cols + pad + 3) // 4 * 4  # the scales' byte offset
    width = (at + 4 * rows + 15) // 16 * 16
    buf = torch.zeros((k, width), dtype=torch.uint8)
    buf[:, : rows * cols] = codes.view(k, -1).view(torch.uint8)
    buf[:, at : at + 4 * rows] = scales.view(torch.uint8).view(k, -1)
    buf = buf.to(device)
    q = buf[:, : rows * cols].view(torch.int8).view(k, rows, cols)
    s = buf[:, at : at + 4 * rows].view(torch.float32).view(k, rows, 1)
    return q, s, codes, scales


def addressed(q: torch.Tensor, s: torch.Tensor, layout: tuple[int, ...]) -> torch.Tensor:
    """What the kernel computes, reading memory as the layout says: element j's code i at
    ``j * q_stride + i``, its scale at ``j * s_stride + i // cols`` (fp32 product, rounded once)."""
    qs, ss, _, stack, n, cols = layout
    codes = q.as_strided((stack, n), (qs, 1))
    scales = s.as_strided((stack, n // cols), (ss, 1)).repeat_interleave(cols, dim=1)
    return (codes.float() * scales).to(torch.bfloat16)


@pytest.mark.parametrize("k,rows,cols", [(1, 5, 7), (3, 17, 300), (2, 1, 5000), (4, 33, 129)])
def test_stack_layout_addresses_the_engine_views(k, rows, cols):
    q, s, codes, scales = blob_stack(k, rows, cols)
    assert k == 1 or not q.is_contiguous()  # strided across the stack, as transit rows are
    out = torch.empty((k, rows, cols), dtype=torch.bfloat16)
    layout = int8_mod.stack_layout(q, s, out)
    assert layout is not None and layout[3:] == (k, rows * cols, cols)
    expected = torch.mul(codes, scales.unsqueeze(-1), out=torch.empty_like(out))
    assert torch.equal(addressed(q, s, layout).view(k, rows, cols), expected)
    # an element alone (2-D) and a stack of one
    for j in (0, k - 1):
        one = int8_mod.stack_layout(q[j], s[j], out[j])
        assert one == (0, 0, 0, 1, rows * cols, cols)
        assert torch.equal(addressed(q[j], s[j], one).view(rows, cols), expected[j])


def test_stack_layout_leaves_other_layouts_to_torch(monkeypatch):
    q, s, _, _ = blob_stack(3, 8, 16)
    out = torch.empty((3, 8, 16), dtype=torch.bfloat16)
    assert int8_mod.stack_layout(q, s, out) is not None
    assert int8_mod.stack_layout(q.transpose(1, 2), s, out.transpose(1, 2)) is None  # rows not contiguous
    assert int8_mod.stack_layout(q, s, out.transpose(1, 2).contiguous().transpose(1, 2)) is None  # output rows strided
    assert int8_mod.stack_layout(q, s[:, :1].expand(3, 8, 1), out) is None  # one scale for every row
    assert int8_mod.stack_layout(q, s.view(3, 8), out) is None  # scales not [*rows, 1]
    assert int8_mod.stack_layout(q.unsqueeze(0), s.unsqueeze(0), out.unsqueeze(0)) is None  # two stack dimensions
    assert int8_mod.stack_layout(q[:, :1, ::2], s[:, :1], out[:, :1, ::2]) is None  # one row, strided codes
    assert int8_mod.stack_layout(q[:, :1, :8], s[:, :1], out[:, :1, :8]) is not None  # one row, contiguous
    assert int8_mod.stack_layout(q[:, :0], s[:, :0], out[:, :0]) is None  # nothing to decode
    assert int8_mod.stack_layout(q, s, out[:2]) is None
    monkeypatch.setattr(int8_mod, "MAX_STACK", 2)
    assert int8_mod.stack_layout(q, s, out) is None  # longer than the grid's stack axis
    assert int8_mod.stack_layout(q[:2], s[:2], out[:2]) is not None


def test_dequantize_off_cuda_is_torch_mul():
    q, s, codes, scales = blob_stack(2, 6, 10)
    out = torch.empty((2, 6, 10), dtype=torch.bfloat16)
    assert int8_mod._kernel_layout(q, s, out) is None
    quant.get_scheme("int8").dequantize(QuantizedTensor("int8", (2, 6, 10), {"qdata": q, "scale": s}), out=out)
    assert torch.equal(out, torch.mul(codes, scales.unsqueeze(-1), out=torch.empty_like(out)))


def counting_launches(monkeypatch) -> list:
    """Record every kernel launch ``quant.int8`` makes (CUDA with Triton)."""
    assert int8_mod.kernel_available()
    launches: list = []
    real = int8_mod._launch
    monkeypatch.setattr(int8_mod, "_launch", lambda *a: (launches.append(a), real(*a)))
    return launches


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,rows,cols", [(1, 5, 7), (3, 17, 300), (2, 1, 5000), (5, 96, 4097), (15, 64, 192)])
def test_kernel_matches_torch_mul_bit_for_bit(k, rows, cols, dtype, monkeypatch):
    """The engine's strided stacks, one element at a time and whole, relaunched past Triton's
    dispatch: every call goes through the kernel (no size floor here) and equals torch.mul on
    the same device."""
    from tiers.quant import int8_kernel

    monkeypatch.setattr(int8_mod, "KERNEL_MIN_CODES", 0)
    launches = counting_launches(monkeypatch)
    scheme = quant.get_scheme("int8")
    q, s, _, _ = blob_stack(k, rows, cols, device="cuda", seed=k + rows)
    expected = torch.mul(q, s, out=torch.empty((k, rows, cols), dtype=dtype, device="cuda"))
    fast_before = int8_kernel._RELAUNCH.fast_launches
    for _ in range(4):  # Triton compiles, learns, then the relaunches
        out = torch.full((k + 2, rows, cols), float("nan"), dtype=dtype, device="cuda")  # a slab with neighbours
        scheme.dequantize(QuantizedTensor("int8", (k, rows, cols), {"qdata": q, "scale": s}), out=out[1 : k + 1])
        for j in range(k):
            one = torch.empty((rows, cols), dtype=dtype, device="cuda")
            scheme.dequantize(QuantizedTensor("int8", (rows, cols), {"qdata": q[j], "scale": s[j]}), out=one)
            assert torch.equal(one, expected[j])
        torch.cuda.synchronize()
        assert torch.equal(out[1 : k + 1], expected)
        assert torch.isnan(out[0]).all() and torch.isnan(out[k + 1]).all()  # neighbours untouched
    assert len(launches) == 4 * (k + 1)
    assert int8_kernel._RELAUNCH.fast_launches > fast_before


@pytest.mark.cuda
@cuda
def test_small_dequantizations_stay_with_torch_mul(monkeypatch):
    """Below ``KERNEL_MIN_CODES`` codes torch.mul runs (cheaper to launch); at it, the kernel."""
    monkeypatch.setattr(int8_mod, "KERNEL_MIN_CODES", 3 * 64 * 192)
    launches = counting_launches(monkeypatch)
    scheme = quant.get_scheme("int8")
    q, s, _, _ = blob_stack(3, 64, 192, device="cuda")
    for k, launched in ((2, 0), (3, 1)):
        out = torch.empty((k, 64, 192), dtype=torch.bfloat16, device="cuda")
        scheme.dequantize(QuantizedTensor("int8", (k, 64, 192), {"qdata": q[:k], "scale": s[:k]}), out=out)
        assert len(launches) == launched
        assert torch.equal(out, torch.mul(q[:k], s[:k], out=torch.empty_like(out)))
