"""tiers.config's good values: what parses to which TiersConfig, from a dict, None or a YAML file.

load_config reads a config from a YAML file, a dict, None or a TiersConfig; a file it cannot read
(missing, not YAML, not UTF-8, a directory, a bad field) is a ValueError naming the file or the key.
Bad fields given as a dict, each a ValueError naming its dotted key: test_config.py.
"""
from __future__ import annotations

import re

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from config_helpers import FUZZ, PRECISIONS, UNITS, at, raises_for
from tiers.config import (
    CpuTier,
    GpuTier,
    NvmeTier,
    Rebalance,
    TiersConfig,
    TierSize,
    load_config,
    parse_config,
    parse_size,
    precisions_needed,
)

# The documented minimal YAML (tools/demo.py's DEMO_YAML), comments included.
MINIMAL_YAML = """\
tiers:
  gpu:  {fraction: 0.25}              # of expert bytes at bf16, staging slots included
  cpu:  {fraction: 0.5, precision: int8}
  nvme: {precision: int8}             # everything else
"""
MINIMAL = TiersConfig(
    gpu=GpuTier(size=TierSize(fraction=0.25), precision="bf16", staging_slots="auto"),
    cpu=CpuTier(size=TierSize(fraction=0.5), precision="int8"),
    nvme=NvmeTier(precision="int8"),
)


# -- good values --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, n",
    [
        ("24GiB", 24 * 2**30),
        ("512MB", 512 * 10**6),
        ("1.5GiB", 3 * 2**29),
        ("1073741824", 2**30),
        (1073741824, 2**30),
        (1, 1),
        ("100B", 100),
        ("7 kb", 7000),
        (" 3TiB ", 3 * 2**40),
        ("2tb", 2 * 10**12),
        ("0.5KiB", 512),
        ("64mib", 64 * 2**20),
    ],
)
def test_parse_size_good(text, n):
    got = parse_size(text, "k")
    assert got == n and type(got) is int


@FUZZ
@given(n=st.integers(1, 10**6), unit=st.sampled_from(list(UNITS)), case=st.sampled_from([str, str.lower, str.upper]),
       space=st.sampled_from(["", " "]))
def test_parse_size_units(n, unit, case, space):
    assert parse_size(f"{n}{space}{case(unit)}", "k") == n * UNITS[unit]


@FUZZ
@given(n=st.integers(1, 2**62))
def test_parse_size_plain_ints(n):
    assert parse_size(n, "k") == n


@pytest.mark.parametrize("tier", ["gpu", "cpu"])
@pytest.mark.parametrize("budget, n", [("24GiB", 24 * 2**30), ("512MB", 512 * 10**6), ("1.5GiB", 3 * 2**29), (4096, 4096)])
def test_budget_parses(tier, budget, n):
    cfg = parse_config({"tiers": {tier: {"budget": budget}}})
    assert getattr(cfg, tier).size == TierSize(fraction=None, budget=n)


@pytest.mark.parametrize("g, c", [(0, 0), (0, 1), (1, 0), (0.0, 1.0), (1.0, 0.0), (0.7, 0.3), (0.1, 0.9), (0.25, 0.75)])
def test_fraction_edges_parse(g, c):
    cfg = parse_config({"tiers": {"gpu": {"fraction": g}, "cpu": {"fraction": c}}})
    assert cfg.gpu.size == TierSize(fraction=float(g))
    assert cfg.cpu.size == TierSize(fraction=float(c))
    assert type(cfg.gpu.size.fraction) is float and type(cfg.cpu.size.fraction) is float


@pytest.mark.parametrize("slots", [1, 2, 7, 1024, "auto"])
def test_staging_slots_parse(slots):
    assert parse_config(at("tiers.gpu.staging_slots", slots)).gpu.staging_slots == slots


@pytest.mark.parametrize("key", ["tiers.gpu.precision", "tiers.cpu.precision", "tiers.nvme.precision"])
@pytest.mark.parametrize("p", PRECISIONS)
def test_precisions_parse(key, p):
    cfg = parse_config(at(key, p))
    tier = key.split(".")[1]
    assert getattr(cfg, tier).precision == p


