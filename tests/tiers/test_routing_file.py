"""Routing files: what the rebalancer counted, saved by one load and ranking the next one's tiers.

``tiers.save_routing`` writes the rebalancer's window of lookups; ``tiers.load(..., routing=)``
ranks the experts by each one's share of its layer's lookups, so the hot set starts where the
rebalancer would have taken it. Bad files are refused with the file and the offending key named.
"""
import json
import math
import shutil

import pytest
import torch

import tiers
from tiers.loader.layout import ExpertKey
from tiers.loader.packed import read_manifest, set_routing_prior
from tests.conftest import devices
from tiers.api import manager_of
from tiers.loader.routing import read_routing, routing_document, write_routing
from tiers.policy.placement import preference_order

REBALANCING = {"tiers": {"gpu": {"fraction": 0.25}, "cpu": {"fraction": 0.75, "precision": "int8"},
                         "rebalance": {"every_tokens": 2}}}


def _generate(model, tokens: int, device: str) -> None:
    prompt = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0)).to(device)
    model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("device", devices())
def test_saved_routing_ranks_the_next_loads_hot_set(packed_factory, tmp_path, device):
    """The file holds one count per expert of every counted layer, and the tokens they span; a
    load that names it makes hot the experts with the largest shares of their layer's lookups:
    none left warm has a larger share than any made hot."""
    packed = packed_factory("qwen3_moe")
    model = tiers.load(packed, REBALANCING, device=device, progress=False)
    _generate(model, 12, device)
    path = tiers.save_routing(model, tmp_path / "routing.json")
    doc = json.loads(path.read_text())
    manifest = read_manifest(packed)
    assert doc["format"] == "tiers-routing" and doc["version"] == 1
    assert doc["tokens"] == 6 + 12 - 1  # the prompt's forward, then one token per decode step
    assert sorted(int(L) for L in doc["counts"]) == sorted(manifest.layers)
    assert all(len(row) == manifest.layers[int(L)].layout.num_experts for L, row in doc["counts"].items())
    # a layer call counts each expert it routes to once: each of the 11 decode steps its top-k
    # (2 in the tiny qwen3_moe), the prompt's forward at least k and at most 6 x k
    k = model.config.num_experts_per_tok
    assert all(12 * k <= sum(row) <= doc["tokens"] * k for row in doc["counts"].values())
    assert doc == tiers.routing_counts(model)  # counting again changes nothing
    manager_of(model).close()

    ranked = tiers.load(packed, REBALANCING, device=device, progress=False, routing=path)
    share = {ExpertKey(int(L), e): c / sum(row) for L, row in doc["counts"].items() for e, c in enumerate(row)}
    hot = set(manager_of(ranked).placement.hot)
    assert 0 < len(hot) < len(share)
    assert min(share[k] for k in hot) >= max(share[k] for k in share if k not in hot)
    manager_of(ranked).close()


def test_routing_counts_need_the_rebalancer(packed_factory):
    model = tiers.load(packed_factory("qwen3_moe"), {"tiers": {"gpu": {"fraction": 0.25}}}, device="cpu", progress=False)
    with pytest.raises(ValueError, match="every_tokens"):
        tiers.routing_counts(model)


def test_preference_order_ranks_by_share_and_uncounted_layers_as_even(packed_factory):
    """Layer L0's expert 3 has every lookup (share 1), its other experts none (0); layer L1 is
    not counted, so each of its experts ranks at 1/n, between the two."""
    manifest = read_manifest(packed_factory("qwen3_moe"))
    L0, L1 = sorted(manifest.layers)[:2]
    n0 = manifest.layers[L0].layout.num_experts
    counts = {L0: [0.0] * n0}
    counts[L0][3] = 10.0
    order = [k for k in preference_order(manifest, counts) if k.layer in (L0, L1)]
    n1 = manifest.layers[L1].layout.num_experts
    assert order[0] == ExpertKey(L0, 3)
    assert order[1 : 1 + n1] == [ExpertKey(L1, e) for e in range(n1)]
    assert order[1 + n1 :] == [ExpertKey(L0, e) for e in range(n0) if e != 3]


def _doc(manifest, **override):
    doc = routing_document({L: [1] * e.layout.num_experts for L, e in manifest.layers.items()}, tokens=4)
    return doc | override


