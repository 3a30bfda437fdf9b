"""The graph cache (tiers.graphs.graph_cache): a call's device work replayed as a captured graph.

The cache itself is tested with ``HostGraph`` (replay by calling the step) and with fakes that
check what a CUDA graph relies on: a replay only ever runs with the tensors it was captured with.
End to end, generate with decode graphs on matches generate with them off exactly: on the CPU
through ``HostGraph`` with direct decode forced on, on CUDA with real graphs (marked).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tiers
from tiers import report
from tiers.api import manager_of
from tiers.config import parse_config
from tiers.graphs.graph_cache import GraphCache, HostGraph, signature
from untiered import GEN, assert_generate_equal, reference


class CheckedGraph(HostGraph):
    """A HostGraph that remembers the bound tensors' signature at capture, and a replay that
    fails if the step's bound tensors changed since (what a CUDA graph would silently misread)."""

    def __init__(self, bound_now):
        super().__init__()
        self.bound_now = bound_now
        self.at_capture = None

    def capture(self, step, inputs):
        self.at_capture = self.bound_now()
        super().capture(step, inputs)

    def replay(self):
        assert self.bound_now() == self.at_capture, "a graph replayed with other tensors than it captured"
        return super().replay()


def _affine(table):
    def step(x):
        return x * table[0] + table[1]
    return step


def test_first_call_warms_up_then_captures_then_replays():
    g = GraphCache(torch.device("cpu"), True)
    table = torch.tensor([2.0, 1.0])
    calls = []

    def step(x):
        calls.append(x.clone())
        return x * table[0] + table[1]

    outs = [g.run("k", (table,), step, (torch.full((3,), float(i)),)) for i in range(4)]
    assert [o.tolist() for o in outs] == [[2 * i + 1.0] * 3 for i in range(4)]
    assert g.counts() == {"on": 1, "graphs": 1, "captured": 1, "replayed": 3, "eager": 1, "failed": 0}
    assert len(calls) == 4  # warm-up, then one call per replay (the capture itself runs nothing)
    assert outs[2] is not outs[3] and outs[2].data_ptr() != outs[3].data_ptr(), "fresh outputs: a replay must not overwrite an earlier result"


def test_static_output_when_not_fresh():
    g = GraphCache(torch.device("cpu"), True)
    table = torch.tensor([1.0, 0.0])
    outs = [g.run("k", (table,), _affine(table), (torch.full((2,), float(i)),), fresh=False) for i in range(4)]
    assert outs[1] is outs[2] is outs[3] and outs[3].tolist() == [3.0, 3.0]


def test_new_bound_tensors_recapture():
    """A table rebuilt as a new tensor: the cached graph is dropped and, the key warm already, a new
    graph is captured at once; no replay ever runs with the old tensor."""
    holder = {"t": torch.tensor([2.0, 0.0])}
    g = GraphCache(torch.device("cpu"), True, graph=lambda: CheckedGraph(lambda: signature([holder["t"]])))
    x = torch.ones(2)
    for _ in range(3):
        assert g.run("k", (holder["t"],), _affine(holder["t"]), (x,)).tolist() == [2.0, 2.0]
    holder["t"] = torch.tensor([5.0, 0.0])
    for _ in range(3):
        assert g.run("k", (holder["t"],), _affine(holder["t"]), (x,)).tolist() == [5.0, 5.0]
    assert (g.captured, g.eager_calls, g.replayed) == (2, 1, 5)
    # rewritten in place: the same graph, the new values
    holder["t"].copy_(torch.tensor([7.0, 1.0]))
    assert g.run("k", (holder["t"],), _affine(holder["t"]), (x,)).tolist() == [8.0, 8.0] and g.captured == 2


class PooledGraph(HostGraph):
    """A HostGraph in a shared pool as torch's caching allocator keeps one: a capture into a pool
    that has held graphs needs one of them alive (else torch failed an internal assertion)."""

    def __init__(self, pool: Counter):
        super().__init__()
        self.pool, self.captured = pool, False

    def capture(self, step, inputs):
        assert self.pool["alive"] > 0 or not self.pool["ever"], "captured into a pool whose graphs are all freed"
        super().capture(step, inputs)
        self.captured = True
        self.pool["alive"] += 1
        self.pool["ever"] += 1

    def __del__(self):
        if self.captured:
            self.pool["alive"] -= 1


