"""quant.direct: one gather-and-decode over a call's picks, resident picks only looked up.

The Triton kernel (CUDA) and the torch reference (every device) must both put exactly what the
scheme's own ``dequantize`` gives into each missed pick's slot, leave every other slot alone,
report each pick's slot, and count resident and decoded picks.
"""
from __future__ import annotations

import pytest
import torch

from tiers import quant
from tiers.quant import QuantizedTensor
from tiers.quant.direct import FIELDS, DirectTensor, fetch, fetch_reference


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
    from tiers.quant.direct import kernel_available

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
    from tiers.quant.direct import DirectExpert

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
    from tiers.quant.direct import BLOCK, MAX_BLOCKS, blocks, fits

    def expert(*shapes):
        return tuple(DirectTensor(torch.empty((2, *s), dtype=torch.bfloat16, device="meta"), 0, None) for s in shapes)

    mixtral = expert((28672, 4096), (4096, 14336))
    assert blocks(mixtral) == 21504 and fits(mixtral)
    assert blocks(expert((3, BLOCK + 1), (1, 5))) == 4 + 1  # 3 * BLOCK + 3 elements, then 5
    edge = expert((MAX_BLOCKS - 1, BLOCK), (1, 1))
    assert blocks(edge) == MAX_BLOCKS and fits(edge)
    assert not fits(expert((MAX_BLOCKS, BLOCK), (1, 1)))


# -- the slot cache: plan decides each pick's slot on the device, fetch_planned decodes the misses --
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tiers.quant.direct import SlotCache, fetch_cached, plan, plan_reference  # noqa: E402


def _plan_call(cache, row, resident, picks, device, usage=None, run=plan):
    ids = torch.full((len(picks),), -5, dtype=torch.int64, device=device)
    counts = torch.zeros(3, dtype=torch.int64, device=device)
    run(cache, row, torch.tensor(resident, dtype=torch.int32, device=device), torch.tensor(picks, dtype=torch.int64, device=device),
        ids, counts, usage)
    return ids.tolist(), cache.dst[: len(picks)].tolist(), counts.tolist()


def test_plan_keeps_experts_and_evicts_the_row_that_comes_back_last(device):
    """Worked by hand: 4 rows of 8 experts, a cache of 3 slots (10, 11, 12)."""
    cache = SlotCache.new([10, 11, 12], rows=4, width=8, device=device)
    none = [-1] * 8
    # row 0: two misses take the empty lanes in order
    assert _plan_call(cache, 0, none, [1, 2], device) == ([10, 11], [10, 11], [0, 2, 0])
    # row 1: expert 3 takes the last empty lane; expert 1 of row 1 is not row 0's expert 1, so it
    # evicts a row-0 lane (both come back after 3 rows), the least recently used: lane 0
    assert _plan_call(cache, 1, none, [3, 1], device) == ([12, 10], [12, 10], [0, 2, 0])
    assert cache.owner.tolist() == [9, 2, 11] and cache.stamp.tolist() == [3, 1, 2] and cache.clock.tolist() == [4]
    # row 2: expert 5 is resident in slot 3; expert 2 evicts a row-1 lane (back after 4 rows, row 0's
    # after 2), the older of the two: lane 2
    assert _plan_call(cache, 2, none[:5] + [3] + none[6:], [2, 5], device) == ([12, 3], [12, -1], [1, 1, 0])
    assert cache.owner.tolist() == [9, 2, 18]
    # row 1 again: its expert 1 is still held
    assert _plan_call(cache, 1, none, [1], device) == ([10], [-1], [0, 0, 1])
    # row 2: expert 2 is held in lane 2, which the miss after it may not take though its row comes
    # back last: the miss takes lane 0 (row 1, back after 3), not lane 1 (row 0, back after 2)
    assert _plan_call(cache, 2, none, [2, 7], device) == ([12, 10], [-1, 10], [0, 1, 1])
    assert cache.owner.tolist() == [23, 2, 18]
    cache.clear()
    assert cache.owner.tolist() == [-1, -1, -1] and cache.clock.tolist() == [0]
    with pytest.raises(ValueError, match="3 picks, more than the cache's 2 slots"):
        _plan_call(SlotCache.new([0, 1], 2, 8, device), 0, none, [1, 2, 3], device)
    with pytest.raises(ValueError, match="row 2 outside the cache's 2 rows"):
        _plan_call(SlotCache.new([0, 1], 2, 8, device), 2, none, [1], device)


