"""The experts' arithmetic over slots (tiers.paths.compute): the module seen through the slabs,
its window views, the grouped linear the windows run, and one token's picks read in place.

Every path's end-to-end exactness is in tests/tiers/test_api.py; windows' offsets in test_windows.py.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.moe import batched_mm_experts_forward

from conftest import tiny_config
from tiers.loader.layout import find_experts_modules
from tiers.paths import compute


@pytest.mark.parametrize("transposed", [False, True])
def test_window_views_are_the_slab_rows_grouped_mm_takes_made_once(transposed, monkeypatch):
    """``SlotExperts.window``: slots [lo, hi) of a slab as ``[n, in, out]`` (transposed unless
    the module stores it so), the same view object on every call, and a bounded cache."""
    module = type("Experts", (), {"has_gate": True, "has_bias": False, "is_transposed": transposed, "is_concatenated": True,
                                  "act_fn": torch.nn.functional.silu, "_apply_gate": None})()
    slab = torch.arange(6 * 4 * 3, dtype=torch.float32).view(6, 4, 3)
    px = compute.SlotExperts(module, {"down_proj": slab}, 6)
    assert px.num_experts == 6 and px.down_proj is slab and not px.has_post_expert_norm
    w = px.window("down_proj", 1, 4)
    want = slab[1:4] if transposed else slab[1:4].transpose(-2, -1)
    assert torch.equal(w, want) and w.data_ptr() == slab[1].data_ptr()
    assert px.window("down_proj", 1, 4) is w
    monkeypatch.setattr(compute.SlotExperts, "WINDOWS", 3)
    for lo in range(3):
        px.window("down_proj", lo, lo + 2)
    assert len(px._windows) <= 3 and px.window("down_proj", 1, 4) is not w  # cleared, made again
    assert torch.equal(px.window("down_proj", 1, 4), want)


@pytest.mark.parametrize("bias", [False, True])
def test_window_linear_is_transformers_grouped_linear(bias, device):
    """``_window_linear`` skips transformers' per-GEMM checks only where they would pick
    ``torch._grouped_mm`` anyway (CUDA, SM 80+): the same result bit for bit, with or without a
    bias; on the CPU it is transformers' own call."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 32, generator=g).bfloat16().to(device)
    w = torch.randn(5, 32, 48, generator=g).bfloat16().to(device)
    offs = torch.tensor([3, 3, 17, 30, 40], dtype=torch.int32, device=device)
    b = torch.randn(40, 48, generator=g).bfloat16().to(device) if bias else None
    assert compute._kernel_direct(torch.device("cpu")) is False
    if device.type == "cuda":
        assert compute._kernel_direct(x.device) == (hasattr(torch.nn.functional, "grouped_mm") and torch.cuda.get_device_capability() >= (8, 0))
    want = compute._grouped_linear(x, w, offs, bias=None if b is None else b.clone(), is_transposed=True)
    got = compute._window_linear(x, w, offs, None if b is None else b.clone())
    assert torch.equal(got, want)


def _slot_proxy(model_type: str, device, n_slots: int = 6, seed: int = 0):
    """An experts module of the tiny ``model_type`` seen through random bf16 slabs of ``n_slots``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.bfloat16)
    module = next(iter(find_experts_modules(model).values()))[1]
    g = torch.Generator().manual_seed(seed)
    names = ["gate_up_proj" if module.has_gate else "up_proj", "down_proj"]
    names += [n + "_bias" for n in names if module.has_bias]
    slabs = {n: torch.randn((n_slots, *getattr(module, n).shape[1:]), generator=g).to(torch.bfloat16).to(device) for n in names}
    return compute.proxy(module, slabs, n_slots), slabs, module


def test_a_modules_proxy_is_made_once_per_slabs(device):
    px, slabs, module = _slot_proxy("qwen3_moe", device)
    assert compute.proxy(module, slabs, 6) is px
    other = {n: t.clone() for n, t in slabs.items()}
    assert compute.proxy(module, other, 6) is not px and compute.proxy(module, other, 6).down_proj is other["down_proj"]


class _NoUploads:
    """What ``batched_picks`` asks of the uploads for one token's picks read in place: nothing."""

    def ints(self, values, dtype=torch.int32):
        raise AssertionError("one token's picks must not be uploaded")


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_picked_views_are_the_slots_in_place_and_compute_what_the_gather_does(model_type, device):
    """``picked``: one or two ascending slots become strided views of the slabs (the slots' own
    storage, equal to the gathered weights); anything else is refused. transformers' batched_mm
    forward on them (``batched_picks``) gives exactly what it gives gathering the slots, swapped
    picks included, uploading nothing."""
    px, slabs, _ = _slot_proxy(model_type, device)
    for slots in ([1, 4], [0, 5], [2, 3], [3]):
        view = compute.picked(px, slots)
        for name, slab in slabs.items():
            got = getattr(view, name)[torch.tensor(slots)]
            assert torch.equal(got, slab[slots]) and got.data_ptr() == slab[slots[0]].data_ptr(), (slots, name)
    assert all(compute.picked(px, s) is None for s in ([4, 1], [2, 2], [0, 1, 2], []))
    assert compute.picked(px, [1, 4]).down_proj.view.stride()[0] == 3 * slabs["down_proj"].stride(0)

    waited = []
    g = torch.Generator().manual_seed(1)
    hidden = slabs["down_proj"].shape[-1] if px.is_transposed else slabs["down_proj"].shape[1]
    h = torch.randn((1, hidden), generator=g).to(torch.bfloat16).to(device)
    for slots in ([1, 4], [4, 1], [5]):
        k = len(slots)
        w = torch.rand((1, k), generator=g).to(torch.bfloat16).to(device)
        want = batched_mm_experts_forward(px, h, torch.tensor([slots], device=device), w)
        got = compute.batched_picks(px, _NoUploads(), h, w, slots, k, lambda: waited.append(1))
        assert torch.equal(got, want), slots
    assert len(waited) == 3, "each call orders the compute stream after its slots' writes once"
