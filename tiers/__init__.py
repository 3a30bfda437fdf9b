"""Tiers: serve Mixture-of-Experts experts from GPU slots, a pinned CPU pool and NVMe.

    model = tiers.load("packed/", config="tiers.yaml")
    model.generate(...)
    print(tiers.stats(model))
    tiers.manifest(model)                       # what every tier and slot holds, as plain data
    tiers.save_routing(model, "routing.json")  # with the rebalancer on; load(..., routing=) starts from it
"""
from pathlib import Path as _Path

# One top-level name: the quant/, loader/ and tools/ folders beside this one install as tiers.quant,
# tiers.loader and tiers.tools (pyproject's package-dir). A source checkout used without installing
# (PYTHONPATH=.) finds them beside this folder instead.
_root = _Path(__file__).resolve().parent.parent
if (_root / "quant" / "__init__.py").is_file() and not (_root / "tiers" / "quant").exists():
    __path__.append(str(_root))  # noqa: F821 (a package's own search path)

from tiers.api import load, manifest, routing_counts, save_routing, stats  # noqa: E402
from tiers.config import TiersConfig, load_config  # noqa: E402
from tiers.graphs.step_graphs import graph_safe  # noqa: E402
from tiers.stats import TierStats  # noqa: E402
from tiers.loader.manifest_parse import FormatError  # noqa: E402
from tiers.loader.pack_files import IntegrityError  # noqa: E402

__all__ = ["FormatError", "IntegrityError", "TierStats", "TiersConfig", "graph_safe", "load", "load_config", "manifest", "routing_counts",
           "save_routing", "stats"]
