"""Step graphs (tiers.graphs.step_graphs): generate's batch-1 decode steps replayed whole as one graph.

On CUDA ``tiers.load`` installs them (``tiers.gpu.graphs``, on by default) with CUDA graphs; on the
CPU the tests install them with ``HostGraph``, which replays by calling the step, so the same
caching, the two caches' bookkeeping and the fallbacks run. The decode switch and direct decode
are switched on on the CPU as in tests/tiers/paths/test_direct.py (the reference kernel).

Bounds: a graph step equals the same step run op by op bit for bit (CUDA: the same kernels
replayed). Against Tiers' decode on generate's own dynamic cache, where attention runs over the
exact length instead of the padded static cache, the greedy tokens equal and the median over the
steps of the logits' SQNR is at least 40 dB (measured 43-50 dB per step on the CPU). The median,
not every step: bf16 rounding can flip a near-tie in a router's top-k, and that step's logits
then differ more (a tiny Mixtral's layer 2 picked expert 7 or 3 at gate weights 0.461 and 0.460:
13 dB at that step, 45 dB at the next). A cache or position bug puts every step below 0 dB.
"""
from __future__ import annotations

import gc
import inspect
import statistics
import weakref

import pytest
import torch

import tiers
from tiers.api import manager_of
from tiers.graphs import step_graphs
from tiers.graphs.graph_cache import HostGraph
from tiers.graphs.step_graphs import StepGraphs
from tiers.loader.pack import pack
from conftest import COMMON, save_tiny

NEW = 12
GEN = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
# a few experts hot per layer, every other one warm in bf16; 8 staging slots, all reserved for direct misses
DIRECT_BF16 = {"gpu": {"fraction": 0.6, "staging_slots": 8}, "cpu": {"budget": "64MiB", "precision": "bf16"}, "nvme": {"precision": "bf16"}}


def _cfg(steps: bool, **extra) -> dict:
    return {"tiers": {**DIRECT_BF16, "gpu": {**DIRECT_BF16["gpu"], "graphs": steps}, **extra}}


def _load(packed, device, steps=True, graph=HostGraph, **extra):
    model = tiers.load(packed, _cfg(steps, **extra), device=device, progress=False)
    mgr = manager_of(model)
    mgr.batched_decode = True  # what a GPU does; forced on the CPU
    if device.type == "cpu":
        mgr.staging.direct_reads = mgr.direct.enabled = True  # the torch reference stands in for the kernel
        if steps:
            step_graphs.install(model, mgr, graph=graph)
    assert (mgr.steps is not None) == steps and mgr.direct.enabled
    return model, mgr


def _load_hot(packed, device, steps=True, graph=HostGraph):
    """Every expert hot (all layers resident); with ``steps``, step graphs (installed with ``graph`` on the CPU)."""
    model = tiers.load(packed, {"tiers": {"gpu": {"fraction": 1.0, "graphs": steps}}}, device=device, progress=False)
    mgr = manager_of(model)
    mgr.batched_decode = True
    if steps and device.type == "cpu":
        step_graphs.install(model, mgr, graph=graph)
    return model, mgr


def _prompt(device, length=10):
    return torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(7)).to(device)


def _sqnr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return (10 * torch.log10(a.pow(2).sum() / (a - b).pow(2).sum().clamp_min(1e-30))).item()


def _cache_of(out):
    return out.past_key_values if hasattr(out, "past_key_values") else out.cache


def assert_close_to(ref, out) -> None:
    assert torch.equal(ref.sequences, out.sequences)
    sqnr = [_sqnr(a, b) for a, b in zip(ref.logits, out.logits)]
    assert statistics.median(sqnr) >= 40.0, f"logits SQNR per decode step: {[round(x, 1) for x in sqnr]}"


