"""Tiers: serve MoE experts from GPU (bf16), pinned CPU (int8) and NVMe tiers.

    model = tiers.load("packed/", config="tiers.yaml")
    model.generate(...)
    print(tiers.stats(model))
    tiers.save_routing(model, "routing.json")  # with the rebalancer on; load(..., routing=) starts from it
"""
from tiers.config import TiersConfig, load_config
from tiers.disk_store import IntegrityError
from tiers.integration import load, routing_counts, save_routing, stats
from tiers.stats import TierStats
from tiers.step_graph import graph_safe

__all__ = ["IntegrityError", "TierStats", "TiersConfig", "graph_safe", "load", "load_config", "routing_counts", "save_routing", "stats"]
