"""quant.direct: one gather-and-decode over a call's picks, resident picks only looked up.

The Triton kernel (CUDA) and the torch reference (every device) must both put exactly what the
scheme's own ``dequantize`` gives into each missed pick's slot, leave every other slot alone,
report each pick's slot, and count resident and decoded picks.
"""
from __future__ import annotations

import pytest
import torch

import quant
from quant import QuantizedTensor
from quant.direct import FIELDS, DirectTensor, fetch, fetch_reference

from conftest import devices

SENTINEL = 7.0


def _buffer(precision: str, shapes, experts: int, seed: int = 0):
    """``experts`` encodings laid out one after another (4 KiB apart, fields 256-aligned) in a
    uint8 buffer; returns the buffer, the starts, the field offsets per tensor and the originals."""
    scheme = quant.get_scheme(precision)
    offsets, at = [], 0
    for shape in shapes:
        fields = {}
        for spec in scheme.fields(shape):
            at = (at + 255) // 256 * 256
            fields[spec.name] = at
            at += spec.nbytes
        offsets.append(fields)
    stride = (at + 4095) // 4096 * 4096
    buf = torch.zeros(stride * experts, dtype=torch.uint8)
    g = torch.Generator().manual_seed(seed)
    encoded = []
    for e in range(experts):
        per = []
        for shape, fields in zip(shapes, offsets):
            q = scheme.quantize(torch.randn(shape, generator=g).to(torch.bfloat16))
            for name, off in fields.items():
                raw = q.data[name].contiguous().view(-1).view(torch.uint8)
                buf[e * stride + off : e * stride + off + raw.numel()] = raw
            per.append(q)
        encoded.append(per)
    return buf, [e * stride for e in range(experts)], offsets, encoded


@pytest.mark.parametrize("precision", ["int8", "bf16"])
@pytest.mark.parametrize("shapes", [[(96, 200), (200, 48)], [(16, 32), (16, 32), (32, 16)], [(40, 24)]])
def test_fetch_decodes_misses_exactly_into_their_slots(precision, shapes, device):
    experts, n_slots = 6, 12
    buf, starts, offsets, encoded = _buffer(precision, shapes, experts)
    if device.type == "cuda":
        buf = buf.pin_memory()  # the kernel reads page-locked host memory over PCIe
    scheme = quant.get_scheme(precision)
    slabs = [torch.full((n_slots, *s), SENTINEL, dtype=torch.bfloat16, device=device) for s in shapes]
    data, scale = FIELDS[precision]
    tensors = tuple(DirectTensor(slab, f[data], f.get(scale)) for slab, f in zip(slabs, offsets))
    resident = torch.tensor([-1, 0, -1, 1, -1, -1], dtype=torch.int32, device=device)  # experts 1, 3 are resident
    picks = torch.tensor([4, 1, 0, 3, 2], dtype=torch.int64, device=device)
    dst = torch.tensor([5, 6, 7, 8, 9], dtype=torch.int32, device=device)
    ids = torch.full((5,), -5, dtype=torch.int64, device=device)
    counts = torch.tensor([10, 20], dtype=torch.int64, device=device)
    fetch(buf, torch.tensor(starts, device=device), resident, picks, dst, ids, counts, tensors)
    assert ids.tolist() == [5, 0, 7, 1, 9]
    assert counts.tolist() == [12, 23]
    for slab, shape, i in zip(slabs, shapes, range(len(shapes))):
        for j, e in enumerate(picks.tolist()):
            if resident[e] >= 0:
                continue
            q = encoded[e][i]
            want = torch.empty(shape, dtype=torch.bfloat16, device=device)
            scheme.dequantize(QuantizedTensor(q.scheme, q.shape, {k: v.to(device) for k, v in q.data.items()}), out=want)
            assert torch.equal(slab[int(dst[j])], want), f"pick {j} (expert {e}) tensor {i}"
        untouched = [s for s in range(n_slots) if s not in (5, 7, 9)]
        assert torch.all(slab[untouched] == SENTINEL), "a slot no miss was sent to was written"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_kernel_matches_reference_bit_for_bit(precision):
    """The Triton kernel against the torch reference on the same inputs, many picks and experts."""
    from quant.direct import kernel_available

    assert kernel_available(), "Triton must be importable where CUDA is"
    shapes = [(256, 96), (96, 256)]
    buf, starts, offsets, _ = _buffer(precision, shapes, 40, seed=3)
    pinned = buf.pin_memory()
    g = torch.Generator().manual_seed(1)
    resident = torch.where(torch.rand(40, generator=g) < 0.3, torch.arange(40) % 8, -1).to(torch.int32)
    picks = torch.randperm(40, generator=g)[:24]
    dst = torch.arange(8, 32, dtype=torch.int32)
    outs = {}
    for where in ("cpu", "cuda"):
        slabs = [torch.full((32, *s), SENTINEL, dtype=torch.bfloat16, device=where) for s in shapes]
        data, scale = FIELDS[precision]
        tensors = tuple(DirectTensor(slab, f[data], f.get(scale)) for slab, f in zip(slabs, offsets))
        ids = torch.empty(24, dtype=torch.int64, device=where)
        counts = torch.zeros(2, dtype=torch.int64, device=where)
        run = fetch if where == "cuda" else fetch_reference
        run(pinned if where == "cuda" else buf, torch.tensor(starts, device=where), resident.to(where), picks.to(where), dst.to(where), ids, counts, tensors)
        outs[where] = ([s.cpu() for s in slabs], ids.cpu(), counts.cpu())
    for a, b in zip(outs["cpu"][0], outs["cuda"][0]):
        assert torch.equal(a, b)
    assert torch.equal(outs["cpu"][1], outs["cuda"][1]) and torch.equal(outs["cpu"][2], outs["cuda"][2])