@pytest.mark.parametrize("case,match", [
    ("missing", "does not exist"),
    ("not_json", "not valid JSON"),
    ("format", "not a Tiers routing file"),
    ("version", "version 2"),
    ("counts_list", "must map each layer"),
    ("layer_name", "'first' is not a layer index"),
    ("unknown_layer", "layer 99 is not a MoE layer"),
    ("short_row", "has 8 experts in the checkpoint, the file counts 7"),
    ("negative", "expert 2: expected a count >= 0, got -1"),
    ("nan", "expert 2: expected a count >= 0, got nan"),
    ("bool", "expert 2: expected a count >= 0, got True"),
    ("huge", "expert 2: expected a count >= 0, got <an integer of 401 digits>"),  # an int no float holds: was an OverflowError
    ("zeros", "counts no lookups"),
])
def test_bad_routing_files_are_refused_naming_the_file_and_key(packed_factory, tmp_path, case, match):
    manifest = read_manifest(packed_factory("qwen3_moe"))
    L = sorted(manifest.layers)[0]
    path = tmp_path / "routing.json"
    doc = _doc(manifest)
    row = list(doc["counts"][str(L)])
    if case == "not_json":
        path.write_text("{not json")
    elif case != "missing":
        if case == "format":
            doc = _doc(manifest, format="something-else")
        elif case == "version":
            doc = _doc(manifest, version=2)
        elif case == "counts_list":
            doc = _doc(manifest, counts=[1, 2])
        elif case == "layer_name":
            doc["counts"]["first"] = row
        elif case == "unknown_layer":
            doc["counts"]["99"] = row
        elif case == "short_row":
            doc["counts"][str(L)] = row[:-1]
        elif case in ("negative", "nan", "bool", "huge"):
            row[2] = {"negative": -1, "nan": math.nan, "bool": True, "huge": 10**400}[case]
            doc["counts"][str(L)] = row
        elif case == "zeros":
            doc["counts"] = {k: [0] * len(v) for k, v in doc["counts"].items()}
        path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=match) as e:
        read_routing(path, manifest)
    assert str(path) in str(e.value)


def test_a_good_file_reads_as_counts_per_layer(packed_factory, tmp_path):
    manifest = read_manifest(packed_factory("qwen3_moe"))
    doc = _doc(manifest)
    first = sorted(manifest.layers)[0]
    del doc["counts"][str(first)]  # a layer left out is allowed
    path = write_routing(doc, tmp_path / "routing.json")
    got = read_routing(path, manifest)
    assert sorted(got) == sorted(manifest.layers)[1:] and all(row == [1.0] * len(row) for row in got.values())
    assert read_routing(doc, manifest) == got  # the parsed document reads the same


def test_writing_a_routing_file_replaces_it_whole_or_not_at_all(tmp_path):
    path = tmp_path / "routing.json"
    write_routing({"counts": {"0": [1]}}, path)
    with pytest.raises(TypeError):
        write_routing({"counts": {"0": [object()]}}, path)  # fails inside the write
    assert json.loads(path.read_text()) == {"counts": {"0": [1]}}  # the old file, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["routing.json"]  # no partial file left
    with pytest.raises(ValueError, match="is a directory"):
        write_routing({}, tmp_path)


def test_a_packed_routing_prior_ranks_a_load_given_no_routing_file(packed_factory, tmp_path):
    """A checkpoint whose manifest embeds a routing prior loads with the hot and warm sets a
    routing file of the same counts gives (not round-robin's); a routing file named at load
    ranks instead of the prior."""
    config = {"tiers": {"gpu": {"fraction": 0.25}, "cpu": {"fraction": 0.5, "precision": "int8"}}}
    plain = packed_factory("qwen3_moe")
    manifest = read_manifest(plain)
    prior = routing_document({L: [1] * (e.layout.num_experts - 1) + [30] for L, e in manifest.layers.items()}, tokens=30)
    other = routing_document({L: [30] + [1] * (e.layout.num_experts - 1) for L, e in manifest.layers.items()}, tokens=30)
    packed = tmp_path / "packed"
    shutil.copytree(plain, packed)
    set_routing_prior(packed, prior)

    def placed(path, **kw):
        model = tiers.load(path, config, device="cpu", progress=False, **kw)
        p = manager_of(model).placement
        manager_of(model).close()
        return set(p.hot), set(p.warm)

    with_prior = placed(packed)
    assert with_prior == placed(plain, routing=prior)
    assert with_prior != placed(plain)
    last = {ExpertKey(L, e.layout.num_experts - 1) for L, e in manifest.layers.items()}
    assert last <= with_prior[0]  # each layer's most counted expert is hot
    assert placed(packed, routing=other) == placed(plain, routing=other) != with_prior
