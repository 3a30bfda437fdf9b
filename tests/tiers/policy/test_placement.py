"""tiers.policy.placement: hot / warm / cold counts against a packed checkpoint, and its errors.

Expected counts are re-derived here from the raw ``manifest.json`` numbers and the accounting in
the policy module's docstring, never from the function under test.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from unittest import mock

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tiers.config import parse_config
from tiers.loader.blob import blob_layout
from tiers.loader.layout import ExpertKey
from tiers.loader.packed import read_manifest
from tiers.policy import placement
from tiers.policy.placement import plan_placement


SWEEP = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- the expectation, from manifest numbers ------------------------------------------------------


@dataclass(frozen=True)
class Facts:
    """What the accounting needs, read from manifest.json as plain JSON."""

    precisions: tuple[str, ...]
    layers: tuple[int, ...]
    experts_per_layer: int
    slot: int  # bytes of one expert at bf16
    stride: dict  # precision -> bytes one blob occupies (4 KiB aligned)
    top_k: int = 1  # experts routed per token, from the packed config.json
    nbytes: dict = dataclasses.field(default_factory=dict)  # precision -> bytes of one blob (unaligned)

    @property
    def n(self) -> int:
        return len(self.layers) * self.experts_per_layer

    @property
    def total_bf16(self) -> int:
        return self.n * self.slot

    def order(self) -> list[ExpertKey]:
        """Round-robin over layers: expert 0 of every layer, then expert 1, ..."""
        return [ExpertKey(L, e) for e in range(self.experts_per_layer) for L in self.layers]


def facts(packed) -> Facts:
    raw = json.loads((packed / "manifest.json").read_text())
    precisions = tuple(raw["precisions"])
    slots, strides, sizes, counts, sigs = set(), {}, {}, set(), set()
    for entry in raw["layers"]:
        shapes = [tuple(t["shape"]) for t in entry["layout"]["tensors"]]
        sigs.add(tuple((t["name"], tuple(t["shape"])) for t in entry["layout"]["tensors"]))
        slots.add(2 * sum(math.prod(s) for s in shapes))  # bf16: 2 bytes an element
        counts.add(entry["layout"]["num_experts"])
        for p in precisions:
            b = entry["blobs"][p]
            assert b["stride"] == -(-b["nbytes"] // 4096) * 4096 and b["stride"] % 4096 == 0
            assert strides.setdefault(p, b["stride"]) == b["stride"]
            assert sizes.setdefault(p, b["nbytes"]) == b["nbytes"]
    # the tiny models have identical MoE layers: one slot group, one size; keep the arithmetic simple
    assert len(slots) == len(counts) == len(sigs) == 1
    hf = json.loads((packed / "config.json").read_text()) if (packed / "config.json").is_file() else {}
    return Facts(precisions, tuple(sorted(e["layer"] for e in raw["layers"])), counts.pop(), slots.pop(), strides,
                 hf.get("num_experts_per_tok", 1), sizes)


@dataclass(frozen=True)
class Expected:
    hot: int = 0
    warm: int = 0
    cold: int = 0
    staging: int = 0
    transit: int = 0
    rows: int = 0  # transit rows
    gpu_budget: int = 0
    cpu_budget: int = 0
    error: str | None = None  # a regex the ValueError must match instead


def expect(f: Facts, cfg) -> Expected:
    g, c = cfg.gpu, cfg.cpu
    gpu_key = "tiers.gpu.budget" if g.size.budget is not None else "tiers.gpu.fraction"
    gpu_budget = g.size.budget if g.size.budget is not None else int(g.size.fraction * f.total_bf16)
    if g.precision not in f.precisions:
        return Expected(error=r"^tiers\.gpu\.precision: ")
    if gpu_budget >= f.total_bf16:
        hot, staging, transit, rows = f.n, 0, 0, 0
    else:
        lossy = [p for p in {c.precision, cfg.nvme.precision} if p != "bf16" and p in f.precisions]
        transit = max((f.stride[p] for p in lossy), default=0)
        # auto: two per routed expert of a token, or up to four so that half of them carries
        # AUTO_PART_BYTES up, in at most half the budget, at least one
        moved = transit or f.slot
        want = max(2 * f.top_k, min(4 * f.top_k, 2 * -(-placement.AUTO_PART_BYTES // moved)))
        # lossy blobs too large to stack: a ring of TRANSIT_RING rows (else a row per staging
        # slot), and auto wants AUTO_RING_PER_TOP_K slots per routed expert at least
        ring = any(f.nbytes[p] > placement.STACK_BYTES for p in lossy)
        if ring:
            want = max(want, placement.AUTO_RING_PER_TOP_K * f.top_k)

        def reserve(n: int) -> int:
            return n * f.slot + (min(n, placement.TRANSIT_RING) if ring else n) * transit

        if g.staging_slots != "auto":
            staging = g.staging_slots
        else:  # the most it wants that fit half the budget, at least one
            staging = max([n for n in range(1, want + 1) if reserve(n) <= gpu_budget // 2], default=1)
        rows = min(staging, placement.TRANSIT_RING) if ring else staging
        reserved = reserve(staging)
        if gpu_budget < f.slot:
            return Expected(error="^" + re.escape(f"{gpu_key}: {gpu_budget} bytes is smaller than one expert ({f.slot} bytes at bf16)"))
        if gpu_budget < reserved:
            return Expected(error="^" + re.escape(f"{gpu_key}: {gpu_budget} bytes cannot hold the {staging} staging slot(s)")
                            + f".*{reserved}")
        hot = min(f.n, (gpu_budget - reserved) // f.slot)
    rest = f.n - hot
    cpu_on = c.size.budget is not None or bool(c.size.fraction)
    if rest and cpu_on and c.precision not in f.precisions:
        return Expected(error=r"^tiers\.cpu\.precision: ")
    cstride = f.stride.get(c.precision, 0)
    cpu_budget = c.size.budget if c.size.budget is not None else int(c.size.fraction * f.n * cstride)
    if c.size.budget is not None and rest and cpu_budget < cstride:
        return Expected(error="^" + re.escape(f"tiers.cpu.budget: {cpu_budget} bytes is smaller than one expert ({cstride} bytes at {c.precision})"))
    warm = min(rest, cpu_budget // cstride) if cstride else 0
    cold = rest - warm
    if cold and cfg.nvme.precision not in f.precisions:
        return Expected(error=r"^tiers\.nvme\.precision: ")
    return Expected(hot, warm, cold, staging, transit, rows, gpu_budget, cpu_budget)


def check(f: Facts, manifest, cfg, exp: Expected) -> None:
    """The placement matches the expectation key for key, and its invariants hold."""
    assert exp.error is None
    p = plan_placement(cfg, manifest)
    assert (len(p.hot), len(p.warm), len(p.cold)) == (exp.hot, exp.warm, exp.cold)
    order = f.order()
    assert p.hot == tuple(sorted(order[: exp.hot]))
    assert p.warm == tuple(sorted(order[exp.hot : exp.hot + exp.warm]))
    assert p.cold == tuple(sorted(order[exp.hot + exp.warm :]))
    assert_partition(p, manifest)
    assert (p.gpu_budget, p.cpu_budget) == (exp.gpu_budget, exp.cpu_budget)
    assert len(p.groups) == 1
    (grp,) = p.groups
    assert grp.layers == f.layers
    assert (grp.slot_bytes, grp.hot, grp.staging, grp.transit_bytes, grp.transit_rows) == (f.slot, exp.hot, exp.staging, exp.transit, exp.rows)
    assert p.gpu_bytes == (exp.hot + exp.staging) * f.slot + exp.rows * exp.transit
    assert p.gpu_bytes <= p.gpu_budget
    assert len(p.warm) * f.stride.get(cfg.cpu.precision, 0) <= p.cpu_budget


def assert_partition(p, manifest) -> None:
    keys = manifest.keys
    hot, warm, cold = set(p.hot), set(p.warm), set(p.cold)
    assert len(hot) == len(p.hot) and len(warm) == len(p.warm) and len(cold) == len(p.cold)  # no duplicates
    assert not (hot & warm) and not (hot & cold) and not (warm & cold)
    assert hot | warm | cold == set(keys)
    assert len(p.hot) + len(p.warm) + len(p.cold) == len(keys)


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def packed(packed_factory):
    return packed_factory("mixtral")


@pytest.fixture(scope="module")
def manifest(packed):
    return read_manifest(packed)


@pytest.fixture(scope="module")
def f(packed) -> Facts:
    return facts(packed)


def test_tiny_mixtral_facts(f):
    """The fixture is what the counts below assume: 3 layers x 8 experts, int8 blobs smaller than bf16."""
    assert (f.layers, f.experts_per_layer, f.n) == ((0, 1, 2), 8, 24)
    assert f.precisions == ("bf16", "int8")
    assert f.stride["int8"] < f.slot <= f.stride["bf16"]


# -- counts ------------------------------------------------------------------------------------------


def test_minimal_yaml_counts(f, manifest):
    """gpu 0.25 / cpu 0.5 int8 / nvme int8: every tier holds experts."""
    cfg = parse_config({"tiers": {"gpu": {"fraction": 0.25, "staging_slots": 2}, "cpu": {"fraction": 0.5, "precision": "int8"},
                                  "nvme": {"precision": "int8"}}})
    gpu_budget = int(0.25 * 24 * f.slot)
    reserved = 2 * (f.slot + f.stride["int8"])
    hot = (gpu_budget - reserved) // f.slot
    warm = min(24 - hot, int(0.5 * 24 * f.stride["int8"]) // f.stride["int8"])
    exp = Expected(hot, warm, 24 - hot - warm, 2, f.stride["int8"], 2, gpu_budget, int(0.5 * 24 * f.stride["int8"]))
    assert exp == expect(f, cfg)
    assert hot > 0 and warm > 0 and exp.cold > 0
    check(f, manifest, cfg, exp)


def test_defaults_equal_minimal_yaml(f, manifest):
    a = plan_placement(parse_config(None), manifest)
    b = plan_placement(parse_config({"tiers": {"gpu": {"fraction": 0.25}, "cpu": {"fraction": 0.5}}}), manifest)
    assert a == b
    check(f, manifest, parse_config(None), expect(f, parse_config(None)))


@pytest.mark.parametrize("cpu", [{"fraction": 0}, {"fraction": 0.0, "precision": "bf16"}])
def test_gpu_fraction_one_is_all_hot_without_staging(f, manifest, cpu):
    cfg = parse_config({"tiers": {"gpu": {"fraction": 1.0, "staging_slots": 5}, "cpu": cpu}})
    p = plan_placement(cfg, manifest)
    assert len(p.hot) == 24 and p.warm == () and p.cold == ()
    assert p.hot == tuple(sorted(manifest.keys))
    assert [(g.hot, g.staging, g.transit_bytes) for g in p.groups] == [(24, 0, 0)]
    assert p.gpu_bytes == p.gpu_budget == 24 * f.slot
    check(f, manifest, cfg, Expected(24, 0, 0, 0, 0, 0, 24 * f.slot, 0))


def test_cpu_fraction_zero_means_no_warm(f, manifest):
    cfg = parse_config({"tiers": {"gpu": {"fraction": 0.5, "staging_slots": 2}, "cpu": {"fraction": 0}}})
    gpu_budget = int(0.5 * 24 * f.slot)
    hot = (gpu_budget - 2 * (f.slot + f.stride["int8"])) // f.slot
    exp = Expected(hot, 0, 24 - hot, 2, f.stride["int8"], 2, gpu_budget, 0)
    assert exp == expect(f, cfg)
    check(f, manifest, cfg, exp)


@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize("extra", [0, 1, 4095])
@pytest.mark.parametrize("hot", [0, 1, 5, 13])
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_gpu_budget_in_bytes(f, manifest, hot, slots, extra, large, monkeypatch):
    """``large``: the int8 blobs count as too large to stack, so at most two transit rows are kept."""
    if large:
        monkeypatch.setattr(placement, "STACK_BYTES", f.nbytes["int8"] - 1)
    rows = min(slots, 2) if large else slots
    reserved = slots * f.slot + rows * f.stride["int8"]
    budget = reserved + hot * f.slot + extra
    cfg = parse_config({"tiers": {"gpu": {"budget": budget, "staging_slots": slots}, "cpu": {"fraction": 0.25}}})
    exp = expect(f, cfg)
    assert exp.hot == hot and exp.staging == slots and exp.rows == rows
    check(f, manifest, cfg, exp)


@pytest.mark.parametrize("budget, all_hot", [("1MiB", True), ("884736", True), (24 * 36864 - 1, False), ("200KiB", False)])
def test_gpu_budget_strings_and_the_all_hot_edge(f, manifest, budget, all_hot):
    assert f.slot == 36864, "the literals above assume 36864-byte experts"
    cfg = parse_config({"tiers": {"gpu": {"budget": budget}, "cpu": {"fraction": 0.5}}})
    exp = expect(f, cfg)
    assert (exp.hot == 24) is all_hot and (exp.staging == 0) is all_hot
    check(f, manifest, cfg, exp)


@pytest.mark.parametrize("warm", [1, 7, 20])
@pytest.mark.parametrize("extra", [0, 4095])
def test_cpu_budget_in_bytes(f, manifest, warm, extra):
    cfg = parse_config({"tiers": {"gpu": {"fraction": 0.2}, "cpu": {"budget": warm * f.stride["int8"] + extra}}})
    exp = expect(f, cfg)
    assert exp.warm == min(warm, 24 - exp.hot)
    check(f, manifest, cfg, exp)


def test_cpu_fraction_is_of_blob_strides_at_cpu_precision(f, manifest):
    """Same fraction, different cpu precision: the pool is sized against that precision's strides."""
    for prec in ("int8", "bf16"):
        cfg = parse_config({"tiers": {"gpu": {"fraction": 0.2}, "cpu": {"fraction": 0.3, "precision": prec}}})
        p = plan_placement(cfg, manifest)
        assert p.cpu_budget == int(0.3 * 24 * f.stride[prec])
        check(f, manifest, cfg, expect(f, cfg))


