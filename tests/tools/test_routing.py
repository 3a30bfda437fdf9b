"""TraceRouting: experts modules route by a pre-sampled skewed, sticky trace, and removal restores the model.

What each experts implementation receives is captured by a spy registered in transformers'
experts registry (it records its arguments, then runs ``grouped_mm``), so the checks are on what
the kernels saw, not on what the hook returned.
"""
from __future__ import annotations

import pytest
import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from tiers.loader.layout import find_experts_modules
from tiers.tools import measure
from tiers.tools.routing import TraceRouting

from conftest import HAS_CUDA

SEEN: list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor]] = []  # (experts module, top_k_index, top_k_weights)


def spy_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    SEEN.append((self, top_k_index.clone(), top_k_weights.clone()))
    return ALL_EXPERTS_FUNCTIONS["grouped_mm"](self, hidden_states, top_k_index, top_k_weights)


if "routing_spy" not in ALL_EXPERTS_FUNCTIONS:
    ALL_EXPERTS_FUNCTIONS.register("routing_spy", spy_experts_forward)


def build(model_type: str, device="cpu"):
    model = measure.build(model_type, dict(measure.TINY[model_type]), torch.device(device))
    model.set_experts_implementation("routing_spy")
    return model


def seen(model, part: int = 1) -> dict[int, list[torch.Tensor]]:
    """layer -> the top_k_index (part=1) or top_k_weights (part=2) of each call, in call order."""
    layer_of = {id(m): layer for layer, (_, m) in find_experts_modules(model).items()}
    out: dict[int, list[torch.Tensor]] = {layer: [] for layer in layer_of.values()}
    for entry in SEEN:
        out[layer_of[id(entry[0])]].append(entry[part].cpu())
    return out