def test_minimal_yaml_file(tmp_path):
    path = tmp_path / "tiers.yaml"
    path.write_text(MINIMAL_YAML)
    assert load_config(path) == MINIMAL
    assert load_config(str(path)) == MINIMAL


def test_minimal_yaml_as_dict_and_defaults():
    assert load_config(yaml.safe_load(MINIMAL_YAML)) == MINIMAL
    assert load_config({"tiers": {"gpu": {"fraction": 0.25}, "cpu": {"fraction": 0.5, "precision": "int8"},
                                  "nvme": {"precision": "int8"}}}) == MINIMAL
    assert load_config(None) == MINIMAL
    assert TiersConfig() == MINIMAL
    assert parse_config({}) == MINIMAL


def test_load_config_passes_a_config_through():
    cfg = parse_config({"tiers": {"gpu": {"budget": "1GiB", "staging_slots": 3}}})
    assert load_config(cfg) is cfg


def test_full_yaml_file(tmp_path):
    """Every key of the schema but the fractions (a budget replaces each)."""
    path = tmp_path / "full.yaml"
    path.write_text(
        "tiers:\n"
        "  gpu:\n    budget: 24GiB\n    precision: bf16\n    staging_slots: 4\n    graphs: false\n"
        "  cpu:\n    budget: 512MB\n    precision: bnb8\n"
        "  nvme:\n    precision: int8\n"
        "  rebalance:\n    every_tokens: 16\n    window: 4\n    max_moves: 2\n"
    )
    assert load_config(path) == TiersConfig(
        GpuTier(TierSize(budget=24 * 2**30), "bf16", 4, False), CpuTier(TierSize(budget=512 * 10**6), "bnb8"), NvmeTier("int8"),
        Rebalance(16, 4, 2),
    )


@pytest.mark.parametrize(
    "text, key",
    [
        ("tiers:\n  gpu: {fraction: yes}\n", "tiers.gpu.fraction"),  # YAML 1.1 bool
        ("tiers:\n  gpu: {fraction: 25%}\n", "tiers.gpu.fraction"),
        ("tiers:\n  cpu: {fraction: .inf}\n", "tiers.cpu.fraction"),
        ("tiers:\n  cpu: {fraction: .nan}\n", "tiers.cpu.fraction"),
        ("tiers:\n  gpu: {budget: 24 gigs}\n", "tiers.gpu.budget"),
        ("tiers:\n  cpu: {budget: -512MB}\n", "tiers.cpu.budget"),
        ("tiers:\n  cpu: {budget: 1.5}\n", "tiers.cpu.budget"),
        ("tiers:\n  gpu: {budget: ~}\n", "tiers.gpu.budget"),
        ("tiers:\n  gpu: {staging_slots: 2.5}\n", "tiers.gpu.staging_slots"),
        ("tiers:\n  gpu: {staging_slots: on}\n", "tiers.gpu.staging_slots"),
        ("tiers:\n  nvme: {precision: INT8}\n", "tiers.nvme.precision"),
        ("tiers:\n  gpu: {graphs: 1}\n", "tiers.gpu.graphs"),
        ("tiers:\n  gpu: {step_graphs: off}\n", "tiers.gpu.step_graphs"),
        ("tiers:\n  rebalance: {every_tokens: 8.5}\n", "tiers.rebalance.every_tokens"),
        ("tiers:\n  rebalance: {across_layers: yes}\n", "tiers.rebalance.across_layers"),
        ("tiers:\n  gpu: {bogus: 1}\n", "tiers.gpu.bogus"),
        ("tierz:\n  gpu: {fraction: 0.25}\n", "config.tierz"),
        ("tiers:\n  - gpu\n", "tiers"),
    ],
)
def test_bad_yaml_file_names_key(tmp_path, text, key):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with raises_for(key):
        load_config(path)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ValueError) as ei:
        load_config(path)
    assert str(ei.value) == f"config: file {str(path)!r} does not exist"
    with pytest.raises(ValueError, match=re.escape(repr(str(path)))):
        load_config(str(path))