def test_transit_is_the_largest_lossy_blob(f, manifest):
    """cpu int8 + nvme bnb8: each staging slot reserves a transit buffer of the larger lossy stride.

    The pack gains bnb8 blob layouts in memory, and references to them (packing bnb8 for real is slow
    and placement reads only layouts and which one each reference uses).
    """
    layers = {L: dataclasses.replace(e, blobs={**e.blobs, "bnb8": blob_layout(e.layout, "bnb8")},
                                     experts=tuple({**x, "bnb8": x["int8"]} for x in e.experts))
              for L, e in manifest.layers.items()}
    m3 = dataclasses.replace(manifest, precisions=manifest.precisions + ("bnb8",), layers=layers)
    bnb8 = {e.blobs["bnb8"].stride for e in layers.values()}
    assert len(bnb8) == 1
    bnb8_bytes = {e.blobs["bnb8"].nbytes for e in layers.values()}
    f3 = dataclasses.replace(f, precisions=m3.precisions, stride={**f.stride, "bnb8": bnb8.pop()}, nbytes={**f.nbytes, "bnb8": bnb8_bytes.pop()})
    assert f3.stride["bnb8"] % 4096 == 0 and f3.stride["bnb8"] != f3.stride["int8"]
    for cpu, nvme in [("int8", "bnb8"), ("bnb8", "int8"), ("int8", "int8"), ("bf16", "bf16"), ("bf16", "bnb8")]:
        cfg = parse_config({"tiers": {"gpu": {"fraction": 0.3}, "cpu": {"fraction": 0.3, "precision": cpu},
                                      "nvme": {"precision": nvme}}})
        exp = expect(f3, cfg)
        lossy = [f3.stride[q] for q in (cpu, nvme) if q != "bf16"]
        assert exp.transit == max(lossy, default=0)
        check(f3, m3, cfg, exp)


