"""The bench's one door into the runtime's internals: the manager behind a loaded model and its counters.

Also the cache policy's replays against Belady's MIN and the placement's transit rows. The rest
of ``tools/bench*.py`` uses the public API (``tiers.load``, ``tiers.stats``,
``tiers.routing_counts``) and the packed manifest, so a change to the runtime's internals is
adapted here (and in ``tools.timeline``, whose marks wrap the manager's collaborators).
"""
from __future__ import annotations

import contextlib

from tiers import report
from tiers.api import manager_of
from tiers.policy.placement import transit_rows
from tiers.policy.slot_cache import belady_hits, replay
from tiers.tools.timeline import marked_prefill, rebalancer_change, rebalancer_counts
from tiers.tools.trace import TraceModel, lookups

__all__ = ["Manager", "belady", "staging_only_gpu", "synthetic_replays"]


class Manager:
    """The manager behind a model ``tiers.load`` returned, as the bench reads it: its counters,
    a counted run's routing trace, its hot set, its whole-layer graphs' counts."""

    def __init__(self, mgr):
        self.mgr = mgr

    @classmethod
    def of(cls, model) -> Manager:
        return cls(manager_of(model))

    def reset_stats(self) -> None:
        self.mgr.reset_stats()

    def stats(self):
        """Its ``TierStats`` (what ``tiers.stats`` of its model returns)."""
        return report.stats(self.mgr)

    @property
    def rebalancing(self) -> bool:
        return self.mgr.rebalancer is not None

    def rebalancer_counts(self) -> dict[str, int]:
        return rebalancer_counts(self.mgr)

    def rebalancer_change(self, before: dict[str, int]) -> dict[str, int]:
        return rebalancer_change(self.mgr, before)

    @contextlib.contextmanager
    def recording(self):
        """Yields a list that, after the block, holds every lookup the manager made in it (its
        routing trace)."""
        trace: list = []
        self.mgr.slots.recorded = []
        try:
            yield trace
        finally:
            trace.extend(self.mgr.slots.recorded)
            self.mgr.slots.recorded = None

    def cache_vs_belady(self, trace: list, capacity: int) -> list[int]:
        """Hits of the cache policy over ``capacity`` staging slots replayed on ``trace``, the hot
        set pinned, and of Belady's MIN over the same."""
        hot = set(self.mgr.placement.hot)
        return [replay(trace, capacity, hot), belady_hits(trace, capacity, hot)]

    def prefill_counters(self) -> dict[str, int]:
        """Running totals a prefill's notes take the change of: whole-layer graphs run eagerly,
        captured and replayed, and the bytes queued for reading (no sync, no settling)."""
        g = self.mgr.prefill_graphs
        return {"graphs_eager": g.eager_calls, "graphs_captured": g.captured, "graphs_replayed": g.replayed,
                "queued_bytes": sum(self.mgr.stats_.bytes_moved.values())}

    def marked_prefill(self, model, ids) -> dict:
        """``tools.timeline.marked_prefill`` of ``model`` on ``ids``."""
        return marked_prefill(model, self.mgr, ids)

    def close(self) -> None:
        self.mgr.close()


def belady(trace: list, slots: int) -> int:
    """Hits of Belady's MIN over ``slots`` slots on ``trace``, nothing pinned."""
    return belady_hits(trace, slots, set())


def staging_only_gpu(manifest, precision: str, n: int) -> dict:
    """The ``tiers.gpu`` section of the staging-slots arm: a budget of exactly ``n`` staging slots
    and their transit rows (as the placement counts them), so no expert is hot. Every MoE layer
    of the bench's models has one expert shape."""
    entry = next(iter(manifest.layers.values()))
    blob = entry.largest(precision) if precision != "bf16" else None
    rows = transit_rows(n, blob.nbytes) if blob else 0
    return {"budget": n * entry.layout.nbytes() + rows * (blob.stride if blob else 0), "staging_slots": n}


def synthetic_replays(manifest, top_k: int, zipf: float, reuse: float) -> dict[str, dict]:
    """The cache policy's hit rate against Belady's MIN on a uniform and a skewed, sticky synthetic
    trace (``tools.trace.TraceModel``, 256 tokens) of the pack's layers and experts, over 25% of
    its experts as slots, nothing pinned."""
    layers = sorted(manifest.layers)
    n_exp = next(iter(manifest.layers.values())).layout.num_experts
    tm_args = dict(num_layers=len(layers), num_experts=n_exp, top_k=top_k)
    replays = {}
    for label, tm in (("uniform", dict(zipf_s=0.0, reuse_p=0.0)), ("skewed", dict(zipf_s=zipf, reuse_p=reuse))):
        seq = lookups(TraceModel(**tm_args, **tm, seed=0).sample(256), layers)
        cap = max(1, int(0.25 * len(layers) * n_exp))
        replays[label] = {"trace": tm, "capacity": cap, "lookups": len(seq), "belady": belady_hits(seq, cap, set()) / len(seq),
                          "markov": replay(seq, cap, set()) / len(seq)}
    return replays
