"""Fuzz mutations of a case's files as bytes and as JSON (manifest, safetensors headers, carried files, routing file).

A kind is ``Kind.apply(case, rng) -> Mutation``; ``fuzz_kinds.KINDS`` names them all,
``<target>.<change>``. Raw kinds change bytes (flip, digit, truncate, append, delete) and stop at a
checksum. Resealed kinds (``.edit``, ``.header``, ``.prefix``, ``.path``, ``.link``, ``.prior``,
``.swap_refs``, ``.generation``) also rewrite what the manifest records of the file (its CRC32 and
size, the manifest's own checksum), as a careless or hostile edit would, so the change reaches the
parsers behind the checksums. JSON documents share one structural mutator (``mutate_json``: odd
numbers, other types, keys dropped, renamed, added, values swapped, list items repeated).
"""
from __future__ import annotations

import copy
import json
import os
import random
import shutil
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from tiers.loader.manifest_parse import checksum
from tiers.loader.packed import MANIFEST


@dataclass(frozen=True)
class CaseFiles:
    """One case's directory: the pack, the YAML config and routing file a load names, and a place outside the pack."""

    root: Path

    @property
    def pack(self) -> Path:
        return self.root / "packed"

    @property
    def yaml(self) -> Path:
        return self.root / "tiers.yaml"

    @property
    def routing(self) -> Path:
        return self.root / "routing.json"

    @property
    def outside(self) -> Path:
        return self.root / "outside"


@dataclass(frozen=True)
class Mutation:
    file: str  # the file changed, relative to the case directory
    detail: str  # what was done (for the report)
    keys: tuple[str, ...] = ()  # the fields changed: an error naming one of them names the problem
    changes_model: bool = False  # a resealed edit that changes the weights or config the pack holds: other logits are its right


@dataclass(frozen=True)
class Kind:
    apply: Callable[[CaseFiles, random.Random], Mutation]
    after_load: bool = False  # applied between two forwards of a clean load made with verify="always"
    routing: bool = False  # the load names the case's routing file
    weight: int = 1  # the kind's share of a plan's cases


# -- JSON documents ----------------------------------------------------------------------------
NUMBERS = (0, -1, 1, 7, 4095, 4096, 2**31, 2**32, 2**53 + 1, 2**63, 2**64, -2**63, 10**30, 10**400, 1e308, 0.5, -0.0, 1e-300,
           float("nan"), float("inf"), float("-inf"))
OTHERS = (None, True, False, "", "x", "bf16", "int8", "0", "1e3", [], [0], [[]], {}, {"x": 1}, "../x", "/etc/hostname", "a\x00b", "ééé")
NAMES = ("/etc/hostname", "../outside/copy", "experts/../manifest.json", "./config.json", "experts//bf16", "", "~", "a\\b", "a\x00b",
         "x" * 300, "experts/bf16/", ".", "..", "config.json", "manifest.json", "dense-00001.safetensors",
         "experts/bf16/layer-0001.safetensors", "expert.9", "expert.-1", "__metadata__", "0", "-1", "99", "bf16", "int8")