def test_round_robin_gives_layers_equal_shares(manifest):
    for frac in (0.25, 0.4, 0.6, 0.8):
        p = plan_placement(parse_config({"tiers": {"gpu": {"fraction": frac}, "cpu": {"fraction": 0.2}}}), manifest)
        per_layer = [sum(1 for k in p.hot if k.layer == L) for L in (0, 1, 2)]
        assert max(per_layer) - min(per_layer) <= 1 and sum(per_layer) == len(p.hot)


def test_routing_prior_orders_hot_first_and_a_routing_file_overrides_it(manifest):
    """The manifest's routing prior (counts per layer, as a routing file's) ranks by each expert's
    share of its layer's lookups: 0.9, 0.8 and 0.7 here, the rest 0.3 at most. Counts passed to
    the load (a routing file) rank instead of the prior."""
    counts = {L: [0.0] * 8 for L in (0, 1, 2)}
    counts[2][7], counts[2][0] = 9.0, 1.0
    counts[0][5], counts[0][1] = 8.0, 2.0
    counts[1][3], counts[1][2] = 7.0, 3.0
    m = dataclasses.replace(manifest, routing_prior=counts)
    cfg = parse_config({"tiers": {"gpu": {"budget": 3 * 36864 + 2 * (36864 + 20480), "staging_slots": 2}, "cpu": {"fraction": 0.1}}})
    assert plan_placement(cfg, m).hot == (ExpertKey(0, 5), ExpertKey(1, 3), ExpertKey(2, 7))
    file_counts = {L: [1.0] * 8 for L in (0, 1, 2)}
    file_counts[1][6] = 100.0
    assert ExpertKey(1, 6) in plan_placement(cfg, m, file_counts).hot
    assert ExpertKey(1, 6) not in plan_placement(cfg, m).hot


