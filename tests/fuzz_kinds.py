"""Every fuzz mutation kind by name (``KINDS``), with the YAML, file-system and after-load kinds that are not JSON edits.

YAML is changed as text, line by line, where its surprises live: YAML 1.1 scalars (``on``, ``no``,
``0x10``, ``1:30``, dates), tags, typos and duplicates of keys, indentation, alias bombs, deep
nesting. File-system kinds put a symlink out of the pack, a FIFO, a directory or a device where a
file was, or exchange two files. ``after.*`` kinds change the expert files (or others) of a loaded
pack between two forwards; the harness loads those with ``verify="always"``, which checks every
cold read (the default checks a blob again only once its file's stamp changed: docs/format.md).
``Kind.weight`` is a kind's share of a plan's cases.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import replace
from pathlib import Path

from fuzz_mutations import (CaseFiles, Kind, Mutation, header_kind, raw_kind, carried_edit, carried_generation, flip, manifest_doc, manifest_duplicate_key,
                            manifest_edit, manifest_link, manifest_path, manifest_prior, pack_files, routing_edit, swap_refs, truncate)

YAML = """\
# every tier in bf16: a load serves bit-identical logits from any placement
tiers:
  gpu:
    fraction: 0.25
    precision: bf16
    staging_slots: auto
    graphs: true
  cpu:
    fraction: 0.25
    precision: bf16
  nvme:
    precision: bf16
  rebalance:
    every_tokens: 0
    window: 64
    max_moves: 8
"""

YAML_VALUES = ("yes", "no", "on", "off", "y", "n", "~", "null", "", "0x10", "0o17", "017", "1_000", "1:30", "190:20:30", ".5", "0.25e0",
               ".nan", ".inf", "-.inf", "1e400", "99999999999999999999999", "-0.25", "1.5", "0", "1", "true", "false", "2024-01-01",
               "2001-12-14t21:59:43.10-05:00", "'0.25'", '"bf16"', "[0.25]", "{a: 1}", "[]", "{}", "24GiB", "-5MB", "0.5 GiB", "1e3 MB",
               "1GiB", "8 B", "nan", "inf", "bf16", "int8", "nf4", "bnb8", "auto", "!!binary aGVsbG8=", "!!float 1", "!!int 0x10",
               "!!str 0.25", "!!set {a}", "!!omap [a: 1]", "!!python/object/apply:os.system ['true']", "!!python/name:os.system",
               "&a 0.25", "*a", "|\n      text", '"\\x00"', "\t0.25", "0.25 # comment", "0.25: 1", "- 0.25", "? 0.25", "%TAG", "@", "`x`")


def _lines(text: str) -> list[tuple[int, str, str]]:
    """(line index, dotted key, value) of every ``key: value`` line of the YAML text."""
    out, stack = [], []
    for i, line in enumerate(text.splitlines()):
        m = re.match(r"^( *)([A-Za-z_]+):(.*)$", line)
        if not m:
            continue
        depth = len(m[1]) // 2
        stack[depth:] = [m[2]]
        out.append((i, ".".join(stack), m[3].strip()))
    return out


def _yaml_edit(case: CaseFiles, rng: random.Random, change) -> Mutation:
    lines = case.yaml.read_text().splitlines()
    i, key, value = rng.choice(_lines(case.yaml.read_text()))
    detail = change(lines, i, key, value, rng)
    case.yaml.write_text("\n".join(lines) + "\n")
    return Mutation("tiers.yaml", detail, (key,))


def _value(lines: list[str], i: int, key: str, value: str, rng: random.Random) -> str:
    new = rng.choice(YAML_VALUES)
    head = lines[i].split(":", 1)[0]
    if not value:  # a section: its value replaced, its children kept (or dropped)
        if rng.random() < 0.5:
            depth = len(head) - len(head.lstrip())
            while i + 1 < len(lines) and len(lines[i + 1]) - len(lines[i + 1].lstrip()) > depth:
                del lines[i + 1]
    lines[i] = f"{head}: {new}"
    return f"{key}: {value!r} -> {new!r}"


def _key_change(lines: list[str], i: int, key: str, value: str, rng: random.Random) -> str:
    head, _, rest = lines[i].partition(":")
    name = head.strip()
    indent = head[: len(head) - len(head.lstrip())]
    op = rng.choice(("typo", "drop", "twice", "indent", "unknown", "tab"))
    if op == "typo":
        new = rng.choice((name[:-1], name.upper(), name + "s", name.replace("_", "-"), name.capitalize(), f"'{name}'", f"{name} "))
        lines[i] = f"{indent}{new}:{rest}"
        return f"{key}: renamed {new!r}"
    if op == "drop":
        del lines[i]
        return f"{key}: line removed"
    if op == "twice":
        other = rest if rng.random() < 0.5 else f" {rng.choice(YAML_VALUES)}"
        lines.insert(i + 1, f"{indent}{name}:{other}")
        return f"{key}: written twice ({other.strip()!r} second)"
    if op == "indent":
        lines[i] = rng.choice(("  ", " ", "")) + lines[i] if rng.random() < 0.5 else lines[i][2:]
        return f"{key}: indentation changed"
    if op == "tab":
        lines[i] = "\t" + lines[i].lstrip(" ")
        return f"{key}: indented with a tab"
    lines.insert(i + 1, f"{indent}{rng.choice(('fractions', 'budget', 'precision', 'tiers', 'extra', 'gpu'))}: {rng.choice(YAML_VALUES)}")
    return f"{key}: a key inserted after it"


def yaml_value(case: CaseFiles, rng: random.Random) -> Mutation:
    return _yaml_edit(case, rng, _value)


def yaml_key(case: CaseFiles, rng: random.Random) -> Mutation:
    return _yaml_edit(case, rng, _key_change)


def yaml_document(case: CaseFiles, rng: random.Random) -> Mutation:
    """The whole document replaced by another shape: empty, a list, a scalar, two documents, flow style, binary."""
    text = case.yaml.read_text()
    new = rng.choice(("", "---\n", "---\n---\n", text + "---\n" + text, "- tiers\n", "tiers\n", "tiers: 3\n", "null\n", "[]\n", "42\n",
                      "tiers: {gpu: {fraction: 0.25, precision: bf16}, cpu: {fraction: 0.25, precision: bf16}, nvme: {precision: bf16}}\n",
                      "tiers: [gpu, cpu]\n", "\ufeff" + text, text.replace("\n", "\r\n"), text.replace("  ", "\t"), "\x00\x01\x02",
                      text[: len(text) // 2] + "\xff\xfe", "tiers:\n  gpu:\n    fraction: 0.25\n  gpu:\n    fraction: 0.5\n"))
    case.yaml.write_bytes(new.encode("utf-8", "surrogateescape") if "\xff" not in new else new.encode("latin-1"))
    return Mutation("tiers.yaml", f"document replaced ({len(new)} characters)", ("config", "tiers"))


def yaml_alias(case: CaseFiles, rng: random.Random) -> Mutation:
    """An alias bomb (nested anchors, each level 9 aliases of the last: 9^depth elements) as one key's value."""
    depth, width = rng.randint(5, 9), 9
    levels = [f"&l{d} [" + ", ".join([f"*l{d - 1}" if d else "x"] * width) + "]" for d in range(depth)]
    return _yaml_edit(case, rng, lambda lines, i, key, value, rng: _set(lines, i, key, "[" + ", ".join(levels) + "]",
                                                                      f"alias bomb of {width}^{depth} elements"))


