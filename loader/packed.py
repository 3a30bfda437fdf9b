"""The packed checkpoint format (version 2): manifest, dense weights, per-layer expert files.

Owns: the ``Manifest`` that names what lies where, reading it (through the checking parser of
``loader.manifest_parse``) and writing it (with its checksum). Layout::

    packed/
      manifest.json                                # written last: its presence marks a complete pack
      config.json, tokenizer files, ...            # carried through from the source, checksummed
      dense-00001.safetensors, ...                 # every non-expert weight, under the model's own names
      experts/{precision}/layer-{L:04d}.safetensors

Each expert file is a valid safetensors file holding one uint8 tensor ``expert.{e}`` per
expert; its data section starts on a 4 KiB boundary and every blob is 4 KiB aligned, so the
manifest's (offset, nbytes) of a blob can be read with one pread or mmap slice. The files
themselves are checked against the manifest by ``loader.pack_files.verify_files``.
"""
from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .blob import BlobLayout
from .layout import ExpertKey, ExpertLayout
from .manifest_parse import FORMAT, VERSION, FormatError, Parser, checksum, parse_head, parse_layers
from .shown import show
from .routing import check_routing, load_routing, write_json

MANIFEST = "manifest.json"
__all__ = ["FORMAT", "VERSION", "MANIFEST", "FormatError", "BlobRef", "LayerEntry", "Manifest", "read_manifest", "manifest_json",
           "set_routing_prior", "routing_prior", "file_crc32"]


@dataclass(frozen=True)
class BlobRef:
    """One stored expert in one precision: where its blob is and how to check it. ``encoding``: the
    precision whose blob layout its bytes use, where pack kept the expert at a higher precision
    (``pack(min_sqnr=)``; the bytes are that precision's blob of the expert); None: its own."""

    file: str
    offset: int
    nbytes: int
    crc32: int
    sqnr_db: float | None = None
    encoding: str | None = None


@dataclass(frozen=True)
class LayerEntry:
    layer: int
    module: str
    layout: ExpertLayout
    blobs: dict[str, BlobLayout]
    experts: tuple[dict[str, BlobRef], ...]

    @cached_property
    def encodings(self) -> dict[str, dict[str, int]]:
        """Per precision: how many of the layer's experts use each encoding's blob layout for it
        (``{"int4": {"int4": 60, "int8": 4}}`` where pack kept 4 experts at int8)."""
        out: dict[str, dict[str, int]] = {p: {} for p in self.blobs}
        for refs in self.experts:
            for p, ref in refs.items():
                enc = ref.encoding or p
                out[p][enc] = out[p].get(enc, 0) + 1
        return out

    def largest(self, precision: str) -> BlobLayout:
        """The largest blob layout the layer's experts use for ``precision`` (what a buffer for any
        of them must hold)."""
        return max((self.blobs[enc] for enc in self.encodings[precision]), key=lambda b: (b.stride, b.nbytes))


@dataclass(frozen=True)
class Manifest:
    root: Path
    model_type: str
    compute_dtype: str
    precisions: tuple[str, ...]
    layers: dict[int, LayerEntry]
    dense_files: dict[str, dict]  # name -> {crc32, nbytes}
    carried: dict[str, dict]  # config and tokenizer files: name -> {crc32, nbytes}
    expert_files: dict[str, dict]  # name -> {header_crc32, header_bytes, nbytes}
    pack: dict
    skipped_keys: tuple[str, ...]
    routing_prior: dict[int, list[float]] | None  # the embedded routing document's counts per layer

    @property
    def experts_per_layer(self) -> dict[int, int]:
        return {L: entry.layout.num_experts for L, entry in self.layers.items()}

    @property
    def keys(self) -> list[ExpertKey]:
        return [ExpertKey(L, e) for L, entry in self.layers.items() for e in range(entry.layout.num_experts)]

    def ref(self, key: ExpertKey, precision: str) -> BlobRef:
        return self.layers[key.layer].experts[key.expert][precision]

    def blob(self, key: ExpertKey, precision: str) -> BlobLayout:
        """The layout of ``key``'s blob for ``precision``: that precision's, or the encoding's its bytes use."""
        entry = self.layers[key.layer]
        return entry.blobs[entry.experts[key.expert][precision].encoding or precision]