def test_counts_deepseek_v3_moe_layers_from_1(packed_factory):
    """first_k_dense_replace=1: the MoE layers are 1..3, and the same accounting holds."""
    packed = packed_factory("deepseek_v3")
    fm, m = facts(packed), read_manifest(packed)
    assert fm.layers == (1, 2, 3)
    for doc in ({}, {"tiers": {"gpu": {"fraction": 0.5}, "cpu": {"fraction": 0.25}}}, {"tiers": {"gpu": {"fraction": 1}, "cpu": {"fraction": 0}}}):
        cfg = parse_config(doc)
        check(fm, m, cfg, expect(fm, cfg))


# -- sweep -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("large", [False, True])
@SWEEP
@given(data=st.data())
def test_sweep_budget_bound_partition_and_counts(f, manifest, large, data):
    """Any sizes: either the expected ValueError (naming a tiers. key) or the expected counts, within
    budget; with lossy blobs small enough to stack, or (``large``) not, so their transit rows are a
    ring of at most two."""
    with mock.patch.object(placement, "STACK_BYTES", f.nbytes["int8"] - 1 if large else placement.STACK_BYTES):
        sweep_once(f, manifest, data)


def sweep_once(f, manifest, data):
    total, total_cpu = f.total_bf16, f.n * f.stride["int8"]

    def sizes(unit: int, top: int):
        """Any byte count up to top, or one near a multiple of an expert's bytes (where counts change)."""
        return st.one_of(st.integers(1, top), st.builds(lambda k, r: max(1, k * unit + r), st.integers(0, 26), st.integers(-2, 2)),
                         st.builds(lambda k, r: k * unit + r, st.integers(1, 26), st.integers(0, unit - 1)))

    gpu = data.draw(st.one_of(
        st.builds(lambda x: {"fraction": x}, st.one_of(st.floats(0, 1), st.sampled_from([0, 1, 0.25, 0.5]))),
        st.builds(lambda b: {"budget": b}, sizes(f.slot, total + 2 * f.slot)),
    ), label="gpu")
    gpu["staging_slots"] = data.draw(st.one_of(st.integers(1, 3), st.integers(1, 12), st.just(1024)), label="slots")
    cpu = data.draw(st.one_of(
        st.builds(lambda x: {"fraction": x}, st.floats(0, 1)),
        st.builds(lambda b: {"budget": b}, sizes(f.stride["int8"], total_cpu + 2 * f.stride["int8"])),
    ), label="cpu")
    cpu["precision"] = data.draw(st.sampled_from(["int8", "bf16"]), label="cpu precision")
    nvme = {"precision": data.draw(st.sampled_from(["int8", "bf16"]), label="nvme precision")}
    doc = {"tiers": {"gpu": gpu, "cpu": cpu, "nvme": nvme}}
    try:
        cfg = parse_config(doc)
    except ValueError as e:  # fractions summing above 1
        assert re.match(r"^tiers\.(gpu|cpu|nvme)", str(e)), str(e)
        event("config rejected")
        return
    exp = expect(f, cfg)
    if exp.error is not None:
        with pytest.raises(ValueError, match=exp.error) as ei:
            plan_placement(cfg, manifest)
        assert str(ei.value).startswith("tiers.")
        event("placement rejected: " + str(ei.value).split(":")[0])
        return
    event("placed" + (", all hot" if exp.hot == f.n else "") + (", warm" if exp.warm else "") + (", cold" if exp.cold else ""))
    check(f, manifest, cfg, exp)


