"""Decode graphs (tiers.graphs): a decode step's experts calls replayed as captured graphs.

The cache itself is tested with ``HostGraph`` (replay by calling the step) and with fakes that
check what a CUDA graph relies on: a replay only ever runs with the tensors it was captured with.
End to end, generate with graphs on matches generate with them off exactly: on the CPU through
``HostGraph`` with direct decode forced on, on CUDA with real graphs (marked).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

import tiers
from tiers.config import parse_config
from tiers.graphs import DecodeGraphs, HostGraph, signature
from tiers.integration import manager_of

from test_end_to_end import GEN, assert_decode_logits


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
    g = DecodeGraphs(torch.device("cpu"), True)
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
    g = DecodeGraphs(torch.device("cpu"), True)
    table = torch.tensor([1.0, 0.0])
    outs = [g.run("k", (table,), _affine(table), (torch.full((2,), float(i)),), fresh=False) for i in range(4)]
    assert outs[1] is outs[2] is outs[3] and outs[3].tolist() == [3.0, 3.0]


def test_new_bound_tensors_recapture():
    """A table rebuilt as a new tensor: the cached graph is dropped and, the key warm already, a new
    graph is captured at once; no replay ever runs with the old tensor."""
    holder = {"t": torch.tensor([2.0, 0.0])}
    g = DecodeGraphs(torch.device("cpu"), True, graph=lambda: CheckedGraph(lambda: signature([holder["t"]])))
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


def test_tensors_that_change_on_every_call_capture_every_other_call():
    """A bound tensor new on every call: a capture, then a warm-up, in turn (not a capture per
    call), every result that of its own tensor."""
    holder = {}
    g = DecodeGraphs(torch.device("cpu"), True, graph=lambda: CheckedGraph(lambda: signature([holder["t"]])))
    for i in range(6):
        holder["t"] = torch.tensor([float(i), 0.0])
        assert g.run("k", (holder["t"],), _affine(holder["t"]), (torch.ones(1),)).item() == i
    assert (g.captured, g.eager_calls, g.replayed) == (3, 3, 3)


def test_a_step_bound_to_another_graphs_outputs_captures_when_that_graph_does():
    """The second step binds the first one's output (``fresh=False``): when the first graph is
    captured its output becomes the graph's own tensor, and the second, warm already, captures
    with it in the same call instead of warming up again; both replay from the third call."""
    g = DecodeGraphs(torch.device("cpu"), True)
    table = torch.tensor([2.0, 1.0])
    for i in range(4):
        x = torch.full((3,), float(i))
        planned = g.run("plan", (table,), _affine(table), (x,), fresh=False)
        out = g.run("window", (planned,), lambda: planned * 10, ())
        assert out.tolist() == [(2 * i + 1) * 10.0] * 3
    assert (g.captured, g.eager_calls, g.replayed) == (2, 2, 6)


def test_other_shapes_are_other_graphs():
    g = DecodeGraphs(torch.device("cpu"), True)
    table = torch.tensor([3.0, 0.0])
    for n in (1, 2, 1, 2, 1, 2):
        assert g.run("k", (table,), _affine(table), (torch.ones(n),)).tolist() == [3.0] * n
    assert g.counts()["graphs"] == 2 and g.captured == 2


def test_a_failed_capture_runs_eagerly_from_then_on(caplog):
    class Refuses(HostGraph):
        def capture(self, step, inputs):
            raise RuntimeError("operation not permitted when stream is capturing")

    g = DecodeGraphs(torch.device("cpu"), True, graph=Refuses)
    table = torch.tensor([2.0, 0.0])
    outs = [g.run(("fetch", 3), (table,), _affine(table), (torch.full((1,), float(i)),)).item() for i in range(5)]
    assert outs == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert g.counts() == {"on": 1, "graphs": 0, "captured": 0, "replayed": 0, "eager": 5, "failed": 1}
    assert "('fetch', 3)" in caplog.text and "not captured" in caplog.text


def test_disabled_always_runs_eagerly():
    g = DecodeGraphs(torch.device("cpu"), False)
    table = torch.tensor([1.0, 1.0])
    for _ in range(3):
        g.run("k", (table,), _affine(table), (torch.ones(1),))
    assert g.counts()["graphs"] == 0 and g.replayed == 0


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(DecodeGraphs, "MAX_GRAPHS", 3)
    g = DecodeGraphs(torch.device("cpu"), True)
    table = torch.tensor([1.0, 0.0])
    for key in range(10):
        for _ in range(2):
            g.run(key, (table,), _affine(table), (torch.ones(1),))
    assert len(g._entries) == 3


def test_config_key():
    assert parse_config(None).gpu.decode_graphs is True
    assert parse_config({"tiers": {"gpu": {"decode_graphs": False}}}).gpu.decode_graphs is False
    with pytest.raises(ValueError, match="tiers.gpu.decode_graphs"):
        parse_config({"tiers": {"gpu": {"decode_graphs": 1}}})
    assert parse_config(None).gpu.prefill_graphs is True
    assert parse_config({"tiers": {"gpu": {"prefill_graphs": False}}}).gpu.prefill_graphs is False
    with pytest.raises(ValueError, match="tiers.gpu.prefill_graphs"):
        parse_config({"tiers": {"gpu": {"prefill_graphs": "yes"}}})


# -- property test: whatever the order of keys, shapes and table rebuilds, every result is the step's
_CALLS = st.lists(st.tuples(st.integers(0, 2), st.integers(1, 3), st.sampled_from(["call", "rebuild", "rewrite"])),
                  min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(calls=_CALLS)
def test_results_always_equal_the_eager_step(calls):
    tables = {k: torch.tensor([float(k + 2), 1.0]) for k in range(3)}
    current = {}
    g = DecodeGraphs(torch.device("cpu"), True, graph=lambda: CheckedGraph(lambda: current["sig"]))
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
DIRECT_BF16 = {"tiers": {"gpu": {"fraction": 0.6, "staging_slots": 8}, "cpu": {"budget": "64MiB", "precision": "bf16"},
                         "nvme": {"precision": "bf16"}}}
REBALANCE = {"every_tokens": 2, "margin": 0.0, "significance": 0.0, "window": 2}


def _load(packed, cfg, device, graphs: bool):
    # step graphs off: these tests check the layer calls' own graphs (tests/tiers/test_step_graph.py replays whole steps)
    cfg = {"tiers": cfg["tiers"] | {"gpu": cfg["tiers"]["gpu"] | {"decode_graphs": graphs, "step_graphs": False}}}
    model = tiers.load(packed, cfg, device=device, progress=False)
    mgr = manager_of(model)
    mgr.batched_decode = True  # what a GPU does; forced on the CPU
    if device.type == "cpu":
        mgr.direct_decode = True  # the torch reference stands in for the kernel
        mgr.graphs = DecodeGraphs(device, graphs)  # HostGraph: replays by calling the step
    assert mgr.graphs.enabled == graphs
    return model, mgr


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_decode_graphs_match_eager_decode_through_rebalances(model_type, device, checkpoint_factory, packed_factory):
    """bf16 tiers, direct decode and the rebalancer swapping every two tokens: generate with decode
    graphs gives exactly the tokens and logits of generate without them (and, on CUDA, of the
    untiered model). The swaps rewrite the direct tables in place and the reserved slots keep their
    tensor, so no graph is captured twice: not after a swap, not in a second generate."""
    cfg = {"tiers": DIRECT_BF16["tiers"] | {"rebalance": REBALANCE}}
    packed = packed_factory(model_type)
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(3)).to(device)
    kw = GEN | {"max_new_tokens": 24, "min_new_tokens": 24}
    eager_model, eager_mgr = _load(packed, cfg, device, graphs=False)
    a = eager_model.generate(ids, **kw)
    model, mgr = _load(packed, cfg, device, graphs=True)
    b = model.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    for step, (la, lb) in enumerate(zip(a.logits, b.logits)):
        assert torch.equal(la, lb), f"decode step {step} differs with graphs"
    if device.type == "cuda":
        ref = AutoModelForCausalLM.from_pretrained(checkpoint_factory(model_type), dtype=torch.bfloat16).to(device).eval()
        ref.set_experts_implementation("grouped_mm")
        assert_decode_logits(ref.generate(ids, **kw), b, device)
    s = mgr.stats()
    assert s.rebalance["promoted_hot"] > 0, "the test needs swaps during decode"
    layers = len(mgr.manifest.layers)
    direct = s.direct["decode_calls"]
    assert direct > 0
    g = s.graphs
    assert g["failed"] == 0 and g["captured"] == g["graphs"] > 0
    # every decode call of every layer ran through the cache: direct layers twice (fetch, experts)
    assert g["replayed"] + g["eager"] == direct + layers * (kw["max_new_tokens"] - 1)
    assert g["replayed"] > 0.8 * (g["replayed"] + g["eager"])
    assert "decode graphs: %d layer calls replayed" % g["replayed"] in str(s) and s.as_dict()["graphs"] == g
    tables = {L: (d.starts, d.resident) for L, d in mgr._direct_layers.items()}
    mgr.reset_stats()
    c = model.generate(ids, **kw)
    assert torch.equal(b.sequences, c.sequences)  # bf16 everywhere: where an expert lives does not change its weights
    g2 = mgr.stats().graphs
    assert g2["captured"] == 0 and g2["eager"] == 0 and g2["failed"] == 0, "a second generate must replay every graph"
    for L, (starts, resident) in tables.items():
        d = mgr._direct_layers.get(L)
        assert d is None or (d.starts is starts and d.resident is resident), f"layer {L}'s tables were replaced, not rewritten"
    eager_mgr.close()
    mgr.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_step_that_syncs_falls_back_to_eager_on_cuda(caplog):
    """CUDA twin of the failed-capture test: a step with a host sync cannot be captured; the
    call still returns the step's result, and later calls run eagerly, with CUDA still usable."""
    dev = torch.device("cuda")
    g = DecodeGraphs(dev, True)
    table = torch.tensor([2.0, 1.0], device=dev)

    def step(x):
        scale = float(table[0].item())  # a host sync: refused while the stream is capturing
        return x * scale + table[1]

    outs = [g.run("sync", (table,), step, (torch.full((4,), float(i), device=dev),)) for i in range(4)]
    assert [o.tolist() for o in outs] == [[2.0 * i + 1.0] * 4 for i in range(4)]
    assert g.counts()["failed"] == 1 and g.counts()["graphs"] == 0 and g.counts()["eager"] == 4
    assert "not captured" in caplog.text
    good = DecodeGraphs(dev, True)  # graphs still capture and replay after the failure
    outs = [good.run("ok", (table,), _affine(table), (torch.full((4,), float(i), device=dev),)) for i in range(3)]
    assert outs[2].tolist() == [5.0] * 4 and good.counts()["replayed"] == 2
