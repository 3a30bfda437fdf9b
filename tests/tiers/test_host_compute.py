"""Host compute (``tiers.cpu.compute``): a decode token's warm misses computed on the host's cores
beside the copy engine. The split is a pure function (checked exhaustively on small cases and
against its bound on random ones); an expert's host forward is checked against the experts
module's own; end to end, decode with the host's share must stay within the stated bounds of the
untiered model (SQNR against bf16 for a bf16 warm tier, the INT8 bounds for INT8), and must
really have computed misses on the host and moved fewer bytes.

On the CPU the decode switch is forced on (``batched_decode``), as a GPU runs it.
"""
from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import tiers
from tiers.loader.layout import ExpertKey, find_experts_modules
from tiers import host_compute
from tiers.config import parse_config
from tiers.host_compute import COPY_BYTES_PER_S, expert_forward, split
from tiers.integration import manager_of
from tiers.residency import Home

from test_end_to_end import GEN, INT8_KL_MAX, INT8_LAYER_SQNR_DB, INT8_LOGIT_MEDIAN_SQNR_DB, prompt, reference

# a few experts hot per layer, the rest warm: one token's two picks often miss
HOST_INT8 = {"tiers": {"gpu": {"fraction": 0.5, "staging_slots": 4}, "cpu": {"budget": "64MiB", "precision": "int8", "compute": True},
                       "nvme": {"precision": "int8"}}}
HOST_BF16 = {"tiers": {"gpu": {"fraction": 0.5, "staging_slots": 4}, "cpu": {"budget": "64MiB", "precision": "bf16", "compute": True},
                       "nvme": {"precision": "bf16"}}}


def _finish_times(sizes, chosen, busy, host_rate, copy_rate=COPY_BYTES_PER_S):
    host = sum(s for s, c in zip(sizes, chosen) if c) / host_rate
    copy = busy + sum(s for s, c in zip(sizes, chosen) if not c) / copy_rate
    return host, copy


def test_split_ties_go_to_the_copy_engine():
    mb = 100 << 20
    assert split([mb], 0.0, COPY_BYTES_PER_S) == [False]  # alone: the copy also caches it
    assert split([mb, mb], 0.0, COPY_BYTES_PER_S) == [False, True]  # the second waits for the first's copy
    assert split([mb, mb], 0.0, COPY_BYTES_PER_S / 10) == [False, False]  # a slow host gets nothing
    assert split([mb, mb], 0.0, COPY_BYTES_PER_S * 10) == [True, True]  # a fast one everything
    assert split([mb], 1.0, COPY_BYTES_PER_S / 10) == [True]  # the copy engine busy with a cold miss


def test_split_takes_the_largest_first_and_never_ends_later_than_copying_all():
    rng = random.Random(0)
    for _ in range(500):
        sizes = [rng.randint(1, 400) << 20 for _ in range(rng.randint(0, 8))]
        busy = rng.choice([0.0, rng.random() * 0.02])
        rate = COPY_BYTES_PER_S * rng.choice([0.05, 0.5, 0.9, 1.0, 1.5, 4.0])
        chosen = split(sizes, busy, rate)
        host, copy = _finish_times(sizes, chosen, busy, rate)
        all_copy = busy + sum(sizes) / COPY_BYTES_PER_S
        assert max(host, copy) <= all_copy * (1 + 1e-12)
        # the greedy rule, replayed: largest first, each where it is done sooner (ties: copy)
        h, c = 0.0, busy
        for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
            on_host = h + sizes[i] / rate < c + sizes[i] / COPY_BYTES_PER_S
            assert chosen[i] == on_host
            h, c = (h + sizes[i] / rate, c) if on_host else (h, c + sizes[i] / COPY_BYTES_PER_S)


