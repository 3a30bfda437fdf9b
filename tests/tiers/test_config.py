"""tiers.config refuses every bad field of a config with a ValueError naming its dotted key.

The schema is thirteen keys (``tiers.config.KEYS``); every key the old core read and the new one
dropped (A/B switches now constants, removed features) is refused as unknown, naming the allowed keys.
What parses, and config files: test_config_load.py."""
from __future__ import annotations

import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from config_helpers import FUZZ, PRECISIONS, UNITS, at, raises_for
from tiers.config import KEYS, TierSize, load_config, parse_config


# -- strategies for bad values ---------------------------------------------------------------

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                     st.text(max_size=12))
_junk = st.one_of(_scalars, st.lists(_scalars, max_size=3), st.dictionaries(st.text(max_size=4), _scalars, max_size=2))

bad_fraction = st.one_of(
    st.booleans(),  # YAML yes/no/true: a bool is not a number here
    st.none(),
    st.text(max_size=12),  # "25%", "0.25", ...
    st.lists(_scalars, max_size=3),
    st.dictionaries(st.text(max_size=4), _scalars, max_size=2),
    st.floats(max_value=-1e-12),  # includes -inf
    st.floats(min_value=1.0 + 1e-9, allow_infinity=True),  # includes inf
    st.just(math.nan),
    st.integers(max_value=-1),
    st.integers(min_value=2, max_value=2**70),
)

# A string that could be a valid size: digits with an optional fraction and letters. Anything else is garbage.
_SIZE_LIKE = re.compile(r"\s*[0-9]+(\.[0-9]+)?\s*[A-Za-z]*\s*")
bad_size_string = st.one_of(
    st.text(max_size=16).filter(lambda s: not _SIZE_LIKE.fullmatch(s)),
    st.builds(lambda n, u: f"{n}{u}", st.integers(1, 10**6), st.sampled_from(["XB", "gigs", "Gi", "kibs", "bytes", "PB", "PiB"])),
    st.builds(lambda n, u: f"-{n}{u}", st.integers(1, 10**6), st.sampled_from(["", "B", "MB", "GiB"])),
    st.builds(lambda n, u: f"{n}e3{u}", st.integers(1, 99), st.sampled_from(["", "B", "MB"])),
    st.sampled_from(["", " ", "GiB", "1..5GiB", ".5GiB", "1,024", "1_000", "0x10", "24 Gi B", "inf", "nan"]),
)
zero_size_string = st.one_of(  # well-formed, but rounds to 0 bytes
    st.builds(lambda u: f"0{u}", st.sampled_from(list(UNITS) + [""])),
    st.builds(lambda d: f"0.{d}B", st.integers(0, 999999)),
    st.builds(lambda d: f"0.{d}", st.integers(0, 999999)),
)
bad_budget = st.one_of(
    st.booleans(),  # True would otherwise be 1 byte
    st.none(),
    st.integers(max_value=0),  # zero and negative sizes
    st.floats(),  # a bare float is not a size; sizes with a fraction are strings ("1.5GiB")
    st.lists(_scalars, max_size=3),
    st.dictionaries(st.text(max_size=4), _scalars, max_size=2),
    bad_size_string,
    zero_size_string,
)
bad_slots = st.one_of(
    st.booleans(),
    st.none(),
    st.integers(max_value=0),
    st.integers(min_value=1025, max_value=2**70),
    st.floats(),  # 2.0 included: slots are counted, not measured
    st.text(max_size=8).filter(lambda t: t != "auto"),
    st.lists(_scalars, max_size=3),
)
bad_precision = st.one_of(
    st.text(max_size=10).filter(lambda s: s not in PRECISIONS),
    st.sampled_from(["INT8", "Int8", "bfloat16", "fp8", "int3", "NF4", " int8", "int8 "]),
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.lists(st.sampled_from(PRECISIONS), max_size=2),
)
bad_flag = st.one_of(  # true/false only: 1, "true" and None are not (a file's yes/on: tests/tiers/test_config_yaml.py)
    st.none(),
    st.integers(),
    st.floats(),
    st.text(max_size=8),
    st.lists(st.booleans(), max_size=2),
)
# tiers.rebalance's integers: (lo, hi) as documented in tiers/config.py
REBALANCE_RANGES = {"every_tokens": (0, 1 << 30), "window": (1, 1024), "max_moves": (1, 1 << 20)}


def bad_int(lo: int, hi: int):
    return st.one_of(
        st.booleans(),  # True would otherwise be 1
        st.none(),
        st.integers(max_value=lo - 1),
        st.integers(min_value=hi + 1, max_value=hi + 2**70),
        st.floats(),  # 8.0 included: counted, not measured
        st.text(max_size=8),
        st.lists(_scalars, max_size=3),
    )