# -- errors --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [1, 4096, "36863", "36KB"])
def test_gpu_budget_smaller_than_one_expert(f, manifest, budget):
    cfg = parse_config({"tiers": {"gpu": {"budget": budget, "staging_slots": 2}}})
    n = cfg.gpu.size.budget
    assert n < f.slot
    with pytest.raises(ValueError) as ei:
        plan_placement(cfg, manifest)
    msg = str(ei.value)
    assert msg.startswith(f"tiers.gpu.budget: {n} bytes is smaller than one expert ({f.slot} bytes at bf16)")
    assert str(2 * (f.slot + f.stride["int8"])) in msg  # and what the staging slots need


@pytest.mark.parametrize("fraction", [0, 0.0, 0.01])
def test_gpu_fraction_smaller_than_one_expert(manifest, fraction):
    cfg = parse_config({"tiers": {"gpu": {"fraction": fraction}}})
    with pytest.raises(ValueError, match=r"^tiers\.gpu\.fraction: \d+ bytes is smaller than one expert"):
        plan_placement(cfg, manifest)


@pytest.mark.parametrize("slots", [1, 2, 8])
@pytest.mark.parametrize("short", [1, 4096])
def test_gpu_budget_cannot_hold_staging_slots(f, manifest, slots, short):
    reserved = slots * (f.slot + f.stride["int8"])
    budget = max(f.slot, reserved - short)
    cfg = parse_config({"tiers": {"gpu": {"budget": budget, "staging_slots": slots}}})
    with pytest.raises(ValueError) as ei:
        plan_placement(cfg, manifest)
    msg = str(ei.value)
    assert msg.startswith(f"tiers.gpu.budget: {budget} bytes cannot hold the {slots} staging slot(s)")
    assert f"raise it to at least {reserved}" in msg and "tiers.gpu.staging_slots" in msg
    # exactly the reservation is enough: no hot experts, every miss staged
    ok = plan_placement(parse_config({"tiers": {"gpu": {"budget": reserved, "staging_slots": slots}}}), manifest)
    assert ok.hot == () and ok.gpu_bytes == reserved