def test_a_recapture_finds_the_shared_pool_alive():
    """A key's graph replaced by one with new bound tensors (and keys evicted from a full cache):
    each capture into the shared pool happens while a graph of it is still alive."""
    pool = Counter()
    holder = {"t": torch.tensor([2.0, 0.0])}
    g = GraphCache(torch.device("cpu"), True, graph=lambda: PooledGraph(pool))
    x = torch.ones(2)
    for value in (2.0, 5.0, 7.0):
        holder["t"] = torch.tensor([value, 0.0])
        for _ in range(3):
            assert g.run("k", (holder["t"],), _affine(holder["t"]), (x,)).tolist() == [value, value]
    assert g.captured == 3 and pool["alive"] >= 1


def test_tensors_that_change_on_every_call_capture_every_other_call():
    """A bound tensor new on every call: a capture, then a warm-up, in turn (not a capture per
    call), every result that of its own tensor."""
    holder = {}
    g = GraphCache(torch.device("cpu"), True, graph=lambda: CheckedGraph(lambda: signature([holder["t"]])))
    for i in range(6):
        holder["t"] = torch.tensor([float(i), 0.0])
        assert g.run("k", (holder["t"],), _affine(holder["t"]), (torch.ones(1),)).item() == i
    assert (g.captured, g.eager_calls, g.replayed) == (3, 3, 3)


def test_a_step_bound_to_another_graphs_outputs_captures_when_that_graph_does():
    """The second step binds the first one's output (``fresh=False``): when the first graph is
    captured its output becomes the graph's own tensor, and the second, warm already, captures
    with it in the same call instead of warming up again; both replay from the third call."""
    g = GraphCache(torch.device("cpu"), True)
    table = torch.tensor([2.0, 1.0])
    for i in range(4):
        x = torch.full((3,), float(i))
        planned = g.run("plan", (table,), _affine(table), (x,), fresh=False)
        out = g.run("window", (planned,), lambda: planned * 10, ())
        assert out.tolist() == [(2 * i + 1) * 10.0] * 3
    assert (g.captured, g.eager_calls, g.replayed) == (2, 2, 6)


def test_other_shapes_are_other_graphs():
    g = GraphCache(torch.device("cpu"), True)
    table = torch.tensor([3.0, 0.0])
    for n in (1, 2, 1, 2, 1, 2):
        assert g.run("k", (table,), _affine(table), (torch.ones(n),)).tolist() == [3.0] * n
    assert g.counts()["graphs"] == 2 and g.captured == 2


def test_a_failed_capture_runs_eagerly_from_then_on(caplog):
    class Refuses(HostGraph):
        def capture(self, step, inputs):
            raise RuntimeError("operation not permitted when stream is capturing")

    g = GraphCache(torch.device("cpu"), True, graph=Refuses)
    table = torch.tensor([2.0, 0.0])
    outs = [g.run(("fetch", 3), (table,), _affine(table), (torch.full((1,), float(i)),)).item() for i in range(5)]
    assert outs == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert g.counts() == {"on": 1, "graphs": 0, "captured": 0, "replayed": 0, "eager": 5, "failed": 1}
    assert "('fetch', 3)" in caplog.text and "not captured" in caplog.text


def test_disabled_always_runs_eagerly():
    g = GraphCache(torch.device("cpu"), False)
    table = torch.tensor([1.0, 1.0])
    for _ in range(3):
        g.run("k", (table,), _affine(table), (torch.ones(1),))
    assert g.counts() == {"on": 0, "graphs": 0, "captured": 0, "replayed": 0, "eager": 0, "failed": 0}