@pytest.fixture(scope="module")
def packed_bf16(packed_factory, tmp_path_factory):
    """model_type -> a bf16 pack; GPT-OSS's with every layer full attention (step graphs take
    full-attention caches only; ``test_sliding_window_layers_keep_steps_op_by_op``)."""
    made = {}

    def get(model_type: str):
        if model_type != "gpt_oss":
            return packed_factory(model_type, ("bf16",))
        if model_type not in made:
            d = tmp_path_factory.mktemp("gpt_oss-full")
            src = save_tiny("gpt_oss", d / "hf", layer_types=["full_attention"] * COMMON["num_hidden_layers"])
            pack(src, d / "packed", precisions=("bf16",), progress=False)
            made[model_type] = d / "packed"
        return made[model_type]

    return get


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_graph_steps_equal_the_same_steps_op_by_op(model_type, device, packed_bf16):
    """Every decode step but the first runs from a graph (captured once); its logits equal the same
    static-cache steps run op by op, bit for bit, and the token's host work is done once per step."""
    packed = packed_bf16(model_type)
    ids = _prompt(device)
    model, mgr = _load(packed, device)
    out = model.generate(ids, **GEN)
    s = tiers.stats(model)
    assert s.step_graphs["steps"] == NEW - 1 and s.step_graphs["eager"] == {}, s.step_graphs
    assert s.step_graphs["captured"] == 1 and s.step_graphs["positions"] == StepGraphs.MIN_POSITIONS
    layers = len(mgr.manifest.layers)
    direct_layers = sum(not mgr.resident.qualifies(L) for L in mgr.manifest.layers)
    assert s.direct["decode_calls"] == direct_layers * (NEW - 1), s.direct
    assert s.hits["cpu"] > 0, "decode must read warm experts"

    plain, pmgr = _load(packed, device)
    pmgr.steps.graphs.enabled = False  # the same steps, op by op
    again = plain.generate(ids, **GEN)
    assert tiers.stats(plain).step_graphs["captured"] == 0 and tiers.stats(plain).step_graphs["steps"] == NEW - 1
    assert torch.equal(out.sequences, again.sequences)
    for step, (a, b) in enumerate(zip(out.logits, again.logits)):
        assert torch.equal(a, b), f"decode step {step}"
    assert tiers.stats(plain).hits == s.hits and sum(s.hits.values()) > layers * (NEW - 1) * 2


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_graph_steps_close_to_decode_on_the_dynamic_cache(model_type, device, packed_bf16):
    packed = packed_bf16(model_type)
    ids = _prompt(device)
    ref = _load(packed, device, steps=False)[0].generate(ids, **GEN)
    model, mgr = _load(packed, device)
    assert_close_to(ref, model.generate(ids, **GEN))
    assert tiers.stats(model).step_graphs["steps"] == NEW - 1


@pytest.fixture(scope="module")
def packed_sliding(tmp_path_factory):
    """GPT-OSS as configured (sliding-window layers between full-attention ones), with a window of
    4 positions, shorter than the prompt, so that each sliding layer's cache drops positions."""
    d = tmp_path_factory.mktemp("gpt_oss-sliding")
    src = save_tiny("gpt_oss", d / "hf", sliding_window=4)
    pack(src, d / "packed", precisions=("bf16",), progress=False)
    return d / "packed"


def test_sliding_window_layers_run_as_graph_steps(device, packed_sliding):
    """Every decode step but the first runs from the graph; the steps equal the same static-cache
    steps op by op bit for bit, and are close to decode on generate's own cache, whose sliding
    layers keep only their window (with the window left out of the step's masks, greedy tokens
    part from the first graph step on the CPU). What generate returns holds every position."""
    ids = _prompt(device)
    model, mgr = _load(packed_sliding, device)
    assert {"sliding_attention", "full_attention"} == set(model.config.layer_types)
    out = model.generate(ids, **GEN)
    s = tiers.stats(model).step_graphs
    assert s["steps"] == NEW - 1 and s["eager"] == {}, s

    plain, pmgr = _load(packed_sliding, device)
    pmgr.steps.graphs.enabled = False  # the same steps, op by op
    again = plain.generate(ids, **GEN)
    assert torch.equal(out.sequences, again.sequences)
    for step, (a, b) in enumerate(zip(out.logits, again.logits)):
        assert torch.equal(a, b), f"decode step {step}"

    ref = _load(packed_sliding, device, steps=False)[0].generate(ids, **GEN)
    assert_close_to(ref, out)
    got, want = _cache_of(out), _cache_of(ref)
    assert got.get_seq_length() == want.get_seq_length() == ids.shape[1] + NEW - 1
    for i, (a, b) in enumerate(zip(got.layers, want.layers)):
        assert a.keys.shape == b.keys.shape and _sqnr(b.keys, a.keys) >= 40.0, f"layer {i}"


