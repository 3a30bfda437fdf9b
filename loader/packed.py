"""The packed checkpoint format (version 1): manifest, dense weights, per-layer expert files.

Owns: reading and validating ``manifest.json`` and naming what lies where. Layout::

    packed/
      manifest.json                                # written last: its presence marks a complete pack
      config.json, tokenizer files, ...            # carried through from the source
      dense-00001.safetensors, ...                 # every non-expert weight, under the model's own names
      experts/{precision}/layer-{L:04d}.safetensors

Each expert file is a valid safetensors file holding one uint8 tensor ``expert.{e}`` per
expert; its data section starts on a 4 KiB boundary and every blob is 4 KiB aligned, so the
manifest's (offset, nbytes) of a blob can be read with one pread or mmap slice.
"""
from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .blob import BlobLayout, blob_layout
from .layout import ExpertKey, ExpertLayout
from .routing import check_routing, load_routing, write_json

FORMAT = "tiers-packed"
VERSION = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class BlobRef:
    """One stored expert in one precision: where its blob is and how to check it."""

    file: str
    offset: int
    nbytes: int
    crc32: int
    sqnr_db: float | None = None


@dataclass(frozen=True)
class LayerEntry:
    layer: int
    module: str
    layout: ExpertLayout
    blobs: dict[str, BlobLayout]
    experts: tuple[dict[str, BlobRef], ...]


@dataclass(frozen=True)
class Manifest:
    root: Path
    model_type: str
    compute_dtype: str
    precisions: tuple[str, ...]
    layers: dict[int, LayerEntry]
    dense_files: dict[str, dict]
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
        return self.layers[key.layer].blobs[precision]


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


def _read_manifest(path: str | Path) -> tuple[Manifest, dict]:
    """The manifest without its routing prior, and the manifest's JSON as the file holds it (the
    prior there unchecked)."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"packed checkpoint {str(root)!r} is not a directory")
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise ValueError(f"{str(root)!r} is not a packed checkpoint (no {MANIFEST}); {_pack_hint(root)}")
    try:
        m = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{mpath}: not valid JSON ({e})") from None
    if m.get("format") != FORMAT:
        raise ValueError(f"{mpath}: format is {m.get('format')!r}, expected {FORMAT!r}")
    if m.get("version") != VERSION:
        raise ValueError(f"{mpath}: format version {m.get('version')!r} is not supported (this build reads {VERSION})")
    precisions = tuple(m["precisions"])
    layers: dict[int, LayerEntry] = {}
    for entry in m["layers"]:
        layout = ExpertLayout.from_json(entry["layout"])
        blobs = {}
        for p in precisions:
            bl = blob_layout(layout, p)
            if bl.to_json() != entry["blobs"][p]:
                raise ValueError(f"{mpath}: layer {entry['layer']} {p} blob layout differs from this build's; re-pack")
            blobs[p] = bl
        experts = tuple(
            {p: BlobRef(**e[p]) for p in precisions} for e in sorted(entry["experts"], key=lambda e: e["expert"])
        )
        if len(experts) != layout.num_experts:
            raise ValueError(f"{mpath}: layer {entry['layer']} lists {len(experts)} experts, layout says {layout.num_experts}")
        layers[int(entry["layer"])] = LayerEntry(int(entry["layer"]), entry["module"], layout, blobs, experts)
    return Manifest(
        root=root,
        model_type=m["model_type"],
        compute_dtype=m["compute_dtype"],
        precisions=precisions,
        layers=layers,
        dense_files=m["dense"]["files"],
        pack=m.get("pack", {}),
        skipped_keys=tuple(m.get("skipped_keys", [])),
        routing_prior=None,
    ), m


def manifest_json(
    *, model_type: str, precisions: list[str], layers: list[dict], dense_files: dict, pack: dict, skipped_keys: list[str],
    routing_prior: Mapping | None = None,
) -> str:
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "model_type": model_type,
        "compute_dtype": "bfloat16",
        "precisions": precisions,
        "dense": {"files": dense_files},
        "layers": layers,
        "pack": pack,
        "skipped_keys": skipped_keys,
        "routing_prior": None if routing_prior is None else dict(routing_prior),
    }
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
    write_json(m, manifest.root / MANIFEST, indent=1)
    return read_manifest(path)