def test_a_kept_expert_fetches_the_same_as_a_tuple_every_call(device):
    """A ``DirectExpert`` keeps its launch (on CUDA: the relaunched kernel after the first two
    launches); call after call, with other picks and counters, it writes what the reference does."""
    from quant.direct import DirectExpert

    precision, shapes = "int8", [(64, 96), (96, 64)]
    buf, starts, offsets, _ = _buffer(precision, shapes, 12, seed=5)
    src = buf.pin_memory() if device.type == "cuda" else buf
    data, scale = FIELDS[precision]
    g = torch.Generator().manual_seed(2)
    kept_slabs = [torch.full((16, *s), SENTINEL, dtype=torch.bfloat16, device=device) for s in shapes]
    kept = DirectExpert(DirectTensor(slab, f[data], f.get(scale)) for slab, f in zip(kept_slabs, offsets))
    ref_slabs = [torch.full((16, *s), SENTINEL, dtype=torch.bfloat16) for s in shapes]
    ref = tuple(DirectTensor(slab, f[data], f.get(scale)) for slab, f in zip(ref_slabs, offsets))
    usage = torch.zeros(12, dtype=torch.int64, device=device)
    ref_usage = torch.zeros(12, dtype=torch.int64)
    for call in range(6):
        m = 2 + call % 3
        resident = torch.where(torch.rand(12, generator=g) < 0.3, torch.arange(12) % 4, -1).to(torch.int32)
        picks = torch.randperm(12, generator=g)[:m]
        dst = torch.arange(4, 4 + m, dtype=torch.int32)
        got_ids, got_counts = torch.empty(m, dtype=torch.int64, device=device), torch.zeros(2, dtype=torch.int64, device=device)
        want_ids, want_counts = torch.empty(m, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
        fetch(src, torch.tensor(starts, device=device), resident.to(device), picks.to(device), dst.to(device), got_ids, got_counts,
              kept, usage)
        fetch_reference(buf, torch.tensor(starts), resident, picks, dst, want_ids, want_counts, ref, ref_usage)
        assert torch.equal(got_ids.cpu(), want_ids) and torch.equal(got_counts.cpu(), want_counts), f"call {call}"
        for a, b in zip(kept_slabs, ref_slabs):
            assert torch.equal(a.cpu(), b), f"call {call}"
    assert torch.equal(usage.cpu(), ref_usage)
    if device.type == "cuda":
        assert kept.launch_plan.relaunch[True].fast_launches == 4, "the kernel was not relaunched past Triton's dispatch"


def test_an_expert_fits_one_launch_up_to_its_grid():
    """The kernel's programs per pick are each tensor's elements in blocks, one tensor after
    another; an expert fits one launch up to ``MAX_BLOCKS`` of them (Mixtral-8x7B's 176 M
    elements: 21504), and one block more does not."""
    from quant.direct import BLOCK, MAX_BLOCKS, blocks, fits

    def expert(*shapes):
        return tuple(DirectTensor(torch.empty((2, *s), dtype=torch.bfloat16, device="meta"), 0, None) for s in shapes)

    mixtral = expert((28672, 4096), (4096, 14336))
    assert blocks(mixtral) == 21504 and fits(mixtral)
    assert blocks(expert((3, BLOCK + 1), (1, 5))) == 4 + 1  # 3 * BLOCK + 3 elements, then 5
    edge = expert((MAX_BLOCKS - 1, BLOCK), (1, 1))
    assert blocks(edge) == MAX_BLOCKS and fits(edge)
    assert not fits(expert((MAX_BLOCKS, BLOCK), (1, 1)))