def test_large_lossy_experts_keep_two_transit_rows_and_the_rest_goes_hot(f, manifest, monkeypatch):
    """Same budget and staging slots: with the int8 blobs above ``STACK_BYTES`` the pool keeps two
    transit rows instead of one per slot, and the bytes saved hold hot experts."""
    cfg = parse_config({"tiers": {"gpu": {"budget": 4 * (f.slot + f.stride["int8"]) + 5 * f.slot, "staging_slots": 4},
                                  "cpu": {"fraction": 0.5}}})
    small = plan_placement(cfg, manifest)
    monkeypatch.setattr(placement, "STACK_BYTES", f.nbytes["int8"] - 1)
    large = plan_placement(cfg, manifest)
    assert [(g.staging, g.transit_rows) for g in small.groups] == [(4, 4)]
    assert [(g.staging, g.transit_rows) for g in large.groups] == [(4, 2)]
    assert len(small.hot) == 5
    assert len(large.hot) == 5 + (2 * f.stride["int8"]) // f.slot
    assert len(large.hot) > len(small.hot)  # the fixture's int8 blobs: more than half an expert's bf16 bytes
    assert small.gpu_bytes <= small.gpu_budget and large.gpu_bytes <= large.gpu_budget
    monkeypatch.setattr(placement, "STACK_BYTES", f.nbytes["int8"])  # at the bound: still stacked
    assert [g.transit_rows for g in plan_placement(cfg, manifest).groups] == [4]


def test_gpu_fraction_cannot_hold_staging_slots(manifest):
    cfg = parse_config({"tiers": {"gpu": {"fraction": 0.1, "staging_slots": 4}, "cpu": {"fraction": 0.5}}})
    with pytest.raises(ValueError, match=r"^tiers\.gpu\.fraction: \d+ bytes cannot hold the 4 staging slot\(s\)"):
        plan_placement(cfg, manifest)