def nodes(doc: Any, path: tuple = ()):
    """Every (path, value) of a JSON document, the root first."""
    yield path, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from nodes(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from nodes(v, path + (i,))


def _get(doc: Any, path: tuple) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _put(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    _get(doc, path[:-1])[path[-1]] = value
    return doc


def _key(path: tuple) -> tuple[str, ...]:
    return tuple(p for p in reversed(path) if isinstance(p, str))[:1]


def _number(rng: random.Random, old: Any) -> Any:
    if isinstance(old, (int, float)) and not isinstance(old, bool) and rng.random() < 0.4:
        delta = rng.choice((1, -1, 8, -8, 4096, -4096, 0.5))
        return rng.choice((old + delta, old * 2, -old, old + delta))
    return rng.choice(NUMBERS)


def _other(rng: random.Random, old: Any) -> Any:
    while True:
        new = rng.choice(OTHERS + NUMBERS)
        if type(new) is not type(old):
            return copy.deepcopy(new)


def mutate_json(doc: Any, rng: random.Random) -> tuple[Any, tuple[str, ...], str]:
    """One structural change to a JSON document: (the new document, the key changed, what was done)."""
    doc = copy.deepcopy(doc)
    every = list(nodes(doc))
    numeric = [(p, v) for p, v in every if p and isinstance(v, (int, float)) and not isinstance(v, bool)]
    dicts = [(p, v) for p, v in every if isinstance(v, dict) and v]
    lists = [(p, v) for p, v in every if isinstance(v, list) and v]
    op = rng.choice(("number", "number", "retype", "retype", "drop", "swap", "swap", "duplicate", "extra", "rename"))
    if op == "number" and numeric:
        path, old = rng.choice(numeric)
        new = _number(rng, old)
        return _put(doc, path, new), _key(path), f"{list(path)}: {old!r} -> {new!r}"
    if op == "drop" and (dicts or lists):
        path, box = rng.choice(dicts + lists)
        k = rng.choice(list(box)) if isinstance(box, dict) else rng.randrange(len(box))
        del box[k]
        return doc, _key(path + (k,)), f"{list(path)}: {k!r} removed"
    if op == "swap":
        return _swap(doc, every, rng)
    if op == "duplicate" and lists:
        path, box = rng.choice(lists)
        box.insert(rng.randrange(len(box) + 1), copy.deepcopy(rng.choice(box)))
        return doc, _key(path), f"{list(path)}: an element repeated"
    if op in ("extra", "rename") and dicts:
        path, box = rng.choice(dicts)
        name = rng.choice(NAMES + tuple(box))
        if op == "rename":
            old = rng.choice(list(box))
            box[name] = box.pop(old)
            return doc, (old, name), f"{list(path)}: key {old!r} renamed {name!r}"
        box[name] = copy.deepcopy(rng.choice(OTHERS + NUMBERS + tuple(box.values())))
        return doc, (name,), f"{list(path)}: key {name!r} set"
    path, old = rng.choice(every)
    new = _other(rng, old)
    return _put(doc, path, new), _key(path), f"{list(path)}: {type(old).__name__} -> {new!r}"[:300]


def _swap(doc: Any, every: list, rng: random.Random) -> tuple[Any, tuple[str, ...], str]:
    """Swap two values under the same key anywhere in the document (two offsets, two layers, two refs)."""
    groups: dict[Any, list] = {}
    for p, _ in every:
        if p:
            groups.setdefault(p[-1] if isinstance(p[-1], str) else (p[:-1], "item"), []).append(p)
    groups = {k: v for k, v in groups.items() if len(v) > 1}
    if not groups:
        return doc, (), "nothing to swap"
    a, b = rng.sample(groups[rng.choice(sorted(groups, key=str))], 2)
    if a == b[: len(a)] or b == a[: len(b)]:
        return doc, (), "nothing to swap"
    va, vb = _get(doc, a), _get(doc, b)
    _put(doc, a, vb)
    _put(doc, b, va)
    return doc, _key(a), f"{list(a)} <-> {list(b)}"


def dump_with_duplicate(doc: Any, rng: random.Random) -> tuple[str, tuple[str, ...]]:
    """``doc`` as JSON text with one object's key written twice (JSON parsers differ on which wins)."""
    dicts = [p for p, v in nodes(doc) if isinstance(v, dict) and v]
    target = rng.choice(dicts)
    twice: list[str] = []

    def dump(node: Any, path: tuple) -> str:
        if isinstance(node, dict):
            items = [f"{json.dumps(k)}: {dump(v, path + (k,))}" for k, v in node.items()]
            if path == target:
                k = rng.choice(list(node))
                twice.append(k)
                items.insert(rng.randrange(len(items) + 1), f"{json.dumps(k)}: {json.dumps(_other(rng, node[k]))}")
            return "{" + ", ".join(items) + "}"
        if isinstance(node, list):
            return "[" + ", ".join(dump(v, path + (i,)) for i, v in enumerate(node)) + "]"
        return json.dumps(node)

    return dump(doc, ()), tuple(twice)


# -- files ---------------------------------------------------------------------------------------
def manifest_doc(case: CaseFiles) -> dict:
    return json.loads((case.pack / MANIFEST).read_text())


def write_manifest(case: CaseFiles, doc: Any, *, reseal: bool = True) -> None:
    """Write the manifest, its checksum re-sealed over the new content (unless asked not to, or it has no place for one)."""
    if reseal and isinstance(doc, dict):
        doc["checksum"] = checksum(doc)
    (case.pack / MANIFEST).write_text(json.dumps(doc, indent=1))


def reseal(case: CaseFiles, name: str) -> None:
    """Make the manifest's record of pack file ``name`` (size, CRC32, an expert file's header) match the file as it is now."""
    doc, data = manifest_doc(case), (case.pack / name).read_bytes()
    for table in (doc["dense"]["files"], doc["carried"]):
        if name in table:
            table[name] = {"crc32": zlib.crc32(data), "nbytes": len(data)}
    if name in doc["expert_files"]:
        rec = doc["expert_files"][name]
        n = struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else 0
        header = n + 8 if n + 8 <= len(data) else rec["header_bytes"]
        rec.update(header_bytes=header, header_crc32=zlib.crc32(data[:header]), nbytes=len(data))
    write_manifest(case, doc)


def pack_files(case: CaseFiles, kind: str) -> list[str]:
    """The pack's files of one kind (manifest, dense, expert, carried), relative to the pack, sorted."""
    doc = manifest_doc(case)
    return {"manifest": [MANIFEST], "dense": sorted(doc["dense"]["files"]), "expert": sorted(doc["expert_files"]),
            "carried": sorted(doc["carried"])}[kind]


def flip(path: Path, rng: random.Random, lo: int = 0, hi: int | None = None) -> str:
    data = bytearray(path.read_bytes())
    i = rng.randrange(lo, min(hi or len(data), len(data)))
    x = rng.randrange(1, 256)
    data[i] ^= x
    path.write_bytes(bytes(data))
    return f"byte {i} ^= {x:#04x}"


def digit(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    spots = [i for i, b in enumerate(data) if 48 <= b <= 57]
    if not spots:
        return flip(path, rng)
    i = rng.choice(spots)
    new = rng.choice([d for d in b"0123456789" if d != data[i]])
    data[i] = new
    path.write_bytes(bytes(data))
    return f"digit at {i} -> {chr(new)}"


def truncate(path: Path, rng: random.Random) -> str:
    n = rng.randrange(path.stat().st_size)
    os.truncate(path, n)
    return f"cut to {n} bytes"


def append(path: Path, rng: random.Random) -> str:
    extra = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    with open(path, "ab") as f:
        f.write(extra)
    return f"{len(extra)} bytes appended"


def delete(path: Path, rng: random.Random) -> str:
    path.unlink()
    return "deleted"


RAW = {"flip": flip, "digit": digit, "truncate": truncate, "append": append, "delete": delete}


def raw_kind(target: str, op: str) -> Kind:
    """A raw change to one file: ``target`` is a pack file kind, or ``yaml`` / ``routing``."""
    def apply(case: CaseFiles, rng: random.Random) -> Mutation:
        if target in ("yaml", "routing"):
            path = getattr(case, target)
        else:
            path = case.pack / rng.choice(pack_files(case, target))
        return Mutation(str(path.relative_to(case.root)), RAW[op](path, rng))
    return Kind(apply, routing=target == "routing")


# -- safetensors headers -------------------------------------------------------------------------
def _split(data: bytes) -> tuple[int, dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n]), data[8 + n :]


def _dense_changed(old: bytes, new: bytes) -> bool:
    """Whether ``new`` holds other tensors than ``old`` (False when it does not parse: that must be refused)."""
    try:
        a = safetensors.torch.load(new)
    except Exception:  # noqa: BLE001 (any parse failure: the load must refuse it)
        return False
    b = safetensors.torch.load(old)
    return a.keys() != b.keys() or any(a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k]) for k in a)


