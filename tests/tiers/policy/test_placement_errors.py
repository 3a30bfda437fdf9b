"""tiers.policy.placement: the errors a placement raises, each naming the tiers. key to change.

Expected counts are re-derived from the raw ``manifest.json`` numbers (placement_helpers.py),
never from the function under test.
"""
from __future__ import annotations

import pytest

from placement_helpers import Facts, check, expect, facts
from tiers.config import parse_config
from tiers.loader.packed import read_manifest
from tiers.policy.placement import plan_placement


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

