"""quant.direct with 4-bit experts (int4, nf4, mxfp4): each missed pick's slot holds exactly what
the blob's own dequantization gives, through ``fetch`` and ``fetch_cached``; on CUDA the Triton
kernel (``quant.direct4_kernel``) equals the torch reference bit for bit.

Layouts: Qwen3-like (``gate_up_proj`` [2I, H], ``down_proj`` [H, I], weights stored [out, in])
and GPT-OSS-like (transposed, with biases: int4 reads ``codes_t``, MXFP4 its blocks, both
written transposed into the slot). Shapes are chosen so that tiles cover partial rows and
columns (``quant.direct.TILE_R`` x ``TILE_C``) and int4's groups do not divide a tile; the
``GROUPED`` sizes give every tensor whole groups (int4's default 32, nf4's 64), so the kernel reads
each group's statistics once (``quant.direct4_kernel.spread_group``); the ``ODD`` sizes give int4
rows an odd number of groups (7 and 3 of 32), whose zero points' last byte is half used.
"""
from __future__ import annotations

import pytest
import torch

from tiers.loader.blob import blob_layout
from tiers.loader.layout import ExpertLayout, ExpertTensor
from tiers.quant import mxfp4
from tiers.quant.direct import SlotCache, expert_of, fetch, fetch_cached, fetch_reference

from conftest import devices

SENTINEL = 7.0
H, I = 160, 96  # int4 groups (64 asked, GROUP_ASKED): 40 along H, 48 along I; rows of H codes end in a partial tile
GROUPED = (320, 192)  # int4's default groups (32) and nf4's of 64 along every row, as at Qwen3's and Mixtral's shapes
ODD = (224, 96)
GROUP_ASKED = {"int4": {"group": 64}}  # (H, I) only: not int4's default (32), which divides its rows evenly


def _layout(experts: int, transposed: bool, sizes=(H, I)) -> ExpertLayout:
    H, I = sizes
    if transposed:
        return ExpertLayout(experts, (ExpertTensor("gate_up_proj", (H, 2 * I)), ExpertTensor("gate_up_proj_bias", (2 * I,)),
                                      ExpertTensor("down_proj", (I, H)), ExpertTensor("down_proj_bias", (H,))),
                            has_bias=True, is_transposed=True, is_concatenated=False)
    return ExpertLayout(experts, (ExpertTensor("gate_up_proj", (2 * I, H)), ExpertTensor("down_proj", (H, I))))


