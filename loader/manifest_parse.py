"""The manifest parser: any ``manifest.json`` document either becomes a checked ``Manifest`` or raises ``FormatError``.

Owns the shape of a manifest (format version 2) and every check that needs the document alone:
each field's type and range, the manifest's checksum of its own content, file names confined to
the pack directory (no absolute path, no ``..``, no symlink leading out of it), each layer's
experts exactly ``0..n-1``, each blob reference's size equal to its layout's and its file one
the manifest lists, a reference's ``encoding`` (``loader.promote``) only the next higher packed
precision and the reference then that precision's own, dense and carried file names listed
once. What needs the files themselves (their checksums, the expert files' own safetensors
headers, blob overlaps) is ``loader.pack_files``'. Every error is a ``FormatError`` (a
``ValueError``) naming the manifest file and the field, with at most ~200 characters of a value.
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path, PurePosixPath
from typing import Any

from .. import quant
from .blob import blob_layout
from .layout import ExpertLayout
from .promote import NEXT
from .shown import show

FORMAT = "tiers-packed"
VERSION = 2


class FormatError(ValueError):
    """A packed checkpoint's manifest or files are malformed (naming the file and the field)."""


def checksum(doc: dict) -> str:
    """The CRC32 of a manifest's content (every field but ``checksum``), as 8 hex digits."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True, separators=(',', ':')).encode()):08x}"


class Parser:
    """Checks one manifest document; ``where`` names the manifest file in every error."""

    def __init__(self, root: Path, where: Path):
        self.root, self.where = root, where
        self.real_root = root.resolve()

    def fail(self, field: str, problem: str) -> FormatError:
        return FormatError(f"{self.where}: {field}: {problem}")

    def get(self, d: Any, key: str, kind: type | tuple, field: str) -> Any:
        if not isinstance(d, dict):
            raise self.fail(field, f"expected an object, got {show(d)}")
        if key not in d:
            raise self.fail(f"{field}.{key}" if field else key, "missing")
        value = d[key]
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise self.fail(f"{field}.{key}" if field else key, f"expected {_kind(kind)}, got {show(value)}")
        if not isinstance(value, kind):
            raise self.fail(f"{field}.{key}" if field else key, f"expected {_kind(kind)}, got {show(value)}")
        return value

    def count(self, d: Any, key: str, field: str, *, lo: int = 0, hi: int = 2**63) -> int:
        value = self.get(d, key, int, field)
        if not lo <= value < hi:
            raise self.fail(f"{field}.{key}", f"expected an integer in [{lo}, {hi}), got {show(value)}")
        return value

    def confined(self, name: Any, field: str) -> str:
        """A file name the manifest lists, refused unless it stays inside the pack directory."""
        if not isinstance(name, str) or not name:
            raise self.fail(field, f"expected a file name, got {show(name)}")
        pure = PurePosixPath(name)
        if pure.is_absolute() or "\\" in name or any(part in ("..", ".", "") for part in name.split("/")) or name.startswith("~"):
            raise self.fail(field, f"file name {show(name)} leaves the pack directory (an absolute path, '..' or an odd name)")
        path = self.root / name
        try:
            path.resolve().relative_to(self.real_root)
        except (ValueError, OSError, RuntimeError):
            raise self.fail(field, f"file {show(name)} resolves outside the pack directory (a symlink out of it)") from None
        return name

    def files(self, table: dict, key: str) -> dict[str, dict]:
        """A ``{name: {crc32, nbytes}}`` table of whole files (dense or carried)."""
        out = {}
        for name, info in table.items():
            field = f"{key}[{name!r}]"
            self.confined(name, field)
            out[name] = {"crc32": self.count(info, "crc32", field, hi=2**32), "nbytes": self.count(info, "nbytes", field)}
        return out


def _kind(kind: type | tuple) -> str:
    names = {int: "an integer", str: "a string", dict: "an object", list: "a list", float: "a number", bool: "true or false"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds if k is not type(None)) + (" or null" if type(None) in kinds else "")


def parse_head(p: Parser, doc: Any) -> dict:
    """The fields every other check needs: format, version, checksum, precisions, the file tables."""
    if not isinstance(doc, dict):
        raise p.fail("manifest", f"expected a JSON object, got {show(doc)}")
    fmt = doc.get("format")
    if fmt != FORMAT:
        raise p.fail("format", f"is {show(fmt)}, expected {FORMAT!r}")
    version = doc.get("version")
    if version != VERSION:
        raise p.fail("version", f"format version {show(version)} is not read by this build (it reads {VERSION}); re-pack the checkpoint")
    stored = p.get(doc, "checksum", str, "")
    if stored != checksum(doc):
        raise p.fail("checksum", f"the manifest's content does not match its checksum {show(stored)} (changed after packing); re-pack")
    precisions = p.get(doc, "precisions", list, "")
    known = set(quant.scheme_names())
    if not precisions or len(set(map(str, precisions))) != len(precisions) or not all(isinstance(x, str) and x in known for x in precisions):
        raise p.fail("precisions", f"expected distinct known precisions {sorted(known)}, got {show(precisions)}")
    p.get(doc, "model_type", str, "")
    if p.get(doc, "compute_dtype", str, "") != "bfloat16":
        raise p.fail("compute_dtype", f"expected 'bfloat16', got {show(doc['compute_dtype'])}")
    dense = p.get(p.get(doc, "dense", dict, ""), "files", dict, "dense")
    experts_files = p.get(doc, "expert_files", dict, "")
    return {"precisions": tuple(precisions), "dense": p.files(dense, "dense.files"), "carried": p.files(p.get(doc, "carried", dict, ""), "carried"),
            "expert_files": _expert_files(p, experts_files)}


def _expert_files(p: Parser, table: dict) -> dict[str, dict]:
    out = {}
    for name, info in table.items():
        field = f"expert_files[{name!r}]"
        p.confined(name, field)
        out[name] = {"header_crc32": p.count(info, "header_crc32", field, hi=2**32), "header_bytes": p.count(info, "header_bytes", field, lo=8),
                     "nbytes": p.count(info, "nbytes", field)}
    return out


def parse_layer(p: Parser, entry: Any, i: int, precisions: tuple[str, ...], expert_files: dict) -> tuple:
    """One layer's entry: (layer, module, layout, blob layouts, experts as {precision: ref fields})."""
    field = f"layers[{i}]"
    layer = p.count(entry, "layer", field)
    module = p.get(entry, "module", str, field)
    try:
        layout = ExpertLayout.from_json(p.get(entry, "layout", dict, field))
    except (KeyError, TypeError, ValueError, OverflowError) as e:  # OverflowError: a size of infinity
        raise p.fail(f"{field}.layout", f"not an expert layout ({show(e)})") from None
    if layout.num_experts < 1 or not layout.tensors:
        raise p.fail(f"{field}.layout", f"no experts or no tensors: {show(entry['layout'])}")
    blobs = {}
    stored = p.get(entry, "blobs", dict, field)
    for prec in precisions:
        doc = stored.get(prec)
        options = doc.get("options") if isinstance(doc, dict) else None
        try:
            bl = blob_layout(layout, prec, options if isinstance(options, dict) else None)
        except (TypeError, ValueError) as e:
            raise p.fail(f"{field}.blobs.{prec}.options", show(e)) from None
        if doc != bl.to_json():
            raise p.fail(f"{field}.blobs.{prec}", f"differs from this build's {prec} blob layout for the layer's layout"
                                                  f"{_field_difference(doc, bl.to_json())}; re-pack")
        blobs[prec] = bl
    experts = p.get(entry, "experts", list, field)
    if len(experts) != layout.num_experts:  # before anything is sized by num_experts (10**30 of them)
        raise p.fail(f"{field}.experts", f"{len(experts)} entries, the layer's layout has {show(layout.num_experts)} experts")
    ids = [p.count(e, "expert", f"{field}.experts[{j}]") for j, e in enumerate(experts)]
    if sorted(ids) != list(range(layout.num_experts)):
        raise p.fail(f"{field}.experts", f"expert ids {show(sorted(ids))} are not exactly 0..{layout.num_experts - 1}")
    refs = [None] * layout.num_experts
    for j, e in zip(ids, experts):
        where = f"{field}.experts[expert {j}]"
        refs[j] = {prec: _ref(p, e, prec, f"{where}.{prec}", blobs, expert_files) for prec in precisions}
        for prec, ref in refs[j].items():  # a promoted reference is its encoding's own, renamed
            enc = ref["encoding"]
            if enc is not None and {**ref, "encoding": None} != refs[j][enc]:
                raise p.fail(f"{where}.{prec}", f"encoding {enc!r}, but it is not the expert's {enc} blob {show(refs[j][enc])}")
    return layer, module, layout, blobs, tuple(refs)