def yaml_deep(case: CaseFiles, rng: random.Random) -> Mutation:
    """One key's value nested ``n`` deep (lists or mappings)."""
    n = rng.choice((10, 100, 300, 1000, 5000))
    value = "[" * n + "]" * n if rng.random() < 0.5 else "{a: " * n + "1" + "}" * n
    return _yaml_edit(case, rng, lambda lines, i, key, old, rng: _set(lines, i, key, value, f"nested {n} deep"))


def _set(lines: list[str], i: int, key: str, value: str, detail: str) -> str:
    lines[i] = f"{lines[i].split(':', 1)[0]}: {value}"
    return f"{key}: {detail}"


# -- the file system -----------------------------------------------------------------------------
def _any_entry(case: CaseFiles, rng: random.Random) -> str:
    return rng.choice(pack_files(case, "manifest") + pack_files(case, "dense") + pack_files(case, "expert") + pack_files(case, "carried")
                      + ["experts", "experts/bf16"])


def files_symlink(case: CaseFiles, rng: random.Random) -> Mutation:
    """A pack file or folder moved out of the pack, an identical copy, and a symlink left in its place."""
    name = _any_entry(case, rng)
    path, target = case.pack / name, case.outside / name.replace("/", "_")
    case.outside.mkdir(exist_ok=True)
    shutil.move(path, target)
    path.symlink_to(target)
    return Mutation(f"packed/{name}", "a symlink to an identical copy outside the pack")


def files_swap(case: CaseFiles, rng: random.Random) -> Mutation:
    """Two pack files of one kind (expert files, carried files) exchanged."""
    kind = rng.choice(("expert", "carried"))
    a, b = rng.sample(pack_files(case, kind), 2)
    pa, pb, tmp = case.pack / a, case.pack / b, case.pack / "swap.tmp"
    os.replace(pa, tmp)
    os.replace(pb, pa)
    os.replace(tmp, pb)
    return Mutation(f"packed/{a}", f"exchanged with {b}", (b,))


def files_special(case: CaseFiles, rng: random.Random) -> Mutation:
    """A pack file replaced by a FIFO, a folder, a device, a dangling or looping symlink, or an empty file."""
    name = _any_entry(case, rng)
    path = case.pack / name
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    what = rng.choice(("fifo", "folder", "/dev/zero", "/dev/null", "dangling", "loop", "empty"))
    if what == "fifo":
        os.mkfifo(path)
    elif what == "folder":
        path.mkdir()
    elif what == "dangling":
        path.symlink_to(case.outside / "missing")
    elif what == "loop":
        path.symlink_to(path)
    elif what == "empty":
        path.write_bytes(b"")
    else:
        path.symlink_to(what)
    return Mutation(f"packed/{name}", f"replaced by {what}")


