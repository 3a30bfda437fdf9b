"""Routing documents: lookups counted per expert, ranking which experts a load places hot first.

Owns: the document's format (``ROUTING_FORMAT``, version 1), writing one atomically, and
checking one against a checkpoint's MoE layers. The same document is a routing file
(``tiers.save_routing`` writes it, ``tiers.load(..., routing=)`` reads it) and, embedded in a
packed checkpoint's manifest, its routing prior (``tools/pack.py --routing``), which a load
without a routing file ranks by.

    {"format": "tiers-routing", "version": 1, "tokens": int, "counts": {"<layer>": [lookups per expert]}}
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from .shown import show

ROUTING_FORMAT = "tiers-routing"
ROUTING_VERSION = 1


def routing_document(counts: Mapping[int, Sequence[int]], tokens: int) -> dict:
    """A routing document: ``counts`` (layer -> lookups per expert) over ``tokens`` tokens."""
    return {"format": ROUTING_FORMAT, "version": ROUTING_VERSION, "tokens": int(tokens),
            "counts": {str(L): [int(c) for c in row] for L, row in sorted(counts.items())}}


def write_routing(doc: dict, path: str | Path) -> Path:
    """Write a routing document as JSON, atomically (``write_json``)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"routing file {str(path)!r} is a directory")
    return write_json(doc, path)


def write_json(obj: object, path: str | Path, indent: int | None = None) -> Path:
    """Write ``obj`` as JSON so that a file of that name is either the old one or the whole new
    one, never a partial write: into a temporary file beside it, synced, then renamed over it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=indent)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_routing(source: str | Path | Mapping) -> tuple[Mapping, str]:
    """A routing document from a file path or an already-parsed mapping, with the name errors
    about it use (``routing file '<path>'`` or ``routing``). The document is not checked yet."""
    if isinstance(source, (str, Path)):
        name = f"routing file {str(source)!r}"
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"{name} does not exist" if not path.exists() else f"{name} is not a file")
        try:
            return json.loads(path.read_text(encoding="utf-8")), name
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if isinstance(source, Mapping):
        return source, "routing"
    raise ValueError(f"routing: expected a file path or a parsed routing document, got {type(source).__name__}")


def read_routing(source: str | Path | Mapping, manifest) -> dict[int, list[float]]:
    """A routing file (a path, or its parsed document) as counts per layer, checked against the
    packed checkpoint ``manifest`` (a ``loader.packed.Manifest``) by ``check_routing``."""
    doc, name = load_routing(source)
    return check_routing(doc, manifest.experts_per_layer, name, str(manifest.root))


def _count(c: object) -> bool:
    """A lookup count: a finite number >= 0 (an integer below 2**63, which converts to a float)."""
    if isinstance(c, bool) or not isinstance(c, (int, float)):
        return False
    return 0 <= c < 2**63 if isinstance(c, int) else math.isfinite(c) and c >= 0


def check_routing(doc: object, experts: Mapping[int, int], name: str, checkpoint: str) -> dict[int, list[float]]:
    """A routing document's counts per layer, checked against a checkpoint whose MoE layers have
    ``experts[layer]`` experts: every layer it names must be one of them, with one non-negative
    count per expert, and it must count at least one lookup. Layers it leaves out are absent
    from the result (a ranking takes them as evenly routed). Errors name ``name``, the layer and
    the expert; ``checkpoint`` names the checkpoint in them."""
    if not isinstance(doc, Mapping) or doc.get("format") != ROUTING_FORMAT:
        raise ValueError(f"{name}: not a Tiers routing file (expected \"format\": {ROUTING_FORMAT!r}; write one with tiers.save_routing)")
    if doc.get("version") != ROUTING_VERSION:
        raise ValueError(f"{name}: version {doc.get('version')!r} is not supported (expected {ROUTING_VERSION})")
    counts = doc.get("counts")
    if not isinstance(counts, Mapping):
        raise ValueError(f"{name}: \"counts\" must map each layer to its experts' lookup counts, got {type(counts).__name__}")
    out: dict[int, list[float]] = {}
    for key, row in counts.items():
        try:
            layer = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"{name}: counts key {key!r} is not a layer index") from None
        if layer not in experts:
            raise ValueError(f"{name}: layer {layer} is not a MoE layer of {checkpoint!r} (its MoE layers: {sorted(experts)})")
        n = experts[layer]
        if not isinstance(row, Sequence) or isinstance(row, str) or len(row) != n:
            got = len(row) if isinstance(row, Sequence) and not isinstance(row, str) else type(row).__name__
            raise ValueError(f"{name}: layer {layer} has {n} experts in the checkpoint, the file counts {got}")
        for e, c in enumerate(row):
            if not _count(c):
                raise ValueError(f"{name}: layer {layer}, expert {e}: expected a count >= 0, got {show(c)}")
        out[layer] = [float(c) for c in row]
    if not any(c > 0 for row in out.values() for c in row):
        raise ValueError(f"{name}: counts no lookups; it cannot rank the experts")
    return out