# -- every field fuzzed -------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["tiers.gpu.fraction", "tiers.cpu.fraction"])
@FUZZ
@given(value=bad_fraction)
def test_bad_fraction_names_key_and_value(key, value):
    with raises_for(key) as ei:
        parse_config(at(key, value))
    assert repr(value) in str(ei.value)


@pytest.mark.parametrize("key", ["tiers.gpu.budget", "tiers.cpu.budget"])
@FUZZ
@given(value=bad_budget)
def test_bad_budget_names_key_and_value(key, value):
    with raises_for(key) as ei:
        parse_config(at(key, value))
    assert repr(value) in str(ei.value)


@FUZZ
@given(value=bad_slots)
def test_bad_staging_slots_names_key_and_value(value):
    with raises_for("tiers.gpu.staging_slots") as ei:
        parse_config(at("tiers.gpu.staging_slots", value))
    assert repr(value) in str(ei.value)


@pytest.mark.parametrize("key", ["tiers.gpu.precision", "tiers.cpu.precision", "tiers.nvme.precision"])
@FUZZ
@given(value=bad_precision)
def test_bad_precision_names_key_and_allowed(key, value):
    with raises_for(key) as ei:
        parse_config(at(key, value))
    msg = str(ei.value)
    assert repr(value) in msg
    assert str(list(PRECISIONS)) in msg  # what is allowed


@FUZZ
@given(value=bad_flag)
def test_bad_graphs_flag_names_key_and_value(value):
    with raises_for("tiers.gpu.graphs") as ei:
        parse_config(at("tiers.gpu.graphs", value))
    assert repr(value) in str(ei.value) and "true or false" in str(ei.value)


@pytest.mark.parametrize("name", list(REBALANCE_RANGES))
@FUZZ
@given(data=st.data())
def test_bad_rebalance_int_names_key_value_and_range(name, data):
    lo, hi = REBALANCE_RANGES[name]
    value = data.draw(bad_int(lo, hi))
    with raises_for(f"tiers.rebalance.{name}") as ei:
        parse_config(at(f"tiers.rebalance.{name}", value))
    assert repr(value) in str(ei.value) and f"[{lo}, {hi}]" in str(ei.value)


_ALLOWED = {
    "config": {"tiers"},
    "tiers": {"gpu", "cpu", "nvme", "rebalance", "int4", "parallel"},
    "tiers.gpu": {"fraction", "budget", "precision", "staging_slots", "graphs"},
    "tiers.cpu": {"fraction", "budget", "precision"},
    "tiers.nvme": {"precision"},
    "tiers.rebalance": {"every_tokens", "window", "max_moves"},
    "tiers.int4": {"group"},
    "tiers.parallel": {"experts"},
}
# Keys the old core read and the new one refuses: A/B switches with a measured winner (now constants),
# the three graph switches (now ``graphs``), and removed features (host compute, the eager kernels,
# lookahead prefetch, the lru/lfu/forecast cache policies). 15 in all.
REMOVED = [
    "tiers.gpu.cache", "tiers.gpu.lfu_decay", "tiers.gpu.compute", "tiers.gpu.prefetch_depth",
    "tiers.gpu.decode_graphs", "tiers.gpu.prefill_graphs", "tiers.gpu.step_graphs",
    "tiers.cpu.direct_reads", "tiers.cpu.compute", "tiers.cpu.compute_threads",
    "tiers.nvme.reader_threads", "tiers.nvme.direct_io",
    "tiers.rebalance.margin", "tiers.rebalance.significance", "tiers.rebalance.across_layers",
]
# A value each removed key took in the old schema, so only the key itself can be what is refused.
OLD_VALUES = {"cache": "markov", "lfu_decay": 0.9, "compute": "grouped", "prefetch_depth": 1, "decode_graphs": True,
              "prefill_graphs": True, "step_graphs": False, "direct_reads": True, "compute_threads": 4, "reader_threads": 2,
              "direct_io": False, "margin": 0.25, "significance": 3.0, "across_layers": False}


def test_the_schema_is_the_fourteen_documented_keys():
    """At most 15 keys in all (the schema was 34 before the rewrite); exactly the fourteen documented ones,
    and the parser accepts exactly what KEYS lists."""
    assert sum(len(v) for v in KEYS.values()) <= 15
    assert {f"tiers.{t}": set(v) for t, v in KEYS.items()} == {k: v for k, v in _ALLOWED.items() if k.startswith("tiers.")}
    assert sum(len(v) for v in KEYS.values()) == 14
    assert all(len(set(v)) == len(v) for v in KEYS.values())