def header_kind(target: str, how: str) -> Kind:
    """A resealed change to a safetensors file's JSON header (``edit``) or its 8-byte length (``prefix``)."""
    def apply(case: CaseFiles, rng: random.Random) -> Mutation:
        name = rng.choice(pack_files(case, target))
        path = case.pack / name
        old = path.read_bytes()
        n, header, rest = _split(old)
        if how == "prefix":
            new_n = rng.choice((0, 1, n - 1, n + 1, n - 8, n + 8, len(old), len(old) - 8, 2**63, 2**64 - 1, rng.randrange(2**32)))
            new, keys, detail = struct.pack("<Q", new_n % 2**64) + old[8:], ("header",), f"length {n} -> {new_n % 2**64}"
        else:
            doc, keys, detail = mutate_json(header, rng)
            raw = json.dumps(doc, separators=(",", ":")).encode()
            raw += b" " * max(0, n - len(raw))  # as long as it was where it fits: every data offset stays
            new = struct.pack("<Q", len(raw)) + raw + rest
        path.write_bytes(new)
        reseal(case, name)
        changed = target == "dense" and _dense_changed(old, new)
        return Mutation(f"packed/{name}", detail, keys, changes_model=changed)
    return Kind(apply)


# -- manifest, carried JSON, routing: resealed structural edits -----------------------------------------
def manifest_edit(case: CaseFiles, rng: random.Random) -> Mutation:
    doc, keys, detail = mutate_json(manifest_doc(case), rng)
    write_manifest(case, doc, reseal="checksum" not in keys)
    return Mutation(f"packed/{MANIFEST}", detail, keys)


def manifest_prior(case: CaseFiles, rng: random.Random) -> Mutation:
    doc = manifest_doc(case)
    doc["routing_prior"], keys, detail = mutate_json(doc["routing_prior"], rng)
    write_manifest(case, doc)
    return Mutation(f"packed/{MANIFEST}", f"routing_prior {detail}", keys + ("routing_prior",))