@pytest.mark.parametrize("text", ["tiers:\n  gpu: {fraction: 0.25\n", "tiers: [\n", "tiers:\n\tgpu: 1\n", "a: b: c\n"])
def test_invalid_yaml_file(tmp_path, text):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as ei:
        load_config(path)
    assert str(ei.value).startswith(f"config: {str(path)!r} is not valid YAML: ")


def test_non_utf8_file_names_file(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00tiers: {gpu: {fraction: 0.25}}\n")
    with pytest.raises(ValueError, match=re.escape(repr(str(path)))):
        load_config(path)


# -- precisions_needed ----------------------------------------------------------------------


def test_precisions_needed_defaults():
    assert precisions_needed(TiersConfig()) == ["bf16", "int8"]


@FUZZ
@given(g=st.sampled_from(PRECISIONS), c=st.sampled_from(PRECISIONS), n=st.sampled_from(PRECISIONS))
def test_precisions_needed(g, c, n):
    cfg = parse_config({"tiers": {"gpu": {"precision": g}, "cpu": {"precision": c}, "nvme": {"precision": n}}})
    got = precisions_needed(cfg)
    expected = ["bf16"]
    for p in (g, c, n):
        if p not in expected:
            expected.append(p)
    assert got == expected


def test_precisions_needed_order():
    cfg = parse_config({"tiers": {"cpu": {"precision": "bnb8"}, "nvme": {"precision": "int8"}}})
    assert precisions_needed(cfg) == ["bf16", "bnb8", "int8"]
    cfg = parse_config({"tiers": {"cpu": {"precision": "bf16"}, "nvme": {"precision": "bf16"}}})
    assert precisions_needed(cfg) == ["bf16"]


def test_default_cpu_share_shrinks_to_fit_a_large_gpu_fraction():
    from tiers.config import load_config

    assert load_config({"tiers": {"gpu": {"fraction": 0.6}}}).cpu.size.fraction == pytest.approx(0.4)
    assert load_config({"tiers": {"gpu": {"fraction": 1.0}}}).cpu.size.fraction == 0.0
    assert load_config({"tiers": {"gpu": {"fraction": 0.1}}}).cpu.size.fraction == 0.5


def test_directory_as_config_is_named(tmp_path):
    from tiers.config import load_config

    with pytest.raises(ValueError, match="is a directory, expected a YAML file"):
        load_config(tmp_path)


@pytest.mark.parametrize("graphs", [True, False])
def test_graphs_switch_parses_and_defaults_on(graphs):
    """One switch for decode, prefill and step graphs (was decode_graphs, prefill_graphs, step_graphs)."""
    assert parse_config(None).gpu.graphs is True and GpuTier().graphs is True
    cfg = parse_config(at("tiers.gpu.graphs", graphs))
    assert cfg.gpu.graphs is graphs
    assert cfg == TiersConfig(gpu=GpuTier(graphs=graphs))


def test_rebalance_parses_and_defaults_off():
    assert parse_config(None).rebalance == Rebalance(every_tokens=0, window=64, max_moves=8)
    r = parse_config({"tiers": {"rebalance": {"every_tokens": 64, "window": 8, "max_moves": 2}}}).rebalance
    assert (r.every_tokens, r.window, r.max_moves) == (64, 8, 2)
    r = parse_config({"tiers": {"rebalance": {"every_tokens": 1 << 30, "window": 1024, "max_moves": 1 << 20}}}).rebalance
    assert (r.every_tokens, r.window, r.max_moves) == (1 << 30, 1024, 1 << 20)
    r = parse_config({"tiers": {"rebalance": {"every_tokens": 0, "window": 1, "max_moves": 1}}}).rebalance
    assert (r.every_tokens, r.window, r.max_moves) == (0, 1, 1)