def test_sliding_layers_without_the_steps_masks_keep_steps_op_by_op(device, packed_sliding):
    """Sliding layers under an attention whose masks transformers builds (not eager) have no
    step-made window: every decode step runs op by op, counted under "cache"."""
    ids = _prompt(device)
    model, mgr = _load(packed_sliding, device)
    mgr.steps.window, mgr.steps.layer_kinds_ok = None, False  # what a non-eager attention gets
    out = model.generate(ids, **GEN)
    s = tiers.stats(model).step_graphs
    assert s["steps"] == 0 and s["eager"] == {"cache": NEW - 1}, s
    plain = _load(packed_sliding, device, steps=False)[0].generate(ids, **GEN)
    assert torch.equal(out.sequences, plain.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, plain.logits))


def test_returned_cache_holds_every_position(device, packed_factory):
    """What generate returns holds the prompt and every decoded token but the last, the decoded
    positions being those the graph wrote into the static cache."""
    packed = packed_factory("qwen3_moe", ("bf16",))
    ids = _prompt(device)
    ref = _cache_of(_load(packed, device, steps=False)[0].generate(ids, **GEN))
    model, mgr = _load(packed, device)
    got = _cache_of(model.generate(ids, **GEN))
    n = ids.shape[1] + NEW - 1
    assert got.get_seq_length() == ref.get_seq_length() == n
    static = mgr.steps.cache
    for i, (a, b) in enumerate(zip(got.layers, static.layers)):
        assert torch.equal(a.keys, b.keys[:, :, :n]) and torch.equal(a.values, b.values[:, :, :n]), f"layer {i}"
    for i, (a, b) in enumerate(zip(got.layers, ref.layers)):
        assert _sqnr(b.keys, a.keys) >= 40.0 and _sqnr(b.values, a.values) >= 40.0, f"layer {i}"  # qwen3 at this seed: no flip


def test_a_step_that_falls_back_sees_a_complete_cache(device, packed_factory, monkeypatch):
    """A layer leaves direct decode mid-stage: that step and the rest run op by op on generate's
    cache, which first gets the positions the graph steps wrote; tokens stay right, and the
    rebalancer counts each token once (the fallen-back step's first call does not open it again)."""
    packed = packed_factory("qwen3_moe", ("bf16",))
    ids = _prompt(device)
    ref = _load(packed, device, steps=False, rebalance={"every_tokens": 4})[0].generate(ids, **GEN)
    model, mgr = _load(packed, device, rebalance={"every_tokens": 4})
    qualifies, steps = mgr.direct.qualifies, []
    layer = max(mgr.manifest.layers)

    def direct_qualifies(L, picks):
        if L == layer and len(steps) >= 5:
            return False
        return qualifies(L, picks)
    begin = mgr.begin_step
    monkeypatch.setattr(mgr, "begin_step", lambda k: steps.append(1) or begin(k))
    monkeypatch.setattr(mgr.direct, "qualifies", direct_qualifies)
    out = model.generate(ids, **GEN)
    assert_close_to(ref, out)
    s = tiers.stats(model).step_graphs
    assert s["steps"] == 4 and s["eager"] == {"layers": NEW - 1 - 4}, s
    assert _cache_of(out).get_seq_length() == ids.shape[1] + NEW - 1
    assert sum(mgr.rebalancer.window.spans) == ids.shape[1] + NEW - 1, "each token counted once"


def test_rebalancer_counts_the_same_with_and_without_graph_steps(device, packed_factory):
    packed = packed_factory("qwen3_moe", ("bf16",))
    ids = _prompt(device)
    got = []
    for steps in (False, True):
        model, mgr = _load(packed, device, steps=steps, rebalance={"every_tokens": 4})
        model.generate(ids, **GEN)
        r = mgr.rebalancer
        got.append((r.counts["rebalances"], list(r.window.spans), int(r.window.frequency().sum())))
    assert got[0] == got[1] and got[0][0] > 0