def _weight(shape, g: torch.Generator, precision: str) -> torch.Tensor:
    if precision == "mxfp4" and len(shape) == 2:  # exactly MXFP4 (the precision takes nothing else), blocks along dim -2
        k, n = shape
        blocks = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 126, (n, k // 32), dtype=torch.uint8, generator=g)
        return mxfp4.decode(blocks, scales)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def _experts(precision: str, transposed: bool, experts: int, device, sizes=(H, I)):
    layout = _layout(experts, transposed, sizes)
    blob = blob_layout(layout, precision, GROUP_ASKED.get(precision) if sizes == (H, I) else None)
    g = torch.Generator().manual_seed(3)
    blobs = [blob.encode({t.name: _weight(t.shape, g, precision) for t in layout.tensors})[0] for _ in range(experts)]
    slabs = {t.name: torch.full((12, *t.shape), SENTINEL, dtype=torch.bfloat16, device=device) for t in layout.tensors}
    tensors = expert_of(slabs, blob, precision)
    return blob, blobs, torch.cat(blobs), slabs, tensors


CASES = [("int4", False), ("int4", True), ("nf4", False), ("nf4", True), ("mxfp4", True)]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("sizes", [(H, I), GROUPED, ODD])
@pytest.mark.parametrize("precision,transposed", CASES)
def test_misses_decode_exactly_as_the_blob(precision, transposed, sizes, device):
    device = torch.device(device)
    blob, blobs, buf, slabs, tensors = _experts(precision, transposed, 6, device, sizes)
    weights = [t for t in tensors if t.kind]
    assert weights and all(t.kind == precision for t in weights)
    assert all(t.transposed == (transposed and precision != "nf4") for t in weights)
    src = buf.pin_memory() if device.type == "cuda" else buf
    starts = torch.tensor([e * blob.stride for e in range(6)], device=device)
    resident = torch.tensor([-1, 0, -1, -1, 1, -1], dtype=torch.int32, device=device)
    ids, counts = torch.empty(3, dtype=torch.int64, device=device), torch.zeros(2, dtype=torch.int64, device=device)
    fetch(src, starts, resident, torch.tensor([3, 1, 0], device=device), torch.tensor([6, 7, 8], dtype=torch.int32, device=device),
          ids, counts, tensors)
    assert ids.tolist() == [6, 0, 8] and counts.tolist() == [1, 2]
    cache = SlotCache.new([2, 3], rows=1, width=6, device=device)
    ids2 = torch.empty(2, dtype=torch.int64, device=device)
    fetch_cached(src, starts, resident, torch.tensor([5, 2], device=device), cache, 0, ids2, torch.zeros(3, dtype=torch.int64, device=device),
                 tensors)
    for e, slot in [(3, 6), (0, 8), *zip([5, 2], ids2.tolist())]:
        want = {name: torch.empty(shape, dtype=torch.bfloat16) for name, shape in blob.shapes}
        blob.dequantize_into(blobs[e], want)
        for name, slab in slabs.items():
            assert torch.equal(slab[slot].cpu(), want[name]), f"expert {e} {name}"
    for slab in slabs.values():
        assert torch.all(slab[[0, 1, 4, 5, 7, 9, 10, 11]] == SENTINEL), "a slot no miss was sent to was written"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("sizes", [(H, I), GROUPED, ODD])
@pytest.mark.parametrize("precision,transposed", CASES)
def test_kernel_matches_reference_bit_for_bit(precision, transposed, sizes):
    """Many picks, some resident, the kernel against the torch reference (which runs the schemes'
    own torch decoding on the CPU)."""
    from tiers.quant.direct import kernel_available

    assert kernel_available()
    outs = {}
    g = torch.Generator().manual_seed(1)
    resident = torch.where(torch.rand(10, generator=g) < 0.3, torch.arange(10) % 3, -1).to(torch.int32)
    picks = torch.randperm(10, generator=g)[:8]
    dst = torch.arange(3, 11, dtype=torch.int32)
    for where in ("cpu", "cuda"):
        blob, blobs, buf, slabs, tensors = _experts(precision, transposed, 10, torch.device(where), sizes)
        starts = torch.tensor([e * blob.stride for e in range(10)], device=where)
        ids = torch.empty(8, dtype=torch.int64, device=where)
        counts = torch.zeros(2, dtype=torch.int64, device=where)
        run = fetch if where == "cuda" else fetch_reference
        run(buf.pin_memory() if where == "cuda" else buf, starts, resident.to(where), picks.to(where), dst.to(where), ids, counts, tensors)
        outs[where] = ({n: s.cpu() for n, s in slabs.items()}, ids.cpu(), counts.cpu())
    for name in outs["cpu"][0]:
        assert torch.equal(outs["cpu"][0][name], outs["cuda"][0][name]), name
    assert torch.equal(outs["cpu"][1], outs["cuda"][1]) and torch.equal(outs["cpu"][2], outs["cuda"][2])


def test_four_bit_tensors_name_their_storage():
    """What the kernel is told about each tensor: storage rows and codes a row, group size, and
    whether the slot is the storage transposed."""
    _, _, _, _, tensors = _experts("int4", True, 2, torch.device("cpu"))
    gate_up, _, down, _ = tensors
    assert (gate_up.rows, gate_up.cols_n, gate_up.group, gate_up.transposed) == (2 * I, H, 40, True)
    assert (down.rows, down.cols_n, down.group, down.transposed) == (H, I, 48, True)
    _, _, _, _, tensors = _experts("nf4", False, 2, torch.device("cpu"))
    assert [(t.rows, t.cols_n, t.group, t.transposed) for t in tensors] == [(2 * I, H, 64, False), (H, I, 64, False)]
    _, _, _, _, tensors = _experts("mxfp4", True, 2, torch.device("cpu"))
    assert [(t.rows, t.cols_n, t.group, t.transposed) for t in tensors if t.kind] == [(2 * I, H, 32, True), (H, I, 32, True)]
    _, _, _, _, tensors = _experts("int4", False, 2, torch.device("cpu"), GROUPED)
    assert [t.group for t in tensors] == [32, 32]


def test_the_kernel_reads_a_group_once_where_tiles_hold_whole_groups():
    """Which shapes take the kernel's per-group statistics (``spread_group``): a power-of-two group
    shared by every tensor that divides every row; the test's odd sizes decode code by code."""
    pytest.importorskip("triton")
    from tiers.quant.direct4_kernel import spread_group

    def group(precision, transposed, sizes):
        return spread_group(_experts(precision, transposed, 1, torch.device("cpu"), sizes)[4].groups[0])

    assert [group("int4", False, GROUPED), group("nf4", False, GROUPED), group("int4", True, GROUPED)] == [32, 64, 32]
    assert [group("int4", False, (H, I)), group("nf4", False, (H, I))] == [0, 0]  # groups of 40 and 48; nf4 rows of 160
    assert group("mxfp4", True, (H, I)) == 32


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("precision,transposed", [("int4", True), ("nf4", False), ("int8", False)])
def test_two_sources_decode_each_expert_from_its_own(precision, transposed, device):
    """Experts 0-2 in a second buffer (the GPU's blob pool: negative starts, ``resident`` -2),
    3-5 in the first: each miss decodes from its own source, and ``plan`` counts the second
    source's decodes apart (``counts[3]``); on CUDA the kernels agree with the reference."""
    from tiers.quant.direct import QUANTIZED_HOT

    device = torch.device(device)
    blob, blobs, buf, slabs, tensors = _experts(precision, transposed, 6, device)
    half = 3 * blob.stride
    dev, src = buf[:half].clone(), torch.cat([torch.zeros(half, dtype=torch.uint8), buf[half:]])  # src holds nothing of 0-2
    if device.type == "cuda":
        dev, src = dev.to(device), src.pin_memory()
    starts = torch.tensor([-1 - e * blob.stride if e < 3 else e * blob.stride for e in range(6)], device=device)
    resident = torch.tensor([QUANTIZED_HOT, QUANTIZED_HOT, 0, -1, -1, -1], dtype=torch.int32, device=device)  # 2: a hot slot
    cache = SlotCache.new([6, 7, 8, 9], rows=1, width=6, device=device)
    ids, counts = torch.empty(4, dtype=torch.int64, device=device), torch.zeros(4, dtype=torch.int64, device=device)
    fetch_cached(src, starts, resident, torch.tensor([0, 4, 2, 1], device=device), cache, 0, ids, counts, tensors, dev=dev)
    assert counts.tolist() == [1, 3, 0, 2], "resident, decoded, cached, decoded from the second source"
    for e, slot in zip([0, 4, 1], [ids[0].item(), ids[1].item(), ids[3].item()]):
        want = {name: torch.empty(shape, dtype=torch.bfloat16) for name, shape in blob.shapes}
        blob.dequantize_into(blobs[e], want)
        for name, slab in slabs.items():
            assert torch.equal(slab[slot].cpu(), want[name]), f"expert {e} {name}"