def test_split_is_optimal_on_equal_experts():
    """With equal experts the greedy split's finish is the best of every assignment."""
    for n, ratio, busy in itertools.product(range(1, 7), (0.3, 0.8, 1.0, 1.3, 3.0), (0.0, 0.004)):
        sizes = [64 << 20] * n
        rate = COPY_BYTES_PER_S * ratio
        best = min(max(*_finish_times(sizes, c, busy, rate)) for c in itertools.product((False, True), repeat=n))
        got = max(*_finish_times(sizes, split(sizes, busy, rate), busy, rate))
        assert got <= best * (1 + 1e-12)


# One token through one INT8 expert measures 34.8-41 dB against bf16 (the dequantize-then-GEMV
# path the GPU runs: 34.3-41 dB on the same experts); over every expert of a model 38.1-38.7 dB.
INT8_ONE_EXPERT_SQNR_DB = 32.0


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_expert_forward_is_the_modules_forward(model_type, checkpoint_factory, packed_factory):
    """One token through each expert from its packed blob, against the experts module's own
    forward in bf16: bf16 views within bf16 rounding (40 dB each); INT8 views at least
    ``INT8_ONE_EXPERT_SQNR_DB`` each and the INT8 layer bound over all of them together."""
    from tiers.loader.packed import read_manifest

    from tiers import quant

    ref = reference(checkpoint_factory(model_type), torch.device("cpu"))
    manifest = read_manifest(packed_factory(model_type))
    g = torch.Generator().manual_seed(5)
    outs = {"bf16": ([], []), "int8": ([], [])}
    for layer, (name, mod) in find_experts_modules(ref).items():
        x = torch.randn(1, mod.hidden_dim, generator=g).to(torch.bfloat16)
        for e in range(mod.num_experts):
            idx, w = torch.tensor([[e]]), torch.ones(1, 1, dtype=torch.bfloat16)
            with torch.no_grad():
                want = mod(x, idx, w).float()
            for precision, floor in (("bf16", 40.0), ("int8", INT8_ONE_EXPERT_SQNR_DB)):
                key = ExpertKey(layer, e)
                scheme = quant.get_scheme(precision)
                views = {n: scheme.prepare(q) for n, q in manifest.blob(key, precision).views(_raw_blob(manifest, key, precision)).items()}
                with torch.no_grad():
                    got = expert_forward(mod, x, views).float()
                assert _sqnr(want, got) >= floor, f"{model_type} layer {layer} expert {e} {precision}: SQNR {_sqnr(want, got):.1f} dB"
                outs[precision][0].append(want)
                outs[precision][1].append(got)
    want, got = (torch.cat(t) for t in outs["int8"])
    assert _sqnr(want, got) >= INT8_LAYER_SQNR_DB, f"{model_type}: every expert's INT8 output together at {_sqnr(want, got):.1f} dB"


def _sqnr(want: torch.Tensor, got: torch.Tensor) -> float:
    return 10 * torch.log10(want.pow(2).sum() / (want - got).pow(2).sum().clamp_min(1e-30)).item()


def _raw_blob(manifest, key, precision) -> torch.Tensor:
    """``key``'s blob bytes as they lie in the packed file."""
    ref = manifest.ref(key, precision)
    with open(manifest.root / ref.file, "rb") as f:
        f.seek(ref.offset)
        return torch.frombuffer(bytearray(f.read(ref.nbytes)), dtype=torch.uint8)


def _load(packed, cfg, device):
    model = tiers.load(packed, cfg, device=device, progress=False)
    mgr = manager_of(model)
    mgr.batched_decode = True  # what a GPU does; forced on the CPU
    return model, mgr


def _decode_logits_within(a, b, floor_db: float, kl_max: float | None = None):
    la = torch.stack(a.logits).float()  # [steps, B, V]
    lb = torch.stack(b.logits).float()
    per_token = 10 * torch.log10(la.pow(2).sum(-1) / (la - lb).pow(2).sum(-1).clamp_min(1e-30))
    assert per_token.median().item() >= floor_db, f"median decode logit SQNR {per_token.median():.1f} dB"
    if kl_max is not None:
        kl = F.kl_div(F.log_softmax(lb, -1), F.log_softmax(la, -1), log_target=True, reduction="none").sum(-1).mean().item()
        assert kl <= kl_max, f"KL {kl:.2e} per token above {kl_max}"


