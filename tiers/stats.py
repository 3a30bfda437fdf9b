"""Tier statistics: what was served from where, what moved, and how fast.

Owns: the counters the engine updates and their report (``as_dict()`` and a printable table).
Definitions: a lookup is a *gpu hit* when the expert already sits in a GPU slot (hot or cached
in a staging slot); otherwise it is a gpu miss, served by the cpu tier (a *cpu hit*) or by the
nvme tier (a cpu miss and an *nvme hit*). ``bytes_moved`` counts transfer-form bytes per source
tier. Copy and stall times are measured with timing events on CUDA (resolved when read) and
with the injected clock on the CPU, where copies are synchronous.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TIERS = ("gpu", "cpu", "nvme")


@dataclass
class TierStats:
    residency: dict[str, dict[str, int]]
    hits: dict[str, int]
    misses: dict[str, int]
    bytes_moved: dict[str, int]
    stage_seconds: float
    stall_seconds: float
    gpu_slots: dict[str, int]
    memory: dict[str, int]
    device: str
    read_ahead: dict[str, int] = field(default_factory=dict)  # reads, errors: cold misses of a call read in parallel
    rebalance: dict[str, int] = field(default_factory=dict)
    direct: dict[str, int] = field(default_factory=dict)  # on (0/1), decode_calls, stacks: the direct-read paths taken
    # calls, parts: long calls read part by part into reserved slots; whole: of those, calls that
    # read their layer's every warm expert without a sync; unused, unused_bytes: what those read in vain
    streamed: dict[str, int] = field(default_factory=dict)
    # on (0/1), graphs (held now), captured, replayed, eager, failed: decode calls replayed as CUDA graphs (tiers.graphs.graph_cache)
    graphs: dict[str, int] = field(default_factory=dict)
    # the same for whole-layer calls' plans and windows (prefill graphs)
    whole_graphs: dict[str, int] = field(default_factory=dict)
    # bytes_moved's share read inside step graphs (tiers.graphs.step_graphs), which no timing event spans:
    # left out of h2d_gbps, whose time counts only timed copies
    untimed_bytes: int = 0
    # on (0/1), steps (decode steps replayed as one graph), captured, eager (steps run op by op, by
    # reason), cache_bytes (the static KV cache those steps write)
    step_graphs: dict = field(default_factory=dict)

    @property
    def gpu_hit_rate(self) -> float:
        """The GPU tier's share of the lookups (0 with none)."""
        lookups = sum(self.hits.values())
        return self.hits["gpu"] / lookups if lookups else 0.0

    @property
    def h2d_gbps(self) -> float:
        moved = sum(self.bytes_moved.values()) - self.untimed_bytes
        return moved / self.stage_seconds / 1e9 if self.stage_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "residency": self.residency,
            "hits": dict(self.hits),
            "misses": dict(self.misses),
            "bytes_moved": dict(self.bytes_moved),
            "stage_seconds": self.stage_seconds,
            "stall_seconds": self.stall_seconds,
            "h2d_gbps": self.h2d_gbps,
            "gpu_slots": dict(self.gpu_slots),
            "memory": dict(self.memory),
            "read_ahead": dict(self.read_ahead),
            "rebalance": dict(self.rebalance),
            "direct": dict(self.direct),
            "streamed": dict(self.streamed),
            "graphs": dict(self.graphs),
            "whole_graphs": dict(self.whole_graphs),
            "untimed_bytes": self.untimed_bytes,
            "step_graphs": dict(self.step_graphs),
        }

    def __str__(self) -> str:
        mib = 1 << 20
        lines = [
            f"tiers on {self.device}",
            f"{'tier':<6} {'experts':>8} {'MiB':>10} {'hits':>9} {'misses':>9} {'MiB moved':>10}",
        ]
        for t in TIERS:
            r = self.residency[t]
            moved = self.bytes_moved.get(t)
            lines.append(
                f"{t:<6} {r['experts']:>8} {r['bytes'] / mib:>10.1f} {self.hits[t]:>9} {self.misses[t]:>9} "
                f"{'-' if moved is None else f'{moved / mib:.1f}':>10}"
            )
        lines.append(
            f"gpu hit rate {self.gpu_hit_rate:.1%} of {sum(self.hits.values())} lookups; staged {sum(self.bytes_moved.values()) / mib:.1f} MiB "
            f"in {self.stage_seconds * 1e3:.1f} ms ({self.h2d_gbps:.2f} GB/s); stalled {self.stall_seconds * 1e3:.1f} ms"
        )
        lines.append(
            f"gpu slots: {self.gpu_slots['hot']} hot + {self.gpu_slots['staging']} staging "
            f"({self.gpu_slots['cached']} holding an expert); gpu memory {self.memory['gpu_bytes'] / mib:.1f} MiB "
            f"of {self.memory['gpu_budget'] / mib:.1f} MiB budget; host pool {self.memory['host_bytes'] / mib:.1f} MiB "
            f"({'pinned' if self.memory['host_pinned'] else 'not pinned: no CUDA'})"
        )
        if self.direct.get("decode_calls") or self.direct.get("stacks"):
            lines.append(f"direct reads: {self.direct['decode_calls']} decode layer calls, {self.direct['stacks']} stacks "
                         "decoded by the GPU straight from pinned memory")
        if self.graphs.get("replayed") or self.graphs.get("failed"):
            g = self.graphs
            lines.append(f"decode graphs: {g['replayed']} layer calls replayed from {g['graphs']} graphs ({g['captured']} captured, "
                         f"{g['eager']} calls eager, {g['failed']} captures failed)")
        if self.step_graphs.get("steps") or self.step_graphs.get("eager"):
            g = self.step_graphs
            eager = ", ".join(f"{n} {why}" for why, n in sorted(g["eager"].items())) or "none"
            lines.append(f"step graphs: {g['steps']} decode steps run whole as one graph ({g['captured']} captured, {g['failed']} "
                         f"captures failed); steps op by op: {eager}")
        if self.untimed_bytes:
            lines.append(f"  {self.untimed_bytes / mib:.1f} MiB of the staged bytes were read inside step graphs, untimed: "
                         "left out of the GB/s above")
        if self.streamed.get("calls"):
            lines.append(f"streamed: {self.streamed['calls']} long layer calls read in {self.streamed['parts']} parts into reserved slots")
            if self.streamed.get("whole"):
                lines.append(f"  {self.streamed['whole']} of them read their whole layer without a sync; {self.streamed['unused']} "
                             f"experts read in vain ({self.streamed['unused_bytes'] / mib:.1f} MiB)")
            g = self.whole_graphs
            if g.get("replayed") or g.get("failed"):
                lines.append(f"  their plans and windows: {g['replayed']} replayed from {g['graphs']} graphs ({g['captured']} captured, "
                             f"{g['eager']} eager, {g['failed']} captures failed)")
        if self.rebalance:
            r = self.rebalance
            lines.append(
                f"rebalance: {r['rebalances']} rounds, {r['promoted_hot']} promoted to gpu, {r['promoted_warm']} to cpu, "
                f"{r['in_flight']} in flight, {r['read_errors']} read errors"
            )
        return "\n".join(lines)


