"""tiers.policy.placement: hot / warm / cold counts against a packed checkpoint.

Expected counts are re-derived from the raw ``manifest.json`` numbers (placement_helpers.py),
never from the function under test. Its errors are tested in test_placement_errors.py, and the
staging slots it picks on its own ("auto") in test_placement_auto.py.
"""
from __future__ import annotations

import dataclasses
import re
from unittest import mock

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from placement_helpers import Expected, Facts, check, expect, facts
from tiers.config import parse_config
from tiers.loader.blob import blob_layout
from tiers.loader.layout import ExpertKey
from tiers.loader.packed import read_manifest
from tiers.policy import placement
from tiers.policy.placement import plan_placement


SWEEP = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


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