# -- after load ----------------------------------------------------------------------------------
def _blob(case: CaseFiles, rng: random.Random) -> tuple[str, int, int]:
    """A random expert's (file, offset, nbytes)."""
    layer = rng.choice(manifest_doc(case)["layers"])
    ref = rng.choice(layer["experts"])["bf16"]
    return ref["file"], ref["offset"], ref["nbytes"]


def after_expert(case: CaseFiles, rng: random.Random) -> Mutation:
    """An expert file changed under a loaded model: a blob's byte flipped or zeroed in place, the file
    cut, deleted, replaced by a changed copy (a new inode), or by a symlink out of the pack."""
    name, offset, nbytes = _blob(case, rng)
    path = case.pack / name
    op = rng.choice(("flip", "flip", "zero", "truncate", "delete", "replace", "symlink"))
    if op == "flip":
        return Mutation(f"packed/{name}", "after load: " + flip(path, rng, offset, offset + nbytes))
    if op == "truncate":
        return Mutation(f"packed/{name}", "after load: " + truncate(path, rng))
    if op == "delete":
        path.unlink()
        return Mutation(f"packed/{name}", "after load: deleted")
    data = bytearray(path.read_bytes())
    data[offset : offset + nbytes] = bytes(nbytes)
    if op == "zero":
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(bytes(nbytes))
        return Mutation(f"packed/{name}", f"after load: blob at {offset} zeroed in place")
    case.outside.mkdir(exist_ok=True)
    copy = case.outside / "changed"
    copy.write_bytes(bytes(data))
    if op == "replace":
        os.replace(copy, path)
        return Mutation(f"packed/{name}", f"after load: replaced by a copy with the blob at {offset} zeroed")
    path.unlink()
    path.symlink_to(copy)
    return Mutation(f"packed/{name}", f"after load: a symlink out of the pack, the blob at {offset} zeroed")


def after_other(case: CaseFiles, rng: random.Random) -> Mutation:
    """The manifest, a dense or a carried file flipped, cut or deleted under a loaded model."""
    name = rng.choice(pack_files(case, "manifest") + pack_files(case, "dense") + pack_files(case, "carried"))
    path = case.pack / name
    op = rng.choice(("flip", "truncate", "delete"))
    detail = flip(path, rng) if op == "flip" else truncate(path, rng) if op == "truncate" else (path.unlink(), "deleted")[1]
    return Mutation(f"packed/{name}", f"after load: {detail}")


TARGETS = ("manifest", "dense", "expert", "carried", "routing", "yaml")
KINDS: dict[str, Kind] = {
    **{f"{t}.{op}": raw_kind(t, op) for t in TARGETS for op in ("flip", "digit", "truncate", "delete")},
    "dense.append": raw_kind("dense", "append"),
    "expert.append": raw_kind("expert", "append"),
    "manifest.edit": Kind(manifest_edit, weight=4),
    "manifest.duplicate_key": Kind(manifest_duplicate_key),
    "manifest.path": Kind(manifest_path),
    "manifest.link": Kind(manifest_link),
    "manifest.swap_refs": Kind(swap_refs),
    "manifest.prior": Kind(manifest_prior),
    "dense.header": replace(header_kind("dense", "edit"), weight=2),
    "dense.prefix": header_kind("dense", "prefix"),
    "expert.header": replace(header_kind("expert", "edit"), weight=2),
    "expert.prefix": header_kind("expert", "prefix"),
    "carried.edit": Kind(carried_edit, weight=2),
    "carried.generation": Kind(carried_generation),
    "routing.edit": Kind(routing_edit, routing=True, weight=2),
    "files.symlink": Kind(files_symlink),
    "files.special": Kind(files_special),
    "files.swap": Kind(files_swap),
    "yaml.value": Kind(yaml_value, weight=2),
    "yaml.key": Kind(yaml_key, weight=2),
    "yaml.document": Kind(yaml_document),
    "yaml.alias": Kind(yaml_alias),
    "yaml.deep": Kind(yaml_deep),
    "after.expert": Kind(after_expert, after_load=True, weight=4),
    "after.other": Kind(after_other, after_load=True),
}


def plan(cases: int, seed: int, kinds: dict[str, Kind] | None = None) -> list[tuple[str, int]]:
    """``cases`` (kind, seed) pairs: the kinds in turn, each as often as its weight, the seeds ``seed``, ``seed + 1``, ..."""
    kinds = KINDS if kinds is None else kinds
    wheel = [name for name in sorted(kinds) for _ in range(kinds[name].weight)]
    return [(wheel[i % len(wheel)], seed + i) for i in range(cases)]


def write_base(root: Path, routing: dict) -> None:
    """The YAML config and routing file every case starts from (beside the pack)."""
    (root / "tiers.yaml").write_text(YAML)
    (root / "routing.json").write_text(json.dumps(routing))