@pytest.mark.parametrize("model_type,cfg,floor,kl", [("mixtral", HOST_INT8, INT8_LOGIT_MEDIAN_SQNR_DB, INT8_KL_MAX),
                                                     ("qwen3_moe", HOST_INT8, INT8_LOGIT_MEDIAN_SQNR_DB, INT8_KL_MAX),
                                                     ("mixtral", HOST_BF16, 40.0, None)])
def test_decode_with_host_compute_within_bounds(model_type, cfg, floor, kl, device, checkpoint_factory, packed_factory, monkeypatch):
    """Every warm miss of a decode token goes to the host (the split forced): the logits stay
    within the bounds of the untiered model, the host computed misses, and no decode call
    copied a warm expert up."""
    ref = reference(checkpoint_factory(model_type), device)
    ref.set_experts_implementation("grouped_mm")
    model, mgr = _load(packed_factory(model_type), cfg, device)
    monkeypatch.setattr("tiers.host_compute.split", lambda sizes, busy, rate: [True] * len(sizes))
    ids = prompt(device, batch=1, length=10)
    a = ref.generate(ids, **GEN)
    with torch.no_grad():
        model(ids)  # the prefill's misses land in staging slots; the decode's below stay on the host
    staged = []
    stage = mgr._stage


    def spy_stage(key, pool, slot, precision, source, *r, **kw):
        if mgr.decoding:
            staged.append((key, source))
        return stage(key, pool, slot, precision, source, *r, **kw)
    monkeypatch.setattr(mgr, "_stage", spy_stage)
    decoding = []
    enter = model._optimize_model_for_decode

    def spy():
        decoding.append(True)
        return enter()
    monkeypatch.setattr(model, "_optimize_model_for_decode", spy)
    b = model.generate(ids, **GEN)
    s = tiers.stats(model)
    assert decoding, "generate's decode stage was not entered"
    assert s.host_compute["on"] == 1 and s.host_compute["experts"] > 0, s.host_compute
    assert s.host_compute["bytes"] > 0 and s.host_compute["seconds"] > 0
    assert s.hits["cpu"] >= s.host_compute["experts"]
    assert not [k for k, source in staged if source == "cpu"], f"decode copied warm experts up: {staged}"
    _decode_logits_within(a, b, floor, kl)
    assert torch.equal(a.sequences[:, : ids.shape[1] + 1], b.sequences[:, : ids.shape[1] + 1])
    mgr.close()


def test_host_compute_moves_fewer_bytes_than_copying(device, checkpoint_factory, packed_factory):
    """The same routing (one prompt, greedy) with and without the host's share: with it on, the
    decode's copied bytes fall, and every pick is still one lookup."""
    packed = packed_factory("mixtral")
    ids = prompt(device, batch=1, length=10)
    rows = {}
    for on in (False, True):
        cfg = {"tiers": {**HOST_INT8["tiers"], "cpu": {**HOST_INT8["tiers"]["cpu"], "compute": on}}}
        model, mgr = _load(packed, cfg, device)
        with torch.no_grad():
            model(ids)
        mgr.reset_stats()
        out = model.generate(ids, **{**GEN, "output_logits": False, "return_dict_in_generate": False})
        rows[on] = (tiers.stats(model), out)
        mgr.close()
    off, on = rows[False][0], rows[True][0]
    assert on.host_compute["experts"] > 0 and off.host_compute == {"on": 0}
    assert sum(on.bytes_moved.values()) < sum(off.bytes_moved.values())
    assert sum(on.hits.values()) == sum(off.hits.values()), "every pick is one lookup either way"


