"""pack(min_sqnr=): the experts that quantize worst in int4 or nf4 are kept at int8, and the manifest says so.

A pack without ``min_sqnr`` records each expert's SQNR per precision; with it, exactly the experts
whose recorded int4 (nf4) SQNR is below the threshold have a reference for int4 (nf4) that is
their int8 blob's own (same file, offset, size, checksum), with ``encoding: "int8"``, and the
files hold the same bytes as without it. Refused: ``min_sqnr`` without int8 packed (before
anything is written), and manifests whose encodings are not what pack writes.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import shutil
from pathlib import Path

import pytest

from conftest import save_tiny
from tiers.loader.layout import ExpertKey
from tiers.loader.manifest_parse import FormatError, checksum
from tiers.loader.pack import pack
from tiers.loader.pack_files import verify_files
from tiers.loader.packed import MANIFEST, read_manifest
from tiers.tools.pack import main as pack_main

inspect_cli = importlib.import_module("tiers.tools.inspect")

FOUR_BIT = ("int4", "nf4")
PRECISIONS = ("bf16", "int8", *FOUR_BIT)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(source checkpoint, a pack of it without min_sqnr, {(precision, key): recorded SQNR}, a folder for more packs)."""
    pytest.importorskip("bitsandbytes")  # nf4's encoder
    d = tmp_path_factory.mktemp("min_sqnr")
    src = save_tiny("qwen3_moe", d / "hf")
    plain = d / "plain"
    pack(src, plain, precisions=PRECISIONS, progress=False)
    m = read_manifest(plain)
    sqnr = {(p, k): m.ref(k, p).sqnr_db for p in FOUR_BIT for k in m.keys}
    assert all(v is not None for v in sqnr.values())
    return src, plain, sqnr, d