def test_inlined_calls_run_their_step_as_it_is():
    """Inside a step graph's capture (``inlined``) every call runs its step, neither warming up nor
    capturing, and the cache goes back to replaying after."""
    g = GraphCache(torch.device("cpu"), True)
    table = torch.tensor([2.0, 0.0])
    for _ in range(3):
        g.run("k", (table,), _affine(table), (torch.ones(1),))
    before = g.counts()
    with g.inlined():
        assert g.inline and g.run("k", (table,), _affine(table), (torch.full((1,), 4.0),)).item() == 8.0
        assert g.run("new", (table,), _affine(table), (torch.ones(1),)).item() == 2.0
    assert not g.inline and g.counts() == before
    g.run("k", (table,), _affine(table), (torch.ones(1),))
    assert g.replayed == before["replayed"] + 1


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(GraphCache, "MAX_GRAPHS", 3)
    g = GraphCache(torch.device("cpu"), True)
    table = torch.tensor([1.0, 0.0])
    for key in range(10):
        for _ in range(2):
            g.run(key, (table,), _affine(table), (torch.ones(1),))
    assert len(g._entries) == 3


def test_config_key():
    """One switch, ``tiers.gpu.graphs``, for step, decode and prefill graphs; the three old keys are unknown now."""
    assert parse_config(None).gpu.graphs is True
    assert parse_config({"tiers": {"gpu": {"graphs": False}}}).gpu.graphs is False
    with pytest.raises(ValueError, match="tiers.gpu.graphs"):
        parse_config({"tiers": {"gpu": {"graphs": 1}}})
    for old in ("decode_graphs", "prefill_graphs", "step_graphs"):
        with pytest.raises(ValueError, match=f"tiers.gpu.{old}: unknown key"):
            parse_config({"tiers": {"gpu": {old: False}}})


def test_graphs_follow_the_switch_and_the_device(packed_factory):
    """On the CPU the manager's graph caches are off whatever the switch (no CUDA graphs; tests
    switch them on through ``HostGraph``)."""
    for graphs in (True, False):
        mgr = manager_of(tiers.load(packed_factory("qwen3_moe"), {"tiers": {"gpu": {"graphs": graphs}}}, device="cpu", progress=False))
        assert not mgr.decode_graphs.enabled and not mgr.prefill_graphs.enabled and mgr.steps is None
        s = report.stats(mgr)
        assert s.graphs["on"] == s.whole_graphs["on"] == s.step_graphs["on"] == 0