@dataclass
class StatsCollector:
    """Mutable counters; the engine is the only writer."""

    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    bytes_moved: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "nvme": 0})
    stage_seconds: float = 0.0
    stall_seconds: float = 0.0
    async_reads: int = 0  # cold blobs read on reader threads
    async_read_errors: int = 0  # read-aheads that failed (the demand read raises)
    direct_calls: int = 0  # decode layer calls served by direct decode
    direct_stacks: int = 0  # direct stacks launched
    streamed_calls: int = 0  # layer calls streamed part by part (tiers.paths.streamed)
    streamed_parts: int = 0  # their parts of misses
    whole_calls: int = 0  # of those, calls that read every warm expert of their layer without a sync
    unused_reads: int = 0  # experts such calls read from the warm pool that no row was routed to
    unused_bytes: int = 0  # ... and the bytes those reads moved
    _pending: list[tuple[str, Any, Any]] = field(default_factory=list)

    def lookup(self, served_by: str) -> None:
        self.hits[served_by] += 1
        if served_by in ("cpu", "nvme"):
            self.misses["gpu"] += 1
        if served_by == "nvme":
            self.misses["cpu"] += 1

    def timed(self, kind: str, start: Any, end: Any) -> None:
        """Remember a pair of timing events (CUDA); resolved lazily so nothing syncs now."""
        self._pending.append((kind, start, end))
        if len(self._pending) > 8192:
            self.resolve()

    def resolve(self) -> None:
        for kind, start, end in self._pending:
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
            if kind == "stage":
                self.stage_seconds += seconds
            else:
                self.stall_seconds += seconds
        self._pending.clear()

    def read_ahead_report(self) -> dict[str, int]:
        return {"reads": self.async_reads, "errors": self.async_read_errors}

    def reset(self) -> None:
        self.resolve()
        self.async_reads = self.async_read_errors = 0
        self.direct_calls = self.direct_stacks = 0
        self.streamed_calls = self.streamed_parts = 0
        self.whole_calls = self.unused_reads = self.unused_bytes = 0
        self.hits = dict.fromkeys(TIERS, 0)
        self.misses = dict.fromkeys(TIERS, 0)
        self.bytes_moved = {"cpu": 0, "nvme": 0}
        self.stage_seconds = 0.0
        self.stall_seconds = 0.0