_CALLS = st.lists(st.tuples(st.lists(st.integers(-1, 3), min_size=6, max_size=6),  # resident slot per expert, -1: none
                            st.lists(st.integers(0, 5), min_size=1, max_size=4)),  # picks, repeats allowed
                  min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(calls=_CALLS, lanes=st.integers(4, 6), rows=st.integers(1, 4))
def test_plan_reference_invariants(calls, lanes, rows):
    """Random calls visiting the rows in order: each pick gets its resident slot, or the slot that
    held its expert before the call (no decode), or one it decodes into, which then holds it; one
    expert per slot, distinct experts of a call in distinct slots; a miss evicts an empty lane,
    else one whose row comes back last, the least recently used among those, never a lane an
    earlier pick of the call used; counts and usage add up."""
    width = 6
    slots = [20 + 2 * i for i in range(lanes)]
    cache = SlotCache.new(slots, rows, width, "cpu")
    usage = torch.zeros(width, dtype=torch.int64)
    seen = 0
    for n, (resident, picks) in enumerate(calls):
        row = n % rows
        before, stamps = cache.owner.tolist(), cache.stamp.tolist()
        ids, dst, counts = _plan_call(cache, row, [20 + s if s >= 0 else -1 for s in resident], picks, "cpu", usage, plan_reference)
        after = cache.owner.tolist()
        assert len({c for c in after if c >= 0}) == len([c for c in after if c >= 0]), "a cell in two slots"
        used: set[int] = set()
        want = [0, 0, 0]
        for j, e in enumerate(picks):
            cell = row * width + e
            if resident[e] >= 0:
                assert ids[j] == 20 + resident[e] and dst[j] == -1
                want[0] += 1
                continue
            lane = slots.index(ids[j])
            assert after[lane] == cell
            if cell in before or cell in [after[i] for i in used]:
                assert dst[j] == -1
                want[2] += 1
            else:
                assert dst[j] == ids[j] and lane not in used
                free = [i for i in range(lanes) if i not in used]
                empty = [i for i in free if before[i] < 0]
                if empty:
                    assert lane == empty[0]
                else:
                    back = {i: (before[i] // width - row - 1) % rows for i in free}
                    best = min((-back[i], stamps[i]) for i in free)
                    assert (-back[lane], stamps[lane]) == best
                want[1] += 1
                before[lane] = cell  # the later picks of this call see it held
            used.add(lane)
        assert counts == want
        seen += len(picks)
        assert cache.clock.tolist() == [seen]
    assert usage.sum().item() == seen


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_fetch_cached_decodes_each_miss_once_into_the_slot_that_keeps_it(precision, device):
    """Calls over one row: each miss's slot holds exactly the scheme's decode of its expert, a
    pick held since an earlier call is not decoded again (its slot is left as it was), and slots
    outside the cache are never written."""
    shapes = [(96, 200), (200, 48)]
    buf, starts, offsets, encoded = _buffer(precision, shapes, 6)
    src = buf.pin_memory() if device.type == "cuda" else buf
    scheme = quant.get_scheme(precision)
    slabs = [torch.full((8, *s), SENTINEL, dtype=torch.bfloat16, device=device) for s in shapes]
    data, scale = FIELDS[precision]
    tensors = tuple(DirectTensor(slab, f[data], f.get(scale)) for slab, f in zip(slabs, offsets))
    cache = SlotCache.new([4, 5, 6], rows=1, width=6, device=device)
    resident = torch.tensor([-1, 0, -1, -1, -1, -1], dtype=torch.int32, device=device)
    counts = torch.zeros(3, dtype=torch.int64, device=device)
    starts_t = torch.tensor(starts, device=device)
    for picks, want_ids in [([2, 1], [4, 0]), ([3, 2], [5, 4]), ([4, 5, 2], [6, 5, 4])]:
        before = [s.clone() for s in slabs]
        ids = torch.empty(len(picks), dtype=torch.int64, device=device)
        fetch_cached(src, starts_t, resident, torch.tensor(picks, device=device), cache, 0, ids, counts, tensors)
        assert ids.tolist() == want_ids
        for j, (e, slot) in enumerate(zip(picks, ids.tolist())):
            if e == 1:
                continue
            decoded_now = int(cache.dst[j]) >= 0
            for i, (slab, shape) in enumerate(zip(slabs, shapes)):
                q = encoded[e][i]
                want = torch.empty(shape, dtype=torch.bfloat16, device=device)
                scheme.dequantize(QuantizedTensor(q.scheme, q.shape, {k: v.to(device) for k, v in q.data.items()}), out=want)
                assert torch.equal(slab[slot], want), f"expert {e} tensor {i}"
                if not decoded_now:
                    assert torch.equal(slab[slot], before[i][slot])
        for slab in slabs:
            assert torch.all(slab[[0, 1, 2, 3, 7]] == SENTINEL)
    # expert 2: a miss, then held twice; 3, 4 and 5 misses (5 evicts 3, the least recently used lane this call left free)
    assert counts.tolist() == [1, 4, 2]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_plan_kernel_matches_reference_call_after_call():
    """The Triton planner against the host reference: the same slots, destinations, cache state,
    counts and usage after every call of a long random sequence (repeats, resident picks, rows in
    order), through the relaunched kernel after its first launches."""
    import random

    rng = random.Random(0)
    for lanes, rows in [(4, 8), (32, 12), (3, 1)]:
        width = 16
        caches = {d: SlotCache.new(list(range(40, 40 + lanes)), rows, width, d) for d in ("cpu", "cuda")}
        usage = {d: torch.zeros(width, dtype=torch.int64, device=d) for d in ("cpu", "cuda")}
        for call in range(200):
            row = call % rows
            resident = [rng.choice([-1, -1, -1, rng.randrange(40)]) for _ in range(width)]
            picks = [rng.randrange(width) for _ in range(rng.randint(1, min(lanes, 8)))]
            got = {d: _plan_call(caches[d], row, resident, picks, d, usage[d], plan if d == "cuda" else plan_reference) for d in caches}
            assert got["cpu"] == got["cuda"], f"lanes {lanes} call {call}"
            for name in ("owner", "stamp", "clock"):
                assert torch.equal(getattr(caches["cpu"], name), getattr(caches["cuda"], name).cpu()), f"{name} call {call}"
        assert torch.equal(usage["cpu"], usage["cuda"].cpu())


# -- a transposed layout with biases (GPT-OSS): four tensors, two encodings, per-column scales -----
def _transposed_biased(precision: str, experts: int, device):
    """``experts`` blobs of a GPT-OSS-shaped layout (``gate_up_proj`` [H, 2I], its bias, ``down_proj``
    [I, H], its bias) back to back in a buffer, the slabs they decode into, and their ``DirectExpert``
    as the staging builds it (``blob.fields``)."""
    from tiers.loader.blob import blob_layout
    from tiers.loader.layout import ExpertLayout, ExpertTensor
    from tiers.quant.direct import expert_of

    H, I = 64, 40
    layout = ExpertLayout(experts, (ExpertTensor("gate_up_proj", (H, 2 * I)), ExpertTensor("gate_up_proj_bias", (2 * I,)),
                                    ExpertTensor("down_proj", (I, H)), ExpertTensor("down_proj_bias", (H,))),
                          has_bias=True, is_transposed=True, is_concatenated=False)
    blob = blob_layout(layout, precision)
    g = torch.Generator().manual_seed(11)
    blobs = [blob.encode({t.name: torch.randn(t.shape, generator=g).to(torch.bfloat16) for t in layout.tensors})[0] for _ in range(experts)]
    buf = torch.cat(blobs)
    slabs = {t.name: torch.full((10, *t.shape), SENTINEL, dtype=torch.bfloat16, device=device) for t in layout.tensors}
    tensors = expert_of(slabs, blob, precision)
    return blob, blobs, buf, slabs, tensors


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_transposed_biased_experts_decode_exactly(precision, device):
    """Each miss's slot holds exactly what the blob's own dequantization gives (INT8 per-column
    scales on the weights, the biases exact), through ``fetch`` and ``fetch_cached``; on CUDA the
    kernel decodes the expert in one launch per run of one encoding."""
    blob, blobs, buf, slabs, tensors = _transposed_biased(precision, 5, device)
    if precision == "int8":
        assert [(t.scale is not None, t.cols) for t in tensors] == [(True, True), (False, False), (True, True), (False, False)]
    groups = [[next(i for i, u in enumerate(tensors) if u is t) for t in g] for g in tensors.groups]
    assert groups == ([[0, 2], [1, 3]] if precision == "int8" else [[0, 1, 2], [3]])  # weights, biases; three a launch
    src = buf.pin_memory() if device.type == "cuda" else buf
    starts = torch.tensor([e * blob.stride for e in range(5)], device=device)
    resident = torch.tensor([-1, 0, -1, -1, -1], dtype=torch.int32, device=device)
    picks = torch.tensor([3, 1, 0], device=device)
    ids, counts = torch.empty(3, dtype=torch.int64, device=device), torch.zeros(2, dtype=torch.int64, device=device)
    fetch(src, starts, resident, picks, torch.tensor([6, 7, 8], dtype=torch.int32, device=device), ids, counts, tensors)
    assert ids.tolist() == [6, 0, 8] and counts.tolist() == [1, 2]
    cache = SlotCache.new([2, 3], rows=1, width=5, device=device)
    ids2 = torch.empty(2, dtype=torch.int64, device=device)
    fetch_cached(src, starts, resident, torch.tensor([4, 2], device=device), cache, 0, ids2, torch.zeros(3, dtype=torch.int64, device=device),
                 tensors)
    for e, slot in [(3, 6), (0, 8), *zip([4, 2], ids2.tolist())]:
        want = {name: torch.empty(shape, dtype=torch.bfloat16) for name, shape in blob.shapes}
        blob.dequantize_into(blobs[e], want)
        for name, slab in slabs.items():
            assert torch.equal(slab[slot].cpu(), want[name]), f"expert {e} {name}"
    for slab in slabs.values():
        assert torch.all(slab[[0, 1, 4, 5, 7, 9]] == SENTINEL)
