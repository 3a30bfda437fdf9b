"""A packed checkpoint's routing prior: a routing document embedded in its manifest at pack time
(``pack(..., routing=)``) or later (``set_routing_prior``), checked against the checkpoint's MoE
layers before anything is written, and read back as counts per layer."""
from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import pytest

import tiers.loader.routing
from tiers.loader.pack import pack
from tiers.loader.manifest_parse import checksum
from tiers.loader.packed import MANIFEST, read_manifest, set_routing_prior
from tiers.loader.routing import routing_document

MODEL = "qwen3_moe"


def _counts(manifest, hot: dict[int, int] | None = None) -> dict[int, list[int]]:
    """One lookup per expert of every MoE layer, and 50 for each ``layer: expert`` in ``hot``."""
    counts = {L: [1] * e.layout.num_experts for L, e in manifest.layers.items()}
    for L, e in (hot or {}).items():
        counts[L][e] = 50
    return counts


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): zlib.crc32(p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def packed_copy(packed_factory, tmp_path):
    dst = tmp_path / "packed"
    shutil.copytree(packed_factory(MODEL), dst)
    return dst


def test_pack_embeds_the_routing_file_as_the_prior(checkpoint_factory, packed_factory, tmp_path):
    manifest = read_manifest(packed_factory(MODEL))
    L = sorted(manifest.layers)[1]
    doc = routing_document(_counts(manifest, {L: 5}), tokens=40)
    path = tiers.loader.routing.write_routing(doc, tmp_path / "routing.json")
    summary = pack(checkpoint_factory(MODEL), tmp_path / "with-prior", progress=False, routing=path)
    assert "routing prior: embedded" in str(summary)
    got = read_manifest(tmp_path / "with-prior")
    assert got.routing_prior == {L2: [float(c) for c in row] for L2, row in _counts(manifest, {L: 5}).items()}
    raw = json.loads((tmp_path / "with-prior" / MANIFEST).read_text())["routing_prior"]
    assert raw == doc  # the document as written, tokens included
    assert read_manifest(packed_factory(MODEL)).routing_prior is None  # packed without one: none
    assert "routing prior" not in str(pack(checkpoint_factory(MODEL), tmp_path / "without", progress=False))


def test_pack_refuses_a_bad_routing_file_before_writing_anything(checkpoint_factory, packed_factory, tmp_path):
    manifest = read_manifest(packed_factory(MODEL))
    counts = _counts(manifest)
    counts[99] = [1] * 8
    path = tiers.loader.routing.write_routing(routing_document(counts, tokens=4), tmp_path / "routing.json")
    with pytest.raises(ValueError, match=r"routing file '.*routing\.json': layer 99 is not a MoE layer of") as e:
        pack(checkpoint_factory(MODEL), tmp_path / "out", progress=False, routing=path)
    assert str(checkpoint_factory(MODEL)) in str(e.value)  # the checkpoint it was checked against
    assert sorted(p.name for p in tmp_path.iterdir()) == ["routing.json"]  # no destination, no temporary


def test_set_routing_prior_changes_the_manifest_prior_alone(packed_copy, tmp_path):
    before_files = _files(packed_copy)
    before = json.loads((packed_copy / MANIFEST).read_text())
    manifest = read_manifest(packed_copy)
    L = sorted(manifest.layers)[0]
    doc = routing_document(_counts(manifest, {L: 2}), tokens=9)
    got = set_routing_prior(packed_copy, doc)
    assert got.routing_prior[L][2] == 50.0 and got.routing_prior == read_manifest(packed_copy).routing_prior
    after = json.loads((packed_copy / MANIFEST).read_text())
    assert after.pop("routing_prior") == doc
    assert after.pop("checksum") == checksum({**after, "routing_prior": doc}) != before["checksum"]  # re-sealed
    assert after == {k: v for k, v in before.items() if k not in ("routing_prior", "checksum")}
    changed = {k for k, crc in _files(packed_copy).items() if before_files.get(k) != crc}
    assert changed == {MANIFEST} and set(_files(packed_copy)) == set(before_files)  # no other file, no temporary
    assert set_routing_prior(packed_copy, None).routing_prior is None
    assert json.loads((packed_copy / MANIFEST).read_text()) == before


@pytest.mark.parametrize("case,match", [
    ("short_row", "has 8 experts in the checkpoint, the file counts 3"),
    ("negative", "expert 1: expected a count >= 0, got -2"),
    ("format", "not a Tiers routing file"),
])
def test_set_routing_prior_refuses_a_bad_document_and_leaves_the_manifest(packed_copy, case, match):
    manifest = read_manifest(packed_copy)
    L = sorted(manifest.layers)[0]
    doc = routing_document(_counts(manifest), tokens=3)
    if case == "short_row":
        doc["counts"][str(L)] = [1, 2, 3]
    elif case == "negative":
        doc["counts"][str(L)][1] = -2
    else:
        doc["format"] = "counts"
    before = (packed_copy / MANIFEST).read_bytes()
    with pytest.raises(ValueError, match=match):
        set_routing_prior(packed_copy, doc)
    assert (packed_copy / MANIFEST).read_bytes() == before


def test_a_failed_manifest_write_leaves_the_old_manifest_whole(packed_copy, monkeypatch):
    manifest = read_manifest(packed_copy)
    before = (packed_copy / MANIFEST).read_bytes()
    names = sorted(p.name for p in packed_copy.iterdir())

    def fail(fd):
        raise OSError("disk full")

    monkeypatch.setattr(tiers.loader.routing.os, "fsync", fail)
    with pytest.raises(OSError, match="disk full"):
        set_routing_prior(packed_copy, routing_document(_counts(manifest), tokens=1))
    assert (packed_copy / MANIFEST).read_bytes() == before
    assert sorted(p.name for p in packed_copy.iterdir()) == names


def _write_sealed(root, m):
    """Write manifest ``m`` with a checksum that matches it."""
    m["checksum"] = checksum({k: v for k, v in m.items() if k != "checksum"})
    (root / MANIFEST).write_text(json.dumps(m))


def test_a_bad_embedded_prior_is_refused_at_read_naming_the_manifest_and_can_be_replaced(packed_copy):
    m = json.loads((packed_copy / MANIFEST).read_text())
    manifest = read_manifest(packed_copy)
    doc = routing_document(_counts(manifest), tokens=1)
    L = sorted(manifest.layers)[2]
    doc["counts"][str(L)][4] = "many"
    m["routing_prior"] = doc
    _write_sealed(packed_copy, m)  # a prior sealed into the manifest, as an older pack might have written it
    with pytest.raises(ValueError, match=rf"manifest\.json: routing_prior: layer {L}, expert 4: expected a count >= 0, got 'many'") as e:
        read_manifest(packed_copy)
    assert "--clear-routing" in str(e.value) and "--set-routing" in str(e.value)  # how to mend it
    # a bad prior can be replaced or removed: the rest of the manifest reads without it
    assert set_routing_prior(packed_copy, routing_document(_counts(manifest), tokens=2)).routing_prior is not None
    m["routing_prior"] = {"format": "something-else"}
    _write_sealed(packed_copy, m)
    assert set_routing_prior(packed_copy, None).routing_prior is None
    assert read_manifest(packed_copy).routing_prior is None