def _field_difference(stored: Any, built: dict) -> str:
    """`` (field 'scale' of 'w': float16 [4, 2] in the pack, uint8 [4, 2] in this build)``: the first of
    this build's fields the pack stores otherwise (a pack made before a precision's format changed),
    or "" where the fields agree or the stored ones are not readable."""
    try:
        have = {(f["tensor"], f["field"]): (f["dtype"], f["shape"]) for f in stored["fields"]}
    except (KeyError, TypeError):
        return ""
    for f in built["fields"]:
        key, want = (f["tensor"], f["field"]), (f["dtype"], f["shape"])
        if key not in have:
            return f" (no field {key[1]!r} of {key[0]!r} in the pack)"
        if have[key] != want:
            return (f" (field {key[1]!r} of {key[0]!r}: {show(have[key][0])} {show(have[key][1])} in the pack, "
                    f"{show(want[0])} {show(want[1])} in this build)")
    return ""


def _ref(p: Parser, e: dict, prec: str, field: str, blobs: dict, expert_files: dict) -> dict:
    r = p.get(e, prec, dict, field.rsplit(".", 1)[0])
    name = p.get(r, "file", str, field)
    if name not in expert_files:
        raise p.fail(f"{field}.file", f"{show(name)} is not one of the expert files the manifest lists")
    offset = p.count(r, "offset", field)
    enc = r.get("encoding")
    if enc is not None:  # kept at a higher precision by pack's --min-sqnr (loader.promote)
        if prec not in NEXT or enc != NEXT[prec]:
            allowed = f"only {NEXT[prec]!r}" if prec in NEXT else "none (omit it)"
            raise p.fail(f"{field}.encoding", f"{show(enc)}: a {prec} reference may name {allowed}")
        if enc not in blobs:
            raise p.fail(f"{field}.encoding", f"{enc!r} is not packed in this layer (precisions: {sorted(blobs)})")
    nbytes = blobs[enc or prec].nbytes
    if p.count(r, "nbytes", field) != nbytes:
        raise p.fail(f"{field}.nbytes", f"{r['nbytes']} bytes, the layer's {enc or prec} blob layout has {nbytes}")
    sqnr = r.get("sqnr_db")
    if sqnr is not None and (isinstance(sqnr, bool) or not isinstance(sqnr, (int, float))):
        raise p.fail(f"{field}.sqnr_db", f"expected a number or null, got {show(sqnr)}")
    return {"file": name, "offset": offset, "nbytes": nbytes, "crc32": p.count(r, "crc32", field, hi=2**32), "sqnr_db": sqnr,
            "encoding": enc}


def parse_layers(p: Parser, doc: dict, head: dict) -> list[tuple]:
    layers = p.get(doc, "layers", list, "")
    if not layers:
        raise p.fail("layers", "no MoE layer")
    out = [parse_layer(p, entry, i, head["precisions"], head["expert_files"]) for i, entry in enumerate(layers)]
    seen = [x[0] for x in out]
    if len(set(seen)) != len(seen):
        raise p.fail("layers", f"a layer is listed twice: {show(seen)}")
    modules = [x[1] for x in out]
    if len(set(modules)) != len(modules):
        raise p.fail("layers", f"an experts module is listed twice: {show(modules)}")
    return out
