"""quant.fused4: each pick's row times its expert's int4 weight, read in place from a blob pool.

Bound: the products of fp32 weights (``quant.int4``'s decoding before its rounding to bf16) in
fp32, rounded once to bf16. Against the weights as the blob dequantizes them (bf16: each within
2**-9 of the fp32 one) in float64, every output is within one bf16 rounding (2**-8 of its size)
plus 2**-9 + 1e-5 of the row's sum of absolute products. Shapes: partial steps of
``BK`` inputs and partial blocks of output rows; picks repeat an expert and map ``per`` picks to
one input row.
"""
from __future__ import annotations

import pytest
import torch

from tiers.loader.blob import blob_layout
from tiers.loader.layout import ExpertLayout, ExpertTensor
from tiers.quant import fused4
from tiers.quant.direct import expert_of

from conftest import devices

# (H, I): int4 groups of 32; 2080 inputs are two steps of BK and a part, 65 groups (an odd count), 136 rows a partial block
SIZES = [(320, 192), (2080, 68)]


def _pool(sizes, experts: int, device, precision: str = "int4", transposed: bool = False, group: int | None = None):
    """Blobs of ``experts`` random experts back to back in a byte pool on ``device`` (each start
    4 KiB aligned, as the blob pool places them), their tensors, weights and negative starts."""
    H, I = sizes
    if transposed:
        layout = ExpertLayout(experts, (ExpertTensor("gate_up_proj", (H, 2 * I)), ExpertTensor("down_proj", (I, H))),
                              is_transposed=True, is_concatenated=False)
    else:
        layout = ExpertLayout(experts, (ExpertTensor("gate_up_proj", (2 * I, H)), ExpertTensor("down_proj", (H, I))))
    blob = blob_layout(layout, precision, {"group": group} if group else None)
    stride = -(-blob.stride // 4096) * 4096
    g = torch.Generator().manual_seed(5)
    pool = torch.zeros(experts * stride, dtype=torch.uint8)
    for e in range(experts):
        enc = blob.encode({t.name: torch.randn(t.shape, generator=g).to(torch.bfloat16) for t in layout.tensors})[0]
        pool[e * stride : e * stride + enc.numel()] = enc
    slabs = {t.name: torch.empty((1, *t.shape), dtype=torch.bfloat16, device=device) for t in layout.tensors}
    tensors = expert_of(slabs, blob, precision)
    starts = torch.tensor([-1 - e * stride for e in range(experts)], device=device)
    weights = []
    for e in range(experts):
        want = {n: torch.empty(s, dtype=torch.bfloat16) for n, s in blob.shapes}
        blob.dequantize_into(pool[e * stride : e * stride + blob.stride], want)
        weights.append(want)
    return pool.to(device), tensors, starts, weights


def _within(y: torch.Tensor, x: torch.Tensor, ws: list[torch.Tensor]) -> None:
    """``y[j]`` against ``x[j] @ ws[j]^T`` in fp32 (the module docstring's bound)."""
    for j, w in enumerate(ws):
        exact = x[j].double() @ w.double().T
        size = x[j].double().abs() @ w.double().abs().T
        err = (y[j].cpu().double() - exact).abs()
        assert (err <= exact.abs() * 2**-8 + size * (2**-9 + 1e-5)).all(), f"pick {j}: worst {(err - exact.abs() * 2**-8).max():.3g}"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("sizes", SIZES)
def test_each_pick_times_its_experts_decoded_weight(sizes, device):
    device = torch.device(device)
    pool, tensors, starts, weights = _pool(sizes, 5, device)
    up, down = tensors
    assert fused4.qualifies(up) and up.group == 32
    g = torch.Generator().manual_seed(2)
    picks = torch.tensor([3, 0, 3, 4, 1, 2], device=device)  # 3 tokens x 2 picks, expert 3 twice
    x = torch.randn(3, sizes[0], generator=g).to(torch.bfloat16)
    y = fused4.linear(x.to(device), 2, picks, starts, pool, up)
    assert y.shape == (6, up.rows) and y.dtype == torch.bfloat16
    _within(y, x.repeat_interleave(2, dim=0), [weights[e]["gate_up_proj"] for e in picks.tolist()])
    if fused4.qualifies(down):
        h = torch.randn(6, sizes[1], generator=g).to(torch.bfloat16)
        _within(fused4.linear(h.to(device), 1, picks, starts, pool, down), h, [weights[e]["down_proj"] for e in picks.tolist()])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("sizes", SIZES)
def test_kernel_agrees_with_the_reference(sizes):
    """The Triton kernel against ``linear_reference`` on the CPU, over the same blobs: within two
    bf16 roundings of each other (each within one of the exact product)."""
    from tiers.quant.direct import kernel_available

    assert kernel_available()
    pool, tensors, starts, _ = _pool(sizes, 5, torch.device("cpu"))
    dev_pool, dev_tensors, dev_starts, _ = _pool(sizes, 5, torch.device("cuda"))
    picks = torch.tensor([4, 2, 2, 0, 1, 3, 0, 4])
    x = torch.randn(4, sizes[0], generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    ref = fused4.linear(x, 2, picks, starts, pool, tensors[0]).double()
    got = fused4.linear(x.cuda(), 2, picks.cuda(), dev_starts, dev_pool, dev_tensors[0]).cpu().double()
    assert ((got - ref).abs() <= ref.abs() * 2**-7 + 1e-3 * ref.abs().max()).all()
    assert (got == ref).float().mean() > 0.9, "most outputs round to the same bf16"


def test_it_takes_int4_stored_out_by_in_with_a_power_of_two_group():
    _, tensors, _, _ = _pool((320, 192), 1, torch.device("cpu"))
    assert [fused4.qualifies(t) for t in tensors] == [True, True]
    _, tensors, _, _ = _pool((160, 96), 1, torch.device("cpu"), group=64)  # groups of 40 and 48
    assert [fused4.qualifies(t) for t in tensors] == [False, False]
    _, tensors, _, _ = _pool((320, 192), 1, torch.device("cpu"), transposed=True)  # codes_t
    assert not any(fused4.qualifies(t) for t in tensors)
    pool, tensors, starts, _ = _pool((320, 192), 1, torch.device("cpu"), precision="nf4")
    assert not fused4.qualifies(tensors[0])
    with pytest.raises(ValueError, match="fused int4: a nf4 tensor of 384 x 320"):
        fused4.linear(torch.zeros(1, 320, dtype=torch.bfloat16), 1, torch.zeros(1, dtype=torch.int64), starts, pool, tensors[0])