@pytest.mark.parametrize("short", [1, 4096])
def test_cpu_budget_smaller_than_one_expert(f, manifest, short):
    budget = f.stride["int8"] - short
    cfg = parse_config({"tiers": {"cpu": {"budget": budget}}})
    with pytest.raises(ValueError) as ei:
        plan_placement(cfg, manifest)
    assert str(ei.value) == f"tiers.cpu.budget: {budget} bytes is smaller than one expert ({f.stride['int8']} bytes at int8)"


def test_cpu_precision_not_packed(packed_factory):
    packed = packed_factory("mixtral", ("bf16",))
    m = read_manifest(packed)
    assert m.precisions == ("bf16",)
    cfg = parse_config({"tiers": {"cpu": {"fraction": 0.5, "precision": "int8"}, "nvme": {"precision": "bf16"}}})
    with pytest.raises(ValueError) as ei:
        plan_placement(cfg, m)
    msg = str(ei.value)
    assert msg.startswith(f"tiers.cpu.precision: precision 'int8' was not packed in {str(packed)!r} (packed: ['bf16'])")
    # the defaults ask for int8 on the cpu tier too
    with pytest.raises(ValueError, match=r"^tiers\.cpu\.precision: .*\(packed: \['bf16'\]\)"):
        plan_placement(parse_config(None), m)


@pytest.mark.parametrize("nvme", ["bf16", "int8"])
def test_a_cpu_tier_of_nothing_holds_nothing_even_at_a_precision_not_packed(packed_factory, nvme):
    """cpu fraction 0 with the default cpu precision (int8) on a bf16-only pack: no warm expert (each
    used to cost 0 bytes there, so all "fit" and the manager failed with a KeyError); the rest is cold."""
    m = read_manifest(packed_factory("mixtral", ("bf16",)))
    cfg = parse_config({"tiers": {"gpu": {"fraction": 0.25}, "cpu": {"fraction": 0}, "nvme": {"precision": nvme}}})
    if nvme == "int8":
        with pytest.raises(ValueError, match=r"^tiers\.nvme\.precision: precision 'int8' was not packed"):
            plan_placement(cfg, m)
        return
    p = plan_placement(cfg, m)
    assert p.hot and not p.warm and len(p.hot) + len(p.cold) == len(m.keys)


@pytest.mark.parametrize("tier", ["gpu", "nvme"])
def test_other_precisions_not_packed(packed_factory, tier):
    m = read_manifest(packed_factory("mixtral", ("bf16",)))
    tiers = {"gpu": {"fraction": 0.25}, "cpu": {"fraction": 0.25, "precision": "bf16"}, "nvme": {"precision": "bf16"}}
    tiers[tier]["precision"] = "int8"
    with pytest.raises(ValueError, match=rf"^tiers\.{tier}\.precision: precision 'int8' was not packed .*\(packed: \['bf16'\]\)"):
        plan_placement(parse_config({"tiers": tiers}), m)


def test_bf16_only_pack_with_bf16_tiers(packed_factory):
    packed = packed_factory("mixtral", ("bf16",))
    fb, m = facts(packed), read_manifest(packed)
    cfg = parse_config({"tiers": {"cpu": {"fraction": 0.5, "precision": "bf16"}, "nvme": {"precision": "bf16"}}})
    exp = expect(fb, cfg)
    assert exp.transit == 0 and exp.cold > 0
    check(fb, m, cfg, exp)


# -- staging slots: auto ------------------------------------------------------------------------------


@pytest.mark.parametrize("part_bytes,fraction,want", [(None, 0.25, 1), (None, 0.5, 3), (None, 0.75, 5), (None, 0.95, 7),
                                                      ("2 experts", 0.95, 4), ("3 experts", 0.95, 6)])