def file_crc32(path: Path, chunk: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb") as f:
        while data := f.read(chunk):
            crc = zlib.crc32(data, crc)
    return crc


def read_manifest(path: str | Path) -> Manifest:
    """The packed checkpoint at ``path``, its manifest checked (a routing prior included)."""
    manifest, raw = _read_manifest(path)
    prior = raw.get("routing_prior")
    if prior is None:
        return manifest
    mpath = manifest.root / MANIFEST
    try:
        counts = check_routing(prior, manifest.experts_per_layer, f"{mpath}: routing_prior", str(manifest.root))
    except ValueError as e:
        raise ValueError(f"{e} (replace it with `python tools/pack.py {manifest.root} --set-routing FILE`, "
                         f"or remove it with `--clear-routing`)") from None
    return dataclasses.replace(manifest, routing_prior=counts)


def _pack_hint(root: Path) -> str:
    """How to make a packed checkpoint, never suggesting a pack into its own source."""
    if (root / "config.json").is_file():
        return (f"it looks like a Hugging Face checkpoint: pack it into a separate directory first, "
                f"`python tools/pack.py {root} {root}-packed`, and load that")
    return "pack a Hugging Face checkpoint first with `python tools/pack.py SRC DST` (DST a new directory, apart from SRC) and load DST"


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise _DuplicateKey(next(k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i])))
    return d


def _read_manifest(path: str | Path) -> tuple[Manifest, dict]:
    """The manifest without its routing prior, and the manifest's JSON as the file holds it (the
    prior there unchecked)."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"packed checkpoint {str(root)!r} is not a directory")
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise ValueError(f"{str(root)!r} is not a packed checkpoint (no {MANIFEST}); {_pack_hint(root)}")
    try:  # like every file the manifest names, the manifest itself is read only from inside the directory
        mpath.resolve().relative_to(root.resolve())
    except (ValueError, OSError, RuntimeError):
        raise FormatError(f"{mpath}: resolves outside the pack directory (a symlink out of it); re-pack") from None
    try:
        m = json.loads(mpath.read_bytes(), object_pairs_hook=_unique_keys)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise FormatError(f"{mpath}: not valid JSON ({show(str(e))})") from None
    except _DuplicateKey as e:
        raise FormatError(f"{mpath}: key {show(e.args[0])} appears twice in one object") from None
    p = Parser(root, mpath)
    head = parse_head(p, m)
    layers = {L: LayerEntry(L, module, layout, blobs, tuple({k: BlobRef(**v) for k, v in e.items()} for e in refs))
              for L, module, layout, blobs, refs in parse_layers(p, m, head)}
    skipped = m.get("skipped_keys", [])
    if not isinstance(skipped, list) or not all(isinstance(k, str) for k in skipped):
        raise p.fail("skipped_keys", f"expected a list of strings, got {show(skipped)}")
    pack = m.get("pack", {})
    if not isinstance(pack, dict):
        raise p.fail("pack", f"expected an object, got {show(pack)}")
    return Manifest(root=root, model_type=m["model_type"], compute_dtype=m["compute_dtype"], precisions=head["precisions"],
                    layers=dict(sorted(layers.items())), dense_files=head["dense"], carried=head["carried"],
                    expert_files=head["expert_files"], pack=pack, skipped_keys=tuple(skipped), routing_prior=None), m


def manifest_json(
    *, model_type: str, precisions: list[str], layers: list[dict], dense_files: dict, carried: dict, expert_files: dict, pack: dict,
    skipped_keys: list[str], routing_prior: Mapping | None = None,
) -> str:
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "model_type": model_type,
        "compute_dtype": "bfloat16",
        "precisions": precisions,
        "dense": {"files": dense_files},
        "carried": carried,
        "expert_files": expert_files,
        "layers": layers,
        "pack": pack,
        "skipped_keys": skipped_keys,
        "routing_prior": None if routing_prior is None else dict(routing_prior),
    }
    doc["checksum"] = checksum(doc)
    return json.dumps(doc, indent=1)


def routing_prior(routing: str | Path | Mapping, experts: Mapping[int, int], checkpoint: str) -> dict:
    """The routing prior a manifest embeds for ``routing`` (a routing file's path or its parsed
    document), after checking it against a checkpoint whose MoE layers have ``experts[layer]``
    experts (``loader.routing.check_routing``; errors name the file, the layer and the expert)."""
    doc, name = load_routing(routing)
    check_routing(doc, experts, name, checkpoint)
    return {k: doc[k] for k in ("format", "version", "tokens", "counts") if k in doc}


def set_routing_prior(path: str | Path, routing: str | Path | Mapping | None) -> Manifest:
    """Embed a routing document (a file path or its parsed form) in the packed checkpoint at
    ``path`` as its routing prior, or remove the prior with ``None``, and return the manifest as
    it now reads. The document is checked against the checkpoint's MoE layers first; the manifest
    is then replaced whole (a temporary file beside it, renamed over it), so it is always either
    the old manifest or the new one. Nothing else in the checkpoint changes. The prior it replaces
    need not be valid."""
    manifest, m = _read_manifest(path)
    m["routing_prior"] = None if routing is None else routing_prior(routing, manifest.experts_per_layer, str(manifest.root))
    m["checksum"] = checksum(m)
    write_json(m, manifest.root / MANIFEST, indent=1)
    return read_manifest(path)
