"""Tiers: serve MoE experts from GPU (bf16), pinned CPU (int8) and NVMe tiers.

    model = tiers.load("packed/", config="tiers.yaml")
    model.generate(...)
    print(tiers.stats(model))
    tiers.save_routing(model, "routing.json")  # with the rebalancer on; load(..., routing=) starts from it
"""
from pathlib import Path as _Path

# One top-level name: the quant/, loader/ and tools/ folders beside this one install as tiers.quant,
# tiers.loader and tiers.tools (pyproject's package-dir). A source checkout used without installing
# (PYTHONPATH=.) finds them beside this folder instead.
_root = _Path(__file__).resolve().parent.parent
if (_root / "quant" / "__init__.py").is_file() and not (_root / "tiers" / "quant").exists():
    __path__.append(str(_root))  # noqa: F821 (a package's own search path)

from tiers.config import TiersConfig, load_config
from tiers.disk_store import IntegrityError
from tiers.integration import load, routing_counts, save_routing, stats
from tiers.stats import TierStats
from tiers.step_graph import graph_safe

__all__ = ["IntegrityError", "TierStats", "TiersConfig", "graph_safe", "load", "load_config", "routing_counts", "save_routing", "stats"]