def test_host_rate_is_measured(device, packed_factory, monkeypatch):
    model, mgr = _load(packed_factory("mixtral"), HOST_INT8, device)
    monkeypatch.setattr("tiers.host_compute.split", lambda sizes, busy, rate: [True] * len(sizes))
    ids = prompt(device, batch=1, length=10)
    model.generate(ids, **{**GEN, "output_logits": False, "return_dict_in_generate": False})
    hc = mgr.host_compute
    assert hc is not None and hc.measured >= 2 and hc.experts >= hc.measured
    assert hc.rate != COPY_BYTES_PER_S, "the running estimate never took a measured rate"
    assert tiers.stats(model).host_compute["rate_gbps"] == pytest.approx(hc.rate / 1e9)
    mgr.close()


def test_host_picks_are_warm_misses_only(device, packed_factory, monkeypatch):
    model, mgr = _load(packed_factory("mixtral"), HOST_INT8, device)
    monkeypatch.setattr("tiers.host_compute.split", lambda sizes, busy, rate: [True] * len(sizes))
    mgr.decoding = True
    mgr.host_compute_for(torch.zeros(1, model.config.hidden_size, dtype=torch.bfloat16, device=device), 2)
    for layer in mgr.manifest.layers:
        picks = list(range(model.config.num_local_experts))
        got = mgr.host_picks(layer, picks)
        want = [e for e in picks if mgr.table[ExpertKey(layer, e)].home is Home.CPU and mgr.table[ExpertKey(layer, e)].slot is None]
        assert got == want and want, f"layer {layer}"
    mgr.decoding = False
    assert mgr.host_compute_for(torch.zeros(1, model.config.hidden_size, dtype=torch.bfloat16, device=device), 2) is None
    mgr.close()


def test_unsupported_experts_are_named():
    assert host_compute.supported(SimpleNamespace(is_transposed=True)) is not None
    assert "biases" in host_compute.supported(SimpleNamespace(is_transposed=False, has_bias=True))
    assert host_compute.supported(SimpleNamespace(is_transposed=False, has_bias=False, has_post_expert_norm=False)) is None


def test_load_refuses_experts_the_host_cannot_compute(packed_factory, monkeypatch):
    monkeypatch.setattr(host_compute, "supported", lambda mod: "its experts have biases")
    with pytest.raises(ValueError, match=r"tiers.cpu.compute: the host cannot compute layer 0's experts .*biases"):
        tiers.load(packed_factory("mixtral"), HOST_INT8, device="cpu", progress=False)


@pytest.mark.parametrize("cpu,gpu,match", [
    ({"precision": "bnb8", "compute": True}, {}, r"tiers.cpu.compute: the host computes bf16 or int8"),
    ({"compute": True}, {"compute": "eager"}, r"tiers.cpu.compute: needs tiers.gpu.compute: grouped"),
    ({"compute": "yes"}, {}, r"tiers.cpu.compute: expected true or false"),
    ({"compute": True, "compute_threads": -1}, {}, r"tiers.cpu.compute_threads: expected an integer"),
])
def test_config_errors_name_the_key(cpu, gpu, match):
    with pytest.raises(ValueError, match=match):
        parse_config({"tiers": {"cpu": cpu, "gpu": gpu}})


def test_config_defaults_off():
    c = parse_config({"tiers": {}}).cpu
    assert c.compute is False and c.compute_threads == 0
    c = parse_config({"tiers": {"cpu": {"compute": True, "compute_threads": 6}}}).cpu
    assert c.compute is True and c.compute_threads == 6


def _tiny_host():
    from tiers.host_compute import HostCompute

    return HostCompute(8, torch.bfloat16, torch.device("cpu"), 2)


def test_a_slow_estimate_is_tested_again():
    """While the estimate gives the host nothing, every ``EXPLORE_CALLS``-th call sends it its
    smallest warm miss; a call that gives it work on its own resets the count."""
    hc = _tiny_host()
    try:
        hc.rate = COPY_BYTES_PER_S / 100
        sizes = [300 << 20, 100 << 20]
        for _ in range(host_compute.EXPLORE_CALLS - 1):
            assert hc.decide(sizes, 0.0) == [False, False]
        assert hc.decide(sizes, 0.0) == [False, True] and hc.explored == 1
        assert hc.decide([], 0.0) == [] and hc.passed == 0
        hc.rate = COPY_BYTES_PER_S * 100
        assert hc.decide(sizes, 0.0) == [True, True] and hc.passed == 0
        hc.rate = COPY_BYTES_PER_S / 100
        for _ in range(host_compute.EXPLORE_CALLS - 1):
            hc.decide(sizes, 0.0)
        assert hc.decide(sizes, 0.0) == [False, True] and hc.explored == 2
    finally:
        hc.close()