def test_batches_and_padding_run_op_by_op(device, packed_factory):
    packed = packed_factory("qwen3_moe", ("bf16",))
    model, mgr = _load(packed, device)
    two = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(7)).to(device)
    model.generate(two, **GEN)
    assert tiers.stats(model).step_graphs["eager"] == {"shape": NEW - 1} and tiers.stats(model).step_graphs["steps"] == 0
    mgr.reset_stats()
    ids = _prompt(device)
    mask = torch.ones_like(ids)
    mask[0, 0] = 0  # a padded position: the static step (no mask) would attend to it
    ref = _load(packed, device, steps=False)[0].generate(ids, attention_mask=mask, **GEN)
    out = model.generate(ids, attention_mask=mask, **GEN)
    assert tiers.stats(model).step_graphs["eager"] == {"padding": NEW - 1}
    assert torch.equal(ref.sequences, out.sequences)
    for a, b in zip(ref.logits, out.logits):
        assert torch.equal(a, b)


def test_the_static_cache_grows_and_its_graphs_follow(device, packed_factory, monkeypatch):
    monkeypatch.setattr(StepGraphs, "MIN_POSITIONS", 8)
    packed = packed_factory("mixtral", ("bf16",))
    ids = _prompt(device)  # 10 positions: 16, then 32 past the 16th
    ref = _load(packed, device, steps=False)[0].generate(ids, **GEN)
    model, mgr = _load(packed, device)
    assert_close_to(ref, model.generate(ids, **GEN))
    s = tiers.stats(model).step_graphs
    assert s["positions"] == 32 and s["steps"] == NEW - 1 and s["captured"] == 2, s
    assert len(mgr.steps.graphs._entries) == 1, "the smaller cache's graph is dropped"
    # kept across generates: the same cache and graph serve the next one
    mgr.reset_stats()
    again = model.generate(ids, **GEN)
    assert_close_to(ref, again)
    s = tiers.stats(model).step_graphs
    assert s["captured"] == 0 and s["steps"] == NEW - 1, s


def test_untimed_reads_stay_out_of_the_copy_rate(device, packed_factory):
    packed = packed_factory("qwen3_moe", ("bf16",))
    model, mgr = _load(packed, device)
    model.generate(_prompt(device), **GEN)
    s = tiers.stats(model)
    assert s.untimed_bytes > 0 and s.untimed_bytes <= s.bytes_moved["cpu"]
    if s.stage_seconds:
        assert s.h2d_gbps == pytest.approx((sum(s.bytes_moved.values()) - s.untimed_bytes) / s.stage_seconds / 1e9)


def test_off_by_config_and_off_the_gpu(packed_factory):
    packed = packed_factory("qwen3_moe", ("bf16",))
    for cfg in (_cfg(False), _cfg(True)):
        model = tiers.load(packed, cfg, device="cpu", progress=False)
        assert manager_of(model).steps is None and "forward" not in vars(model), "the CPU keeps the model's own forward"
        assert tiers.stats(model).step_graphs == {"on": 0}


def test_all_hot_layers_run_inside_the_graph_and_count_once(device, packed_factory):
    """At a 100% budget every layer is resident: the whole step replays, and each step's lookups
    are counted once, as op by op."""
    packed = packed_factory("qwen3_moe", ("bf16",))
    ids = _prompt(device)
    got = []
    for steps in (False, True):
        model, mgr = _load_hot(packed, device, steps=steps)
        assert all(mgr.resident.qualifies(L) for L in mgr.manifest.layers)
        got.append((model.generate(ids, **GEN), tiers.stats(model)))
    (ref, a), (out, b) = got
    assert b.step_graphs["steps"] == NEW - 1 and b.step_graphs["eager"] == {}
    assert a.hits == b.hits and b.hits["gpu"] > 0
    assert_close_to(ref, out)


