"""The untiered model the tiers are checked against, the comparisons made with it, and spies on the paths.

The reference is transformers' own model from the same ``save_pretrained`` checkpoint, with its
default experts implementation (grouped_mm). In generate's decode stage transformers switches
grouped_mm to batched_mm on a GPU but not on the CPU; Tiers follows the switch through
``Manager.batched_decode`` (True on a GPU). A test that forces Tiers' decode switch on the CPU
(to run the GPU's decode logic, direct decode included, through the CPU reference kernels)
builds the reference with ``batched_decode=True``, which switches it the same way on any device.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch
from transformers import AutoModelForCausalLM

from tiers.loader.layout import find_experts_modules

GEN = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
PATHS = ("resident", "direct", "whole", "held", "streamed")


def prompt(device, batch: int = 2, length: int = 10) -> torch.Tensor:
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(7)).to(device)


def reference(src, device, *, batched_decode: bool = False):
    """transformers' model of checkpoint ``src`` on ``device`` (bf16, default experts implementation);
    ``batched_decode``: generate's decode stage runs batched_mm on every device, as on a GPU."""
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).to(device).eval()
    own_storage(ref)
    if batched_decode:
        @contextlib.contextmanager
        def optimize_for_decode():
            impl = ref.get_experts_implementation()
            ref.set_experts_implementation({k: "batched_mm" if v == "grouped_mm" else v for k, v in impl.items()})
            try:
                yield
            finally:
                ref.set_experts_implementation(impl)

        ref._optimize_model_for_decode = optimize_for_decode
    return ref


def own_storage(model: torch.nn.Module) -> None:
    """Give every parameter and buffer of ``model`` a copy in storage of its own, allocated by torch.

    ``from_pretrained`` on the CPU leaves the weights mapped from the safetensors file, each at the
    address its byte offset in the file gives; the CPU's float32 matrix-vector kernels sum in an order
    that depends on the weight's alignment, so such a reference's decode logits depend on the file's
    header length (HY-V4's float32 lm_head: 2.4e-7). Moving to a GPU copies anyway; this copies on
    any device, as Tiers' load does, so both run their kernels on allocator-aligned weights.
    """
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.clone()


def assert_generate_equal(a, b) -> None:
    """Two ``generate`` results (``GEN``): the same tokens and every step's logits bit for bit."""
    assert torch.equal(a.sequences, b.sequences)
    assert len(a.logits) == len(b.logits) > 0
    for step, (la, lb) in enumerate(zip(a.logits, b.logits)):
        assert torch.equal(la, lb), f"decode step {step} differs"


def assert_bit_identical(ref, model, ids, gen: dict = GEN) -> None:
    """Prefill logits and greedy decode steps of ``model`` equal ``ref``'s exactly."""
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, model(ids).logits), "prefill logits differ"
    assert_generate_equal(ref.generate(ids, **gen), model.generate(ids, **gen))


def spy_paths(monkeypatch, mgr) -> Counter:
    """Count the calls each path object's ``run`` serves (wrapping the instances' methods)."""
    calls: Counter = Counter()
    for name in PATHS:
        path = getattr(mgr, name)
        run = path.run

        def spy(*args, _name=name, _run=run, **kwargs):
            calls[_name] += 1
            return _run(*args, **kwargs)

        monkeypatch.setattr(path, "run", spy)
    return calls


def spy_plans(monkeypatch, mgr) -> list:
    """Every streamed call's plan (``Stream``) from now on, in call order."""
    plans: list = []
    plan = mgr.streamed.plan
    monkeypatch.setattr(mgr.streamed, "plan", lambda *a, **kw: plans.append(plan(*a, **kw)) or plans[-1])
    return plans


def layer_calls(model, tokens: int, seed: int = 3):
    """Per experts module: random inputs of ``tokens`` tokens, each routed to k distinct experts:
    (layer, module name, module, hidden [T, H], top-k index [T, k], top-k weights [T, k])."""
    g = torch.Generator().manual_seed(seed)
    k = model.config.num_experts_per_tok
    dev = next(model.parameters()).device
    for layer, (name, mod) in find_experts_modules(model).items():
        hidden = mod.down_proj.shape[-1 if mod.is_transposed else -2]  # down_proj is [E, H, I], or [E, I, H] transposed
        x = torch.randn(tokens, hidden, generator=g).to(dev, torch.bfloat16)  # [T, H]
        idx = torch.stack([torch.randperm(mod.num_experts, generator=g)[:k] for _ in range(tokens)]).to(dev)  # [T, k]
        w = torch.softmax(torch.randn(tokens, k, generator=g), -1).to(dev, torch.bfloat16)  # [T, k]
        yield layer, name, mod, x, idx, w


def tiered_call(model, mgr, tokens: int = 64, seed: int = 3):
    """``layer_calls``' first call on a layer that is not all hot (so it runs through the tiers)."""
    return next(c for c in layer_calls(model, tokens, seed=seed) if not mgr.resident.qualifies(c[0]))


def spied_tiered_call(model, mgr, ref, monkeypatch, seed: int):
    """``tiered_call`` run once with its plans spied (``spy_plans``), its output checked bit for
    bit against ``ref``'s module: the call, the plans and that output."""
    call = tiered_call(model, mgr, seed=seed)
    _, name, mod, x, idx, w = call
    plans = spy_plans(monkeypatch, mgr)
    with torch.no_grad():
        want = ref.get_submodule(name)(x, idx, w)
        assert torch.equal(mod(x, idx, w), want)
    return call, plans, want


def assert_consistent(mgr) -> None:
    """Every invariant of the table holds, no slot is held, and no path kept a reservation."""
    mgr.table.check()
    for pool in mgr.pools:
        assert all(r == 0 for r in mgr.table.readers(pool.index)), f"pool {pool.index}: slots still held"
        assert not any(mgr.table.reserved(pool.index, s) for s in range(pool.n_slots)), f"pool {pool.index}: slots still reserved"