@pytest.mark.parametrize("dotted", REMOVED)
def test_a_removed_key_is_refused_as_unknown(dotted):
    """Each of them given alone, with a value the old schema accepted, and beside valid keys."""
    section, name = dotted.rsplit(".", 1)
    allowed = str(sorted(_ALLOWED[section]))
    for doc in (at(dotted, OLD_VALUES[name]), at(section, {"precision": "int8", name: OLD_VALUES[name]} if section != "tiers.rebalance"
                                                       else {"every_tokens": 8, name: OLD_VALUES[name]})):
        with pytest.raises(ValueError) as ei:
            parse_config(doc)
        assert str(ei.value) == f"{dotted}: unknown key; allowed: {allowed}"
        assert name not in _ALLOWED[section]


def test_removed_keys_are_refused_from_a_yaml_file(tmp_path):
    """An old config file that names any of them fails to load, naming the first it finds."""
    path = tmp_path / "old.yaml"
    path.write_text("tiers:\n  gpu: {fraction: 0.25, decode_graphs: true}\n  rebalance: {every_tokens: 8, margin: 0.5}\n")
    with raises_for("tiers.gpu.decode_graphs") as ei:
        load_config(path)
    assert "unknown key" in str(ei.value) and str(sorted(_ALLOWED["tiers.gpu"])) in str(ei.value)


@pytest.mark.parametrize("section", list(_ALLOWED))
@FUZZ
@given(name=st.one_of(st.text(min_size=1, max_size=12), st.integers(-5, 5)), value=_junk)
def test_unknown_key_names_dotted_key(section, name, value):
    if name in _ALLOWED[section]:
        name = f"{name}_"
    doc = {name: value} if section == "config" else at(section, {name: value})
    with raises_for(f"{section}.{name}") as ei:
        parse_config(doc)
    assert str(sorted(_ALLOWED[section])) in str(ei.value)


@pytest.mark.parametrize("section", ["tiers", "tiers.gpu", "tiers.cpu", "tiers.nvme", "tiers.rebalance"])
@FUZZ
@given(value=st.one_of(st.booleans(), st.integers(), st.floats(), st.text(min_size=1, max_size=8),
                       st.lists(_scalars, min_size=1, max_size=3)))
def test_section_that_is_not_a_mapping_names_section(section, value):
    with raises_for(section) as ei:
        parse_config(at(section, value))
    assert "expected a mapping" in str(ei.value)


@FUZZ
@given(value=st.one_of(st.booleans(), st.integers(), st.text(min_size=1, max_size=8), st.lists(_scalars, min_size=1, max_size=3)))
def test_document_that_is_not_a_mapping(value):
    with raises_for("config"):
        parse_config(value)


@pytest.mark.parametrize("tier", ["gpu", "cpu"])
@FUZZ
@given(fraction=st.floats(0, 1), budget=st.one_of(st.integers(1, 2**40), st.sampled_from(["24GiB", "512MB"])))
def test_fraction_and_budget_together_rejected(tier, fraction, budget):
    with raises_for(f"tiers.{tier}") as ei:
        parse_config({"tiers": {tier: {"fraction": fraction, "budget": budget}}})
    assert "not both" in str(ei.value)


@FUZZ
@given(g=st.floats(0, 1), c=st.floats(0, 1))
def test_fractions_summing_above_one_rejected(g, c):
    doc = {"tiers": {"gpu": {"fraction": g}, "cpu": {"fraction": c}}}
    if g + c > 1.0 + 1e-6:
        with pytest.raises(ValueError, match=re.escape("tiers.gpu.fraction + tiers.cpu.fraction must be <= 1")):
            parse_config(doc)
    elif g + c <= 1.0:
        cfg = parse_config(doc)
        assert (cfg.gpu.size, cfg.cpu.size) == (TierSize(fraction=g), TierSize(fraction=c))