def test_auto_staging_is_two_per_routed_expert_in_at_most_half_the_budget(f, manifest, fraction, want, part_bytes, monkeypatch):
    """top-2 model: auto wants 4 staging slots, or up to 8 so that a half carries
    ``AUTO_PART_BYTES`` of transfer (these experts are far smaller: 8), takes at most half the
    budget, at least one."""
    assert f.top_k == 2
    if part_bytes is not None:  # a part of that many INT8 blobs: 4 slots for 2, 6 for 3
        monkeypatch.setattr(placement, "AUTO_PART_BYTES", int(part_bytes.split()[0]) * f.stride["int8"])
    cfg = parse_config({"tiers": {"gpu": {"fraction": fraction}}})
    assert cfg.gpu.staging_slots == "auto"
    budget = int(fraction * 24 * f.slot)
    wanted = {None: 8, "2 experts": 4, "3 experts": 6}[part_bytes]
    assert want == max(1, min(wanted, budget // (f.slot + f.stride["int8"]) // 2))  # the rule, spelled out for these cases
    assert plan_placement(cfg, manifest).groups[0].staging == want
    check(f, manifest, cfg, expect(f, cfg))


@pytest.mark.parametrize("fraction,want", [(0.25, 1), (0.5, 4), (0.75, 6), (0.95, 6)])
def test_auto_staging_is_three_per_routed_expert_where_experts_are_too_large_to_stack(f, manifest, fraction, want, monkeypatch):
    """The int8 blobs counted as too large to stack (and a part's bytes asking for no more than
    the 4 slots a top-2 model gets anyway): two transit rows, and auto wants 6 staging slots, within
    half the budget counted with those two rows."""
    monkeypatch.setattr(placement, "STACK_BYTES", f.nbytes["int8"] - 1)
    monkeypatch.setattr(placement, "AUTO_PART_BYTES", 2 * f.stride["int8"])
    cfg = parse_config({"tiers": {"gpu": {"fraction": fraction}}})
    budget = int(fraction * 24 * f.slot)
    fit = max(n for n in range(1, 7) if n * f.slot + min(n, 2) * f.stride["int8"] <= budget // 2)
    assert want == fit  # the rule, spelled out for these cases
    (g,) = plan_placement(cfg, manifest).groups
    assert (g.staging, g.transit_rows) == (want, min(want, 2))
    check(f, manifest, cfg, expect(f, cfg))


def _carry(packed, text: str | None) -> None:
    """Write the packed config.json as ``text`` (None: carry none) and re-seal the manifest's record of it."""
    import zlib

    from tiers.loader.manifest_parse import checksum

    doc = json.loads((packed / "manifest.json").read_text())
    if text is None:
        (packed / "config.json").unlink()
        del doc["carried"]["config.json"]
    else:
        (packed / "config.json").write_text(text)
        doc["carried"]["config.json"] = {"crc32": zlib.crc32(text.encode()), "nbytes": len(text.encode())}
    doc["checksum"] = checksum(doc)
    (packed / "manifest.json").write_text(json.dumps(doc))


def test_auto_staging_reads_top_k_from_the_packed_config(f, manifest, tmp_path):
    import shutil

    from tiers.policy.placement import top_k

    assert top_k(manifest) == 2
    packed = tmp_path / "p"
    shutil.copytree(manifest.root, packed)
    for text, k in [("{}", 1), ('{"text_config": {"num_experts_per_tok": 8}}', 8), ("[]", 1), ('{"text_config": [8]}', 1),
                    ("[" * 5000 + "]" * 5000, 1), (None, 1)]:  # no num_experts_per_tok, or no config: one
        _carry(packed, text)
        assert top_k(read_manifest(packed)) == k, text


@pytest.mark.parametrize("change", ["edit", "fifo"])
def test_top_k_reads_only_the_checked_config(manifest, tmp_path, change):
    """A config.json that differs from the manifest's record is refused, naming it; a FIFO in its
    place is refused too, never opened to wait for a writer (a load used to hang there)."""
    import os
    import shutil

    from tiers.loader.pack_files import IntegrityError
    from tiers.policy.placement import top_k

    packed = tmp_path / "p"
    shutil.copytree(manifest.root, packed)
    if change == "edit":
        (packed / "config.json").write_text('{"num_experts_per_tok": 8}')
    else:
        (packed / "config.json").unlink()
        os.mkfifo(packed / "config.json")
    with pytest.raises(IntegrityError, match=r"carried file '.*config\.json' (differs from the manifest|is not a regular file)"):
        top_k(read_manifest(packed))