def test_the_first_task_does_not_set_the_rate():
    """The worker's first task (its threads waking) is timed but left out of the estimate; later
    ones move it, and their outputs are the weighted sum of the picks'."""
    hc = _tiny_host()
    try:
        mod = SimpleNamespace(has_gate=False, act_fn=torch.relu)
        g = torch.Generator().manual_seed(0)
        views = [{n: SimpleNamespace(data={"data": torch.randn(shape, generator=g).to(torch.bfloat16)})
                  for n, shape in (("up_proj", (16, 8)), ("down_proj", (8, 16)))} for _ in range(2)]
        x = torch.randn(1, 8, generator=g).to(torch.bfloat16)
        hc.stage(x, torch.tensor([[0.25, 0.75]]))
        start = hc.rate
        first = hc.submit(mod, [(0, views[0], 1 << 20)]).result()
        assert hc.rate == start and hc.measured == 1
        acc = hc.submit(mod, [(0, views[0], 1 << 20), (1, views[1], 1 << 20)]).result()
        assert hc.rate != start and hc.measured == 2 and hc.experts == 3
        want = sum(w * expert_forward(mod, x, v).float() for w, v in zip((0.25, 0.75), views))
        assert torch.allclose(acc, want, rtol=1e-5, atol=1e-5) and torch.allclose(first, 0.25 * expert_forward(mod, x, views[0]).float())
        out = hc.finish(hc.submit(mod, [(1, views[1], 1 << 20)]), torch.ones(1, 8, dtype=torch.bfloat16))
        assert torch.equal(out, torch.ones(1, 8, dtype=torch.bfloat16) + (0.75 * expert_forward(mod, x, views[1]).float()).to(torch.bfloat16))
    finally:
        hc.close()


@pytest.mark.parametrize("n,k", [(64, 64), (37, 48), (64, 40), (5, 3), (96, 24)])
def test_int8_linear_is_right_for_every_shape(n, k):
    """INT8 on the host: torch's packed kernel where its check passes (inner sizes a multiple of
    16), the pool's codes dequantized as quant.int8 does elsewhere; right either way."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, 1, generator=g) + 0.5  # prepared: [rows, 1], fp32 as packed
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    got = host_compute._linear(x, SimpleNamespace(data={"qdata": codes, "scale": scale})).double()
    want = x.double() @ (codes.double() * scale.double()).t()
    assert torch.isfinite(got).all() and _sqnr(want, got) >= 40.0, f"[{n}, {k}]: SQNR {_sqnr(want, got):.1f} dB"
    assert host_compute.int8_kernel_ok(n, k, torch.bfloat16) == (k % 16 == 0)


def test_a_kernel_that_fails_its_check_is_not_used(monkeypatch):
    monkeypatch.setattr(host_compute, "_INT8_KERNEL_OK", {})
    calls = []

    def broken(x, codes, scale):
        calls.append(codes.shape)
        return torch.full((x.shape[0], codes.shape[0]), float("nan"), dtype=x.dtype)
    monkeypatch.setattr(torch, "_weight_int8pack_mm", broken)
    codes = torch.ones(32, 64, dtype=torch.int8)
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    y = host_compute._linear(x, SimpleNamespace(data={"qdata": codes, "scale": torch.full((32, 1), 0.5)}))
    assert calls == [(32, 64)], "checked once, then never called"
    assert torch.equal(y, torch.full((1, 32), 32.0, dtype=torch.bfloat16))
    host_compute._linear(x, SimpleNamespace(data={"qdata": codes, "scale": torch.full((32, 1), 0.5)}))
    assert len(calls) == 1