# -- exact messages ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "doc, message",
    [
        (at("tiers.gpu.fraction", 1.5), "tiers.gpu.fraction: must be in [0, 1], got 1.5"),
        (at("tiers.cpu.fraction", "50%"), "tiers.cpu.fraction: expected a number in [0, 1], got '50%'"),
        (at("tiers.gpu.fraction", True), "tiers.gpu.fraction: expected a number in [0, 1], got True"),
        (at("tiers.gpu.bogus", 1), "tiers.gpu.bogus: unknown key; allowed: ['budget', 'fraction', 'graphs', 'precision', 'staging_slots']"),
        ({"tierz": {}}, "config.tierz: unknown key; allowed: ['tiers']"),
        (at("tiers.ram", {}), "tiers.ram: unknown key; allowed: ['cpu', 'gpu', 'int4', 'nvme', 'parallel', 'rebalance']"),
        (at("tiers.nvme.fraction", 0.5), "tiers.nvme.fraction: unknown key; allowed: ['precision']"),
        (at("tiers.cpu.compute", True), "tiers.cpu.compute: unknown key; allowed: ['budget', 'fraction', 'precision']"),
        (at("tiers.rebalance.margin", 0.5), "tiers.rebalance.margin: unknown key; allowed: ['every_tokens', 'max_moves', 'window']"),
        (at("tiers.gpu.graphs", "yes"), "tiers.gpu.graphs: expected true or false, got 'yes'"),
        (at("tiers.rebalance.window", 0), "tiers.rebalance.window: expected an integer in [1, 1024], got 0"),
        (at("tiers.rebalance.every_tokens", -1), "tiers.rebalance.every_tokens: expected an integer in [0, 1073741824], got -1"),
        (at("tiers.rebalance.max_moves", True), "tiers.rebalance.max_moves: expected an integer in [1, 1048576], got True"),
        (at("tiers.gpu.staging_slots", 0), "tiers.gpu.staging_slots: expected an integer in [1, 1024] or auto, got 0"),
        (at("tiers.gpu.staging_slots", 2.0), "tiers.gpu.staging_slots: expected an integer in [1, 1024] or auto, got 2.0"),
        (at("tiers.cpu.precision", "fp4"), "tiers.cpu.precision: unknown precision 'fp4'; allowed: ['bf16', 'bnb8', 'int4', 'int8', 'mxfp4', 'nf4']"),
        (at("tiers.gpu.budget", -5), "tiers.gpu.budget: a budget must be positive, got -5"),
        (at("tiers.gpu.budget", "0GiB"), "tiers.gpu.budget: a budget must be positive, got '0GiB'"),
        (
            at("tiers.gpu.budget", "-1GiB"),
            "tiers.gpu.budget: expected a size such as 8GiB or 512MB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), got '-1GiB'",
        ),
        (at("tiers.cpu.budget", True), "tiers.cpu.budget: expected a size such as 8GiB or 512MB, got True"),
        (
            {"tiers": {"gpu": {"fraction": 0.25, "budget": "1GiB"}}},
            "tiers.gpu: give either fraction or budget, not both (got fraction=0.25, budget='1GiB')",
        ),
        (
            {"tiers": {"gpu": {"fraction": 0.75}, "cpu": {"fraction": 0.5}}},
            "tiers.gpu.fraction + tiers.cpu.fraction must be <= 1 (nvme holds the rest), got 0.75 + 0.5 = 1.25",
        ),
        (at("tiers.gpu", 0.25), "tiers.gpu: expected a mapping with keys ['budget', 'fraction', 'graphs', 'precision', 'staging_slots'], got float 0.25"),
        (["tiers"], "config: expected a mapping with keys ['tiers'], got list ['tiers']"),
    ],
)
def test_exact_messages(doc, message):
    with pytest.raises(ValueError) as ei:
        parse_config(doc)
    assert str(ei.value) == message


def test_load_config_rejects_other_types():
    with pytest.raises(ValueError) as ei:
        load_config(3)
    assert str(ei.value) == "config: expected a YAML path, a dict or None, got int"


@pytest.mark.parametrize("budget", ["9" * 400, "9" * 400 + "GiB", "1" * 320 + "B"], ids=["400-digits", "400-digits-GiB", "320-digits-B"])
def test_huge_size_string_is_a_value_error(budget):
    with raises_for("tiers.gpu.budget"):
        parse_config(at("tiers.gpu.budget", budget))


@pytest.mark.parametrize("key", ["tiers.gpu.fraction", "tiers.cpu.fraction"])
def test_huge_int_fraction_is_a_value_error(key):
    with raises_for(key):
        parse_config(at(key, 10**400))


@pytest.mark.parametrize("name,bad", [("every_tokens", -1), ("every_tokens", 1.5), ("every_tokens", (1 << 30) + 1), ("window", 0),
                                      ("window", 1025), ("window", "8"), ("max_moves", True), ("max_moves", 0), ("max_moves", None)])
def test_bad_rebalance_names_key(name, bad):
    with pytest.raises(ValueError, match=re.escape(f"tiers.rebalance.{name}:")):
        parse_config({"tiers": {"rebalance": {name: bad}}})


def test_unknown_rebalance_key():
    with pytest.raises(ValueError, match=re.escape("tiers.rebalance.every: unknown key")):
        parse_config({"tiers": {"rebalance": {"every": 3}}})