def manifest_duplicate_key(case: CaseFiles, rng: random.Random) -> Mutation:
    text, keys = dump_with_duplicate(manifest_doc(case), rng)
    (case.pack / MANIFEST).write_text(text)
    return Mutation(f"packed/{MANIFEST}", f"key {keys} written twice", keys)


def _file_fields(doc: dict) -> list[tuple]:
    """Where the manifest names a file: the file tables' keys (path, None) and each reference's ``file`` (path, "file")."""
    tables = [(("dense", "files"), None), (("carried",), None), (("expert_files",), None)]
    refs = [(("layers", i, "experts", j, p), "file") for i, layer in enumerate(doc["layers"])
            for j, e in enumerate(layer["experts"]) for p in e if p != "expert"]
    return tables + refs


def _name_file(doc: dict, rng: random.Random, name: str) -> tuple[str, str]:
    """Make one file name the manifest uses ``name``; (the old name, the key)."""
    path, field = rng.choice(_file_fields(doc))
    box = _get(doc, path)
    if field is None:
        old = rng.choice(list(box))
        box[name] = box.pop(old)
        return old, path[-1]
    old, box["file"] = box["file"], name
    return old, "file"


def manifest_path(case: CaseFiles, rng: random.Random) -> Mutation:
    """A file name the manifest uses made absolute, upward, odd, or another file's."""
    doc = manifest_doc(case)
    name = rng.choice(NAMES + (str(case.pack / "config.json"), str(case.outside / "copy")))
    old, key = _name_file(doc, rng, name)
    write_manifest(case, doc)
    return Mutation(f"packed/{MANIFEST}", f"{old!r} named {name!r}", (key, name))


def manifest_link(case: CaseFiles, rng: random.Random) -> Mutation:
    """A file name the manifest uses pointed at a symlink in the pack that leads to an identical copy outside it."""
    doc = manifest_doc(case)
    old, key = _name_file(doc, rng, "linked")
    case.outside.mkdir(exist_ok=True)
    shutil.copy(case.pack / old, case.outside / "copy")
    new = str(Path(old).parent / "linked") if "/" in old else "linked"
    (case.pack / new).symlink_to(case.outside / "copy")
    text = json.dumps(doc).replace('"linked"', json.dumps(new))
    write_manifest(case, json.loads(text))
    return Mutation(f"packed/{MANIFEST}", f"{old!r} named {new!r}, a symlink out of the pack", (key, new))


def swap_refs(case: CaseFiles, rng: random.Random) -> Mutation:
    """Two experts' references (file, offset, crc32) exchanged, within a layer or across layers."""
    doc = manifest_doc(case)
    refs = [(i, j) for i, layer in enumerate(doc["layers"]) for j in range(len(layer["experts"]))]
    (a, b), (c, d) = rng.sample(refs, 2)
    x, y = doc["layers"][a]["experts"][b], doc["layers"][c]["experts"][d]
    x["bf16"], y["bf16"] = y["bf16"], x["bf16"]
    write_manifest(case, doc)
    return Mutation(f"packed/{MANIFEST}", f"refs of layers[{a}] expert {b} and layers[{c}] expert {d} swapped", ("offset", "expert"))


def carried_edit(case: CaseFiles, rng: random.Random) -> Mutation:
    name = rng.choice([n for n in pack_files(case, "carried") if n.endswith(".json")])
    path = case.pack / name
    old = json.loads(path.read_text())
    new, keys, detail = mutate_json(old, rng)
    path.write_text(json.dumps(new, indent=2))
    reseal(case, name)
    return Mutation(f"packed/{name}", detail, keys, changes_model=name == "config.json" and new != old)


GENERATION_KEYS = ("max_new_tokens", "max_length", "num_beams", "num_return_sequences", "temperature", "top_k", "top_p", "do_sample",
                   "pad_token_id", "eos_token_id", "bos_token_id", "cache_implementation", "watermarking_config", "compile_config",
                   "stop_strings", "use_cache")


def carried_generation(case: CaseFiles, rng: random.Random) -> Mutation:
    """One generation setting of the carried generation_config.json given an odd value, resealed."""
    path = case.pack / "generation_config.json"
    doc = json.loads(path.read_text())
    key = rng.choice(GENERATION_KEYS)
    doc[key] = _other(rng, doc.get(key)) if rng.random() < 0.5 else rng.choice(NUMBERS)
    path.write_text(json.dumps(doc, indent=2))
    reseal(case, "generation_config.json")
    return Mutation("packed/generation_config.json", f"{key}: {doc[key]!r}", (key,))


def routing_edit(case: CaseFiles, rng: random.Random) -> Mutation:
    doc, keys, detail = mutate_json(json.loads(case.routing.read_text()), rng)
    case.routing.write_text(json.dumps(doc))
    return Mutation("routing.json", detail, keys)