def _manual_decode(model, ids, steps: int):
    """Greedy decode by hand inside generate's decode switch, passing no positions (as
    ``tools.measure.interleaved_decode`` does): each step's logits, and the cache at the end."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        tok, cache = out.logits[:, -1:].argmax(-1), out[name]
        with model._optimize_model_for_decode():
            for _ in range(steps):
                out = model(input_ids=tok, use_cache=True, **{name: cache})
                logits.append(out.logits[:, -1].float())
                tok, cache = out.logits[:, -1:].argmax(-1), out[name]
    return logits, cache


def test_calls_without_positions_put_the_token_at_the_cache_end(device, packed_factory):
    packed = packed_factory("qwen3_moe", ("bf16",))
    ids = _prompt(device)
    ref, ref_cache = _manual_decode(_load(packed, device, steps=False)[0], ids, NEW - 1)
    model, mgr = _load(packed, device)
    got, cache = _manual_decode(model, ids, NEW - 1)
    assert tiers.stats(model).step_graphs["steps"] == NEW - 1
    assert [x.argmax() for x in ref] == [x.argmax() for x in got]
    assert statistics.median(_sqnr(a, b) for a, b in zip(ref, got)) >= 40.0
    assert cache.get_seq_length() == ref_cache.get_seq_length() == ids.shape[1] + NEW - 1


def test_unmarked_hooks_keep_steps_op_by_op(device, packed_factory):
    """A forward hook runs on the host at every call; a graph would replay only the kernels it
    launched at the capture. Unless a hook is marked ``graph_safe``, steps run op by op."""
    packed = packed_factory("qwen3_moe", ("bf16",))
    ids = _prompt(device)
    model, mgr = _load(packed, device)
    calls = []
    handle = model.model.layers[1].mlp.register_forward_pre_hook(lambda mod, args: calls.append(1))
    try:
        out = model.generate(ids, **GEN)
    finally:
        handle.remove()
    assert len(calls) == NEW  # the prefill and every decode step ran it
    assert tiers.stats(model).step_graphs["eager"] == {"hooks": NEW - 1} and tiers.stats(model).step_graphs["steps"] == 0
    ref = _load(packed, device, steps=False)[0].generate(ids, **GEN)
    assert torch.equal(ref.sequences, out.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ref.logits, out.logits))

    marked = step_graphs.graph_safe(lambda mod, args: calls.append(1))
    assert tiers.graph_safe is step_graphs.graph_safe
    handle = model.model.layers[1].mlp.register_forward_pre_hook(marked)
    try:
        model.generate(ids, **GEN)  # marked: the steps replay (the hook runs at the capture only on a GPU)
    finally:
        handle.remove()
    assert tiers.stats(model).step_graphs["steps"] == NEW - 1
    with pytest.raises(TypeError, match="pass a function or a functools.partial"):
        step_graphs.graph_safe(mgr.reset_stats)  # a bound method


def test_trace_routing_inside_the_graph_routes_each_step_anew(device, packed_factory):
    """The bench's trace routing (graph-safe hooks, counters on the device) runs inside step
    graphs, and every replayed step is routed by its own trace rows: logits equal the same steps
    op by op bit for bit. On the CPU the graph is ``ReplayGraph``, which replays only the recorded
    tensor ops, as a CUDA graph does (a host-side counter would route every replayed step as the
    captured one; all layers resident here: direct decode's CPU stand-in plans on the host). Taking
    the hooks off drops the graph, which held their kernels, and captures anew."""
    from replay_graph import ReplayGraph
    from tiers.tools.routing import TraceRouting

    packed = packed_factory("qwen3_moe", ("bf16",))
    ids = _prompt(device)
    got = []
    for graphs in (True, False):
        model, mgr = _load_hot(packed, device, graph=ReplayGraph)
        mgr.steps.graphs.enabled = graphs
        with TraceRouting(model, zipf_s=1.2, reuse_p=0.5, seed=0, tokens=64) as r:
            got.append(model.generate(ids, **GEN))
            assert r.positions == {layer: ids.shape[1] + NEW - 1 for layer in r.layers}
        assert tiers.stats(model).step_graphs["steps"] == NEW - 1 and tiers.stats(model).step_graphs["captured"] == int(graphs)
        if graphs:
            routed, routed_mgr, routing = model, mgr, weakref.ref(r)
        del r
    out, ref = got
    assert torch.equal(out.sequences, ref.sequences)
    for step, (a, b) in enumerate(zip(out.logits, ref.logits)):
        assert torch.equal(a, b), f"decode step {step}"

    routed_mgr.reset_stats()
    again = routed.generate(ids, **GEN)  # no hooks now: routed by the model's own routers
    assert tiers.stats(routed).step_graphs["captured"] == 1 and tiers.stats(routed).step_graphs["steps"] == NEW - 1
    plain, pmgr = _load_hot(packed, device, graph=ReplayGraph)
    pmgr.steps.graphs.enabled = False
    want = plain.generate(ids, **GEN)
    assert all(torch.equal(a, b) for a, b in zip(again.logits, want.logits))
    assert not torch.equal(again.logits[-1], out.logits[-1])
    gc.collect()
    assert routing() is None, "the dropped graphs let the old hooks (and what they read) go"
    assert len(routed_mgr.steps.graphs._entries) == 1


def test_trace_routing_with_direct_layers_counts_what_op_by_op_counts(device, packed_factory):
    """With layers on direct decode too: against the same generate op by op on generate's own
    cache, the rebalancer counted exactly the same lookups per expert (a step routed as another
    would count other experts), and tokens and logits agree within the static cache's bound. On
    the CPU, ``HostGraph`` calls the hooks at each replay: only a GPU run checks the device counters here."""
    from tiers.tools.routing import TraceRouting

    packed = packed_factory("qwen3_moe", ("bf16",))
    ids = _prompt(device)
    got = []
    for steps in (False, True):
        model, mgr = _load(packed, device, steps=steps, rebalance={"every_tokens": 1000})
        with TraceRouting(model, zipf_s=1.2, reuse_p=0.5, seed=0, tokens=64):
            out = model.generate(ids, **GEN)
        got.append((out, mgr.rebalancer.window.frequency().copy()))
    (ref, ref_freq), (out, freq) = got
    s = tiers.stats(model).step_graphs
    assert s["steps"] == NEW - 1 and s["eager"] == {} and s["captured"] == 1, s
    assert (freq == ref_freq).all() and freq.sum() > 0
    assert_close_to(ref, out)


def test_the_stats_table_says_what_step_graphs_did(device, packed_factory):
    packed = packed_factory("qwen3_moe", ("bf16",))
    model, mgr = _load(packed, device)
    model.generate(_prompt(device), **GEN)
    model.generate(torch.cat([_prompt(device)] * 2), **GEN)
    text = str(tiers.stats(model))
    assert f"step graphs: {NEW - 1} decode steps run whole" in text and f"{NEW - 1} shape" in text, text
    assert "read inside step graphs, untimed" in text
    d = tiers.stats(model).as_dict()
    assert d["step_graphs"]["steps"] == NEW - 1 and d["untimed_bytes"] > 0


@pytest.mark.parametrize("position", [0, 3, 5, 15])
def test_eager_masks_are_transformers_own(position):
    """Eager attention's masks, made on the device for a captured step, equal transformers' eager
    masks of one token at ``position`` over a static cache, bit for bit, for each layer type:
    the causal one, and the sliding-window one (window 4) over a cache that holds every position."""
    from transformers.masking_utils import causal_mask_function, eager_mask, sliding_window_causal_mask_function

    steps = object.__new__(StepGraphs)
    steps.capacity, steps.kv, steps.window = 16, [torch.zeros(1, 1, 16, 4, dtype=torch.bfloat16)], 4
    steps.text_config = type("Text", (), {"layer_types": ["sliding_attention", "full_attention"]})()
    got = steps._eager_masks(torch.tensor([position]))
    want = {t: eager_mask(batch_size=1, q_length=1, kv_length=16, q_offset=position, mask_function=f, dtype=torch.bfloat16)
            for t, f in (("full_attention", causal_mask_function), ("sliding_attention", sliding_window_causal_mask_function(4)))}
    assert set(got) == set(want) and all(torch.equal(got[t], want[t]) for t in want)
    assert (want["sliding_attention"] == 0).sum() == min(position + 1, 4)


@pytest.mark.parametrize("model_type", ["gpt_oss", "qwen3_moe"])
def test_eager_attention_steps_pass_their_masks(model_type, packed_bf16, monkeypatch):
    """A model with eager attention (GPT-OSS's default) gets its masks from the step, not from
    transformers' eager_mask, whose host-to-device copy a CUDA capture refuses; one with SDPA
    builds its own."""
    model, mgr = _load(packed_bf16(model_type), torch.device("cpu"))
    calls = []
    real = StepGraphs._eager_masks
    monkeypatch.setattr(StepGraphs, "_eager_masks", lambda self, position: calls.append(int(position)) or real(self, position))
    model.generate(_prompt(torch.device("cpu")), **GEN)
    eager = model.config._attn_implementation == "eager"
    assert mgr.steps.eager_attention == eager == (model_type == "gpt_oss")
    assert len(calls) == (NEW - 1 if eager else 0) and calls == sorted(calls)