def ids(batch: int, length: int, seed: int = 0, device="cpu") -> torch.Tensor:
    return torch.randint(3, 512, (batch, length), generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def model(request):
    return build(request.param)


@pytest.fixture(autouse=True)
def clear_seen():
    SEEN.clear()
    yield
    SEEN.clear()


def test_experts_receive_consecutive_trace_rows_and_router_weights(model):
    with torch.no_grad():
        model(ids(2, 5))  # unhooked: the router's own picks and weights
    own_idx, own_w = seen(model), seen(model, part=2)
    SEEN.clear()
    with TraceRouting(model, seed=3, tokens=64) as r, torch.no_grad():
        model(ids(2, 5))  # 10 tokens, flattened batch-major
        model(ids(1, 3, seed=1))  # the next 3 rows
        idx, w = seen(model), seen(model, part=2)
        assert r.positions == {layer: 13 for layer in r.layers}
    first = r.layers[0]
    for col, layer in enumerate(r.layers):
        assert [t.tolist() for t in idx[layer]] == [r.trace[0:10, col].tolist(), r.trace[10:13, col].tolist()]
        assert idx[layer][0].dtype == torch.long
        assert w[layer][0].shape == own_w[layer][0].shape and w[layer][0].dtype == own_w[layer][0].dtype
    # the first MoE layer sees the same hidden states either way: the router's weights are passed on untouched
    assert torch.equal(w[first][0], own_w[first][0])
    assert not torch.equal(idx[first][0], own_idx[first][0])


def test_rows_wrap_around_past_the_end_of_the_trace(model):
    with TraceRouting(model, seed=0, tokens=16) as r, torch.no_grad():
        model(ids(1, 10))
        model(ids(1, 25))  # rows 10..15, then all 16, then 0..2
        assert r.positions == {layer: (10 + 25) % 16 for layer in r.layers}
    got = seen(model)
    for col, layer in enumerate(r.layers):
        rows = r.trace[:, col]
        assert torch.equal(got[layer][1], torch.cat([rows[10:], rows, rows[:3]]))


def test_routing_follows_the_zipf_popularity_sticks_and_picks_are_distinct(model):
    with TraceRouting(model, zipf_s=1.2, reuse_p=0.5, seed=5, tokens=1024) as r, torch.no_grad():
        model(ids(1, 512))
    got = seen(model)
    pop = r.popularity()  # [L, E]
    n_exp = pop.shape[1]
    for col, layer in enumerate(r.layers):
        picks = got[layer][0]  # [512, k]
        assert ((picks >= 0) & (picks < n_exp)).all()
        s, _ = picks.sort(-1)
        assert (s[:, 1:] != s[:, :-1]).all()  # a token's picks are distinct
        share = torch.bincount(picks.flatten(), minlength=n_exp).double() / picks.numel()
        assert share.argmax() == pop[col].argmax()
        assert share[pop[col].argmax()] > 2.0 / n_exp  # the head expert takes well over a uniform share
        assert share[pop[col].argmin()] < 1.0 / n_exp
        kept = (picks[1:, :, None] == picks[:-1, None, :]).any(-1).double().mean()  # picks reused from the previous token
        assert kept > 0.5


def test_generate_routes_prefill_then_each_decode_step_by_the_trace(model):
    with TraceRouting(model, seed=4, tokens=64) as r:
        out = model.generate(ids(1, 4), max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
        assert r.positions == {layer: 4 + 4 for layer in r.layers}  # a 4-token prefill, then 4 single-token steps
    assert out.shape == (1, 9)
    for col, layer in enumerate(r.layers):
        calls = seen(model)[layer]
        assert [len(c) for c in calls] == [4, 1, 1, 1, 1]
        assert torch.equal(torch.cat(calls), r.trace[:8, col])


def test_reset_replays_the_same_picks(model):
    r = TraceRouting(model, seed=6, tokens=64)
    try:
        with torch.no_grad():
            model(ids(1, 7))
            model(ids(1, 7))
            first = seen(model)
            SEEN.clear()
            r.reset()
            assert set(r.positions.values()) == {0}
            model(ids(1, 7))
            model(ids(1, 7))
    finally:
        r.remove()
    again = seen(model)
    for layer, calls in first.items():
        assert not torch.equal(calls[0], calls[1])  # the counter moves on between calls
        assert all(torch.equal(a, b) for a, b in zip(calls, again[layer], strict=True))


def test_remove_gives_back_bit_identical_logits(model):
    x = ids(2, 6)
    mods = [m for _, m in find_experts_modules(model).values()]
    hooks_before = [(dict(m._forward_pre_hooks), dict(m._forward_pre_hooks_with_kwargs)) for m in mods]
    with torch.no_grad():
        ref = model(x).logits
        with TraceRouting(model, seed=1) as r:
            routed = model(x).logits
        after = model(x).logits
    assert not torch.equal(routed, ref)  # the trace did change the routing
    assert torch.equal(after, ref)
    assert [(dict(m._forward_pre_hooks), dict(m._forward_pre_hooks_with_kwargs)) for m in mods] == hooks_before
    r.remove()  # a second remove is a no-op
    TraceRouting(model).remove()  # and the modules can be routed again


def test_one_module_takes_one_routing(model):
    with TraceRouting(model):
        with pytest.raises(ValueError, match="already routed by a TraceRouting: remove\\(\\) that one first"):
            TraceRouting(model)


def test_top_k_mismatch_names_the_layer(model):
    k = model.config.num_experts_per_tok
    with TraceRouting(model, top_k=k + 1), torch.no_grad():
        with pytest.raises(ValueError, match=rf"has shape \(3, {k}\); this TraceRouting hands out \[tokens, {k + 1}\]"):
            model(ids(1, 3))


def test_keyword_call_is_routed_too(model):
    _, m = next(iter(find_experts_modules(model).values()))
    k = model.config.num_experts_per_tok
    hidden = torch.randn(3, model.config.hidden_size).bfloat16()
    own = torch.zeros(3, k, dtype=torch.long) + torch.arange(k)
    weights = torch.full((3, k), 1.0 / k).bfloat16()
    with TraceRouting(model, seed=8, tokens=32) as r, torch.no_grad():
        m(hidden, top_k_index=own, top_k_weights=weights)
    assert torch.equal(SEEN[0][1], r.trace[:3, 0]) and torch.equal(SEEN[0][2], weights)


def test_pre_hooks_registered_earlier_see_the_trace_too(model):
    _, m = next(iter(find_experts_modules(model).values()))
    got = []
    earlier = m.register_forward_pre_hook(lambda mod, args: got.append(args[1].clone()))
    try:
        with TraceRouting(model, seed=11, tokens=32) as r, torch.no_grad():
            model(ids(1, 4))
    finally:
        earlier.remove()
    assert torch.equal(got[0], r.trace[:4, 0])


def _first_layer_call(model, device="cpu"):
    """The first experts module and a 5-token call's (hidden, top_k_index, top_k_weights)."""
    _, m = next(iter(find_experts_modules(model).values()))
    k = model.config.num_experts_per_tok
    hidden = torch.randn(5, model.config.hidden_size, device=device).bfloat16()
    return m, (hidden, torch.zeros(5, k, dtype=torch.long, device=device), torch.ones(5, k, device=device))


def _assert_three_calls_of_five(r, rows_got: list[torch.Tensor]) -> None:
    """Three 5-token calls on an 8-row trace: rows 0-4, then 5-7 and 0-1 (wrapped), then 2-6."""
    rows = r.trace[:, 0]
    for got, want in zip(rows_got, [rows[0:5], torch.cat([rows[5:], rows[:2]]), rows[2:7]], strict=True):
        assert torch.equal(got.cpu(), want)


def _three_calls_under_a_graph(r, m, call, graph) -> list[torch.Tensor]:
    """The hook's rows for three calls: the first captured into ``graph``, the others replays."""
    graph.capture(lambda h, i, w: r._pre_hook(0, m, (h, i, w), {})[0][1], call)
    return [graph.replay().clone() for _ in range(3)]


def test_a_captured_hook_routes_each_replay_by_the_next_rows(model):
    """What a CUDA graph keeps of a hook is its kernels: the counter must be device state that
    those kernels move on, or every replayed step routes as the captured one. Checked on the CPU
    with a graph that replays only the recorded tensor ops (tests/replay_graph.py)."""
    from replay_graph import ReplayGraph
    from tiers.graphs.step_graphs import GRAPH_SAFE

    m, call = _first_layer_call(model)
    with TraceRouting(model, seed=12, tokens=8) as r:
        assert all(getattr(h, GRAPH_SAFE, False) for h in m._forward_pre_hooks.values())
        calls = _three_calls_under_a_graph(r, m, call, ReplayGraph())
        assert r.positions[r.layers[0]] == (3 * 5) % 8
    _assert_three_calls_of_five(r, calls)


# -- accelerate's dispatch_model replaces forward with its wrapper; pre-hooks still run ----------

def _check_dispatched(model, device):
    mods = find_experts_modules(model)
    assert all(hasattr(m, "_hf_hook") and "forward" in vars(m) for _, m in mods.values())  # accelerate's wrapper is on
    x = ids(1, 5, device=device)
    with torch.no_grad():
        ref = model(x).logits
    SEEN.clear()
    with TraceRouting(model, seed=9, tokens=32) as r:
        model.generate(x, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    for col, layer in enumerate(r.layers):
        assert torch.equal(torch.cat(seen(model)[layer]), r.trace[:7, col])
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref)


def test_accelerate_dispatch_with_experts_offloaded_to_disk(tmp_path):
    dispatch_model = pytest.importorskip("accelerate", reason="accelerate is the bench's baseline (extra `bench`), not a dependency").dispatch_model

    model = build("mixtral")
    device_map = {"": "cpu"} | {name: "disk" for name, _ in find_experts_modules(model).values()}
    model = dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path))
    _check_dispatched(model, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_accelerate_dispatch_with_experts_on_cpu_cuda():
    dispatch_model = pytest.importorskip("accelerate", reason="accelerate is the bench's baseline (extra `bench`), not a dependency").dispatch_model

    model = build("mixtral", "cuda")
    device_map = {"": 0} | {name: "cpu" for name, _ in find_experts_modules(model).values()}
    model = dispatch_model(model, device_map=device_map, main_device=0)
    _check_dispatched(model, "cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_hook_never_syncs_cuda():
    model = build("qwen3_moe", "cuda")
    m, call = _first_layer_call(model, "cuda")
    with TraceRouting(model, tokens=8) as r:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host<->device sync raises
        try:
            calls = [r._pre_hook(0, m, call, {})[0] for _ in range(3)]  # the second call wraps around
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for h, got, weights in calls:
        assert h is call[0] and weights is call[2] and got.device == call[1].device
    _assert_three_calls_of_five(r, [got for _, got, _ in calls])


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_a_captured_hook_routes_each_replay_by_the_next_rows_cuda():
    from tiers.graphs.graph_cache import CudaGraph

    model = build("qwen3_moe", "cuda")
    m, call = _first_layer_call(model, "cuda")
    with TraceRouting(model, seed=12, tokens=8) as r:
        graph = CudaGraph(torch.cuda.graph_pool_handle(), torch.cuda.Stream())
        calls = _three_calls_under_a_graph(r, m, call, graph)
        assert r.positions[r.layers[0]] == (3 * 5) % 8
    _assert_three_calls_of_five(r, calls)


# -- Tiers' own experts implementation -----------------------------------------------------------

def test_tiers_experts_implementation_looks_up_the_trace(packed_factory):
    import tiers
    from tiers.api import manager_of
    from tiers.tools.trace import lookups

    cfg = {"tiers": {"gpu": {"fraction": 0.25}, "cpu": {"fraction": 0.4, "precision": "bf16"},
                     "nvme": {"precision": "bf16"}}}
    model = tiers.load(packed_factory("mixtral"), cfg, device="cpu", progress=False)
    mgr = manager_of(model)
    mgr.slots.recorded = []
    with TraceRouting(model, seed=10, tokens=32) as r, torch.no_grad():
        for t in range(6):  # one token per call: the engine looks up exactly that row's experts
            model(torch.tensor([[5 + t]]))
    assert mgr.slots.recorded == lookups(r.trace[:6], r.layers)
    mgr.close()