def _threshold(sqnr: dict, p: str, where: str) -> float:
    """Below or above every 4-bit expert's SQNR (int4's and nf4's lie within a dB of each other), or
    the median of ``p``'s."""
    every = sorted(sqnr.values())
    values = sorted(v for (q, _), v in sqnr.items() if q == p)
    return {"below all": every[0] - 1.0, "above all": every[-1] + 1.0, "between": values[len(values) // 2]}[where]


@pytest.mark.parametrize("where", ["below all", "between", "above all"])
def test_exactly_the_experts_below_the_threshold_are_kept_at_int8(made, where):
    src, plain, sqnr, d = made
    thr = _threshold(sqnr, "int4", where)
    summary = pack(src, d / f"mixed-{where}", precisions=PRECISIONS, progress=False, min_sqnr=thr)
    m, base = read_manifest(d / f"mixed-{where}"), read_manifest(plain)
    verify_files(m)  # aliases count once; an int4 file no reference uses (every expert kept) still checks
    for p in FOUR_BIT:
        want = {k for k in m.keys if sqnr[p, k] < thr}
        kept = {k for k in m.keys if m.ref(k, p).encoding is not None}
        assert kept == want, p
        assert len(kept) == {"below all": 0, "above all": len(m.keys)}.get(where, len(kept))
        assert summary.promoted[p] == len(want) == m.pack["promoted"][p]
        for k in m.keys:
            if k in want:  # its int8 blob's own reference, renamed
                assert m.ref(k, p) == dataclasses.replace(m.ref(k, "int8"), encoding="int8")
                assert m.blob(k, p).precision == "int8"
            else:
                assert m.ref(k, p) == base.ref(k, p) and m.blob(k, p).precision == p
    assert 0 < summary.promoted["int4"] < len(m.keys) or where != "between"
    assert m.pack["min_sqnr_db"] == thr and f"below {thr:g} dB" in str(summary)
    for k in m.keys:  # int8 and bf16 are untouched
        assert m.ref(k, "int8") == base.ref(k, "int8") and m.ref(k, "bf16") == base.ref(k, "bf16")
    assert m.expert_files == base.expert_files  # no byte written twice: the same files, header for header
    assert {p: m.layers[0].encodings[p] for p in FOUR_BIT} == {
        p: _counts(p, [ExpertKey(0, e) for e in range(8)], sqnr, thr) for p in FOUR_BIT}


def _counts(p: str, keys: list, sqnr: dict, thr: float) -> dict:
    kept = sum(sqnr[p, k] < thr for k in keys)
    return {enc: n for enc, n in ((p, len(keys) - kept), ("int8", kept)) if n}


def test_without_int8_packed_it_is_refused_before_anything_is_written(made, tmp_path):
    src = made[0]
    with pytest.raises(ValueError, match=r"--min-sqnr 20(\.0)?: int4 keeps its worst experts at int8, which is not packed; "
                                         r"add int8 to the precisions \(--precisions bf16,int4,int8\)"):
        pack(src, tmp_path / "out", precisions=("bf16", "int4"), progress=False, min_sqnr=20.0)
    with pytest.raises(ValueError, match=r"--min-sqnr 20: .* neither is packed \(precisions: bf16,int8\)"):
        pack(src, tmp_path / "out", precisions=("bf16", "int8"), progress=False, min_sqnr=20)
    with pytest.raises(ValueError, match=r"--min-sqnr: expected a finite number of dB, got nan"):
        pack(src, tmp_path / "out", precisions=PRECISIONS, progress=False, min_sqnr=float("nan"))
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_the_cli_refuses_it_naming_the_flag(made, tmp_path, capsys):
    """A YAML whose tiers are all int4 packs bf16 and int4 only: --min-sqnr asks for int8 too."""
    cfg = tmp_path / "tiers.yaml"
    cfg.write_text("tiers:\n  cpu: {precision: int4}\n  nvme: {precision: int4}\n")
    assert pack_main([str(made[0]), str(tmp_path / "out"), "--config", str(cfg), "--min-sqnr", "18", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--min-sqnr 18.0: int4 keeps its worst experts at int8, which is not packed" in err
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def mixed(made):
    """A pack whose int4 and nf4 keep about half the experts at int8."""
    src, _, sqnr, d = made
    dst = d / "mixed-half"
    pack(src, dst, precisions=PRECISIONS, progress=False, min_sqnr=_threshold(sqnr, "int4", "between"))
    return dst


def _edit(src: Path, dst: Path, change) -> Path:
    shutil.copytree(src, dst)
    doc = json.loads((dst / MANIFEST).read_text())
    change(doc)
    doc["checksum"] = checksum(doc)
    (dst / MANIFEST).write_text(json.dumps(doc))
    return dst


def _first_kept(doc: dict) -> tuple[int, dict]:
    """The first expert of layer 0 whose int4 reference is kept at int8: (its id, its entry)."""
    return next((x["expert"], x) for x in doc["layers"][0]["experts"] if "encoding" in x["int4"])


def _unpack_int8(doc: dict) -> None:
    doc["precisions"].remove("int8")
    for layer in doc["layers"]:
        del layer["blobs"]["int8"]
        for x in layer["experts"]:
            del x["int8"]


def _set(precision: str, **fields):
    def change(doc):
        _, x = _first_kept(doc)
        x[precision].update(fields)
    return change


def _nbytes_of_int4(doc):
    _, x = _first_kept(doc)
    x["int4"]["nbytes"] = doc["layers"][0]["blobs"]["int4"]["nbytes"]


BAD = {
    "unknown": (_set("int4", encoding="fp8"), r"int4\.encoding: 'fp8': a int4 reference may name only 'int8'"),
    "on int8": (_set("int8", encoding="bf16"), r"int8\.encoding: 'bf16': a int8 reference may name none \(omit it\)"),
    "not a string": (_set("int4", encoding=8), r"int4\.encoding: 8: a int4 reference may name only 'int8'"),
    "not packed": (_unpack_int8, r"(int4|nf4)\.encoding: 'int8' is not packed in this layer"),  # the first expert kept in either
    "wrong nbytes": (_nbytes_of_int4, r"int4\.nbytes: \d+ bytes, the layer's int8 blob layout has \d+"),
    "not its int8 blob": (_set("int4", crc32=1), r"int4: encoding 'int8', but it is not the expert's int8 blob"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_manifest_with_a_bad_encoding_is_refused_naming_the_layer_expert_and_key(mixed, tmp_path, case):
    change, match = BAD[case]
    root = _edit(mixed, tmp_path / "p", change)
    e, _ = _first_kept(json.loads((mixed / MANIFEST).read_text()))
    e = r"\d+" if case == "not packed" else e
    with pytest.raises(FormatError, match=rf"manifest\.json: layers\[0\]\.experts\[expert {e}\]\.{match}"):
        read_manifest(root)


def test_an_encoding_removed_from_a_kept_expert_is_refused(mixed, tmp_path):
    """Without its encoding the int8 bytes would be read as int4's: their sizes differ, so the
    reference is refused rather than misread."""
    def drop(doc):
        _, x = _first_kept(doc)
        del x["int4"]["encoding"]
    root = _edit(mixed, tmp_path / "p", drop)
    with pytest.raises(FormatError, match=r"int4\.nbytes: \d+ bytes, the layer's int4 blob layout has \d+"):
        read_manifest(root)


def test_inspect_counts_the_experts_kept_per_precision(made, mixed, capsys):
    m = read_manifest(mixed)
    info = inspect_cli.describe(str(mixed))
    assert info["min_sqnr_db"] == m.pack["min_sqnr_db"]
    for row in info["layers"]:
        entry = m.layers[row["layer"]]
        assert row["kept_higher"] == {p: entry.encodings[p]["int8"] for p in FOUR_BIT if "int8" in entry.encodings[p]}
    assert inspect_cli.main([str(mixed)]) == 0
    out = capsys.readouterr().out
    assert f"int4 {m.pack['promoted']['int4']} of {len(m.keys)}, nf4 {m.pack['promoted']['nf4']} of {len(m.keys)}" in out
    assert inspect_cli.main([str(made[1])]) == 0
    assert "kept at a higher precision" not in capsys.readouterr().out  # a pack without --min-sqnr