# -- property test: whatever the order of keys, shapes and table rebuilds, every result is the step's
_CALLS = st.lists(st.tuples(st.integers(0, 2), st.integers(1, 3), st.sampled_from(["call", "rebuild", "rewrite"])),
                  min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(calls=_CALLS)
def test_results_always_equal_the_eager_step(calls):
    tables = {k: torch.tensor([float(k + 2), 1.0]) for k in range(3)}
    current = {}
    g = GraphCache(torch.device("cpu"), True, graph=lambda: CheckedGraph(lambda: current["sig"]))
    warm = Counter()  # eager calls per key and shape
    for i, (key, n, op) in enumerate(calls):
        if op == "rebuild":
            tables[key] = tables[key] + 1.0  # a new tensor
        elif op == "rewrite":
            tables[key].add_(1.0)  # in place
        t = tables[key]
        current["sig"] = signature([t])
        x = torch.arange(n, dtype=torch.float32) + i
        before = g.counts()
        got = g.run(key, (t,), _affine(t), (x,))
        assert torch.equal(got, x * t[0] + t[1])
        after = g.counts()
        if after["captured"] > before["captured"]:
            assert warm[key, n], "each capture follows a warm-up with the same key and shapes"
        warm[key, n] += after["eager"] - before["eager"]
    c = g.counts()
    assert c["replayed"] + c["eager"] == len(calls)


# -- end to end ---------------------------------------------------------------------------------
DIRECT_BF16 = {"gpu": {"fraction": 0.6, "staging_slots": 8}, "cpu": {"budget": "64MiB", "precision": "bf16"}, "nvme": {"precision": "bf16"}}
REBALANCE = {"every_tokens": 4, "window": 4}  # intervals long enough for a swap to be significant


def _load(packed, tiers_: dict, device, graphs: bool):
    """Decode graphs on or off; step graphs off (these tests check the layer calls' own graphs;
    tests/tiers/graphs/test_step_graphs.py replays whole steps)."""
    model = tiers.load(packed, {"tiers": tiers_ | {"gpu": tiers_["gpu"] | {"graphs": graphs}}}, device=device, progress=False)
    mgr = manager_of(model)
    mgr.batched_decode = True  # what a GPU does; forced on the CPU
    if mgr.steps is not None:
        mgr.steps.enabled = False
    if device.type == "cpu":
        mgr.staging.direct_reads = mgr.direct.enabled = True  # the torch reference stands in for the kernel
        mgr.decode_graphs = GraphCache(device, graphs)  # HostGraph: replays by calling the step
    assert mgr.decode_graphs.enabled == graphs and mgr.direct.enabled
    return model, mgr


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_decode_graphs_match_eager_decode_through_rebalances(model_type, device, checkpoint_factory, packed_factory):
    """bf16 tiers, direct decode and the rebalancer swapping experts: generate with decode graphs
    gives exactly the tokens and logits of generate without them and of the untiered model (its
    decode batched_mm, as on a GPU). The swaps rewrite the direct tables in place and the reserved
    slots keep their tensor, so no graph is captured twice: not after a swap, not in a second generate."""
    cfg = DIRECT_BF16 | {"rebalance": REBALANCE}
    packed = packed_factory(model_type)
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(3)).to(device)
    kw = GEN | {"max_new_tokens": 24, "min_new_tokens": 24}
    eager_model, eager_mgr = _load(packed, cfg, device, graphs=False)
    a = eager_model.generate(ids, **kw)
    model, mgr = _load(packed, cfg, device, graphs=True)
    b = model.generate(ids, **kw)
    assert_generate_equal(a, b)
    ref = reference(checkpoint_factory(model_type), device, batched_decode=True)
    assert_generate_equal(ref.generate(ids, **kw), b)
    s = tiers.stats(model)
    assert s.rebalance["promoted_hot"] > 0, "the test needs swaps during decode"
    layers = len(mgr.manifest.layers)
    direct = s.direct["decode_calls"]
    assert direct == layers * (kw["max_new_tokens"] - 1)
    g = s.graphs
    assert g["failed"] == 0 and g["captured"] == g["graphs"] > 0
    # every decode call of every layer ran through the cache twice (the fetch, the experts)
    assert g["replayed"] + g["eager"] == direct + layers * (kw["max_new_tokens"] - 1)
    assert g["replayed"] > 0.8 * (g["replayed"] + g["eager"])
    assert "decode graphs: %d layer calls replayed" % g["replayed"] in str(s) and s.as_dict()["graphs"] == g
    assert tiers.stats(eager_model).graphs == {"on": 0, "graphs": 0, "captured": 0, "replayed": 0, "eager": 0, "failed": 0}
    tables = {L: (d.starts, d.resident) for L, d in mgr.direct.layers.items()}
    mgr.reset_stats()
    c = model.generate(ids, **kw)
    assert torch.equal(b.sequences, c.sequences)  # bf16 everywhere: where an expert lives does not change its weights
    g2 = tiers.stats(model).graphs
    assert g2["captured"] == 0 and g2["eager"] == 0 and g2["failed"] == 0, "a second generate must replay every graph"
    for L, (starts, resident) in tables.items():
        d = mgr.direct.layers.get(L)
        assert d is None or (d.starts is starts and d.resident is resident), f"layer {L}'s tables were replaced, not rewritten"
    eager_mgr.close()
    mgr.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_step_that_syncs_falls_back_to_eager_on_cuda(caplog):
    """CUDA twin of the failed-capture test: a step with a host sync cannot be captured; the
    call still returns the step's result, and later calls run eagerly, with CUDA still usable."""
    dev = torch.device("cuda")
    g = GraphCache(dev, True)
    table = torch.tensor([2.0, 1.0], device=dev)

    def step(x):
        scale = float(table[0].item())  # a host sync: refused while the stream is capturing
        return x * scale + table[1]

    outs = [g.run("sync", (table,), step, (torch.full((4,), float(i), device=dev),)) for i in range(4)]
    assert [o.tolist() for o in outs] == [[2.0 * i + 1.0] * 4 for i in range(4)]
    assert g.counts()["failed"] == 1 and g.counts()["graphs"] == 0 and g.counts()["eager"] == 4
    assert "not captured" in caplog.text
    good = GraphCache(dev, True)  # graphs still capture and replay after the failure
    outs = [good.run("ok", (table,), _affine(table), (torch.full((4,), float(i), device=dev),)) for i in range(3)]
    assert outs[2].tolist() == [5.0] * 4 and good.counts()["replayed"] == 2
