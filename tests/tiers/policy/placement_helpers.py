"""Shared by the placement tests: the expected hot / warm / cold counts, re-derived from manifest numbers.

Expected counts are re-derived here from the raw ``manifest.json`` numbers and the accounting in
the policy module's docstring, never from the function under test.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass

from tiers.loader.layout import ExpertKey
from tiers.policy import placement
from tiers.policy.placement import plan_placement


# -- the expectation, from manifest numbers ------------------------------------------------------


@dataclass(frozen=True)
class Facts:
    """What the accounting needs, read from manifest.json as plain JSON."""

    precisions: tuple[str, ...]
    layers: tuple[int, ...]
    experts_per_layer: int
    slot: int  # bytes of one expert at bf16
    stride: dict  # precision -> bytes one blob occupies (4 KiB aligned)
    top_k: int = 1  # experts routed per token, from the packed config.json
    nbytes: dict = dataclasses.field(default_factory=dict)  # precision -> bytes of one blob (unaligned)

    @property
    def n(self) -> int:
        return len(self.layers) * self.experts_per_layer

    @property
    def total_bf16(self) -> int:
        return self.n * self.slot

    def order(self) -> list[ExpertKey]:
        """Round-robin over layers: expert 0 of every layer, then expert 1, ..."""
        return [ExpertKey(L, e) for e in range(self.experts_per_layer) for L in self.layers]


def facts(packed) -> Facts:
    raw = json.loads((packed / "manifest.json").read_text())
    precisions = tuple(raw["precisions"])
    slots, strides, sizes, counts, sigs = set(), {}, {}, set(), set()
    for entry in raw["layers"]:
        shapes = [tuple(t["shape"]) for t in entry["layout"]["tensors"]]
        sigs.add(tuple((t["name"], tuple(t["shape"])) for t in entry["layout"]["tensors"]))
        slots.add(2 * sum(math.prod(s) for s in shapes))  # bf16: 2 bytes an element
        counts.add(entry["layout"]["num_experts"])
        for p in precisions:
            b = entry["blobs"][p]
            assert b["stride"] == -(-b["nbytes"] // 4096) * 4096 and b["stride"] % 4096 == 0
            assert strides.setdefault(p, b["stride"]) == b["stride"]
            assert sizes.setdefault(p, b["nbytes"]) == b["nbytes"]
    # the tiny models have identical MoE layers: one slot group, one size; keep the arithmetic simple
    assert len(slots) == len(counts) == len(sigs) == 1
    hf = json.loads((packed / "config.json").read_text()) if (packed / "config.json").is_file() else {}
    return Facts(precisions, tuple(sorted(e["layer"] for e in raw["layers"])), counts.pop(), slots.pop(), strides,
                 hf.get("num_experts_per_tok", 1), sizes)


@dataclass(frozen=True)
class Expected:
    hot: int = 0
    warm: int = 0
    cold: int = 0
    staging: int = 0
    transit: int = 0
    rows: int = 0  # transit rows
    gpu_budget: int = 0
    cpu_budget: int = 0
    error: str | None = None  # a regex the ValueError must match instead


def expect(f: Facts, cfg) -> Expected:
    g, c = cfg.gpu, cfg.cpu
    gpu_key = "tiers.gpu.budget" if g.size.budget is not None else "tiers.gpu.fraction"
    gpu_budget = g.size.budget if g.size.budget is not None else int(g.size.fraction * f.total_bf16)
    if g.precision not in f.precisions:
        return Expected(error=r"^tiers\.gpu\.precision: ")
    if gpu_budget >= f.total_bf16:
        hot, staging, transit, rows = f.n, 0, 0, 0
    else:
        lossy = [p for p in {c.precision, cfg.nvme.precision} if p != "bf16" and p in f.precisions]
        transit = max((f.stride[p] for p in lossy), default=0)
        # auto: two per routed expert of a token, or up to four so that half of them carries
        # AUTO_PART_BYTES up, in at most half the budget, at least one
        moved = transit or f.slot
        want = max(2 * f.top_k, min(4 * f.top_k, 2 * -(-placement.AUTO_PART_BYTES // moved)))
        # lossy blobs too large to stack: a ring of TRANSIT_RING rows (else a row per staging
        # slot), and auto wants AUTO_RING_PER_TOP_K slots per routed expert at least
        ring = any(f.nbytes[p] > placement.STACK_BYTES for p in lossy)
        if ring:
            want = max(want, placement.AUTO_RING_PER_TOP_K * f.top_k)

        def reserve(n: int) -> int:
            return n * f.slot + (min(n, placement.TRANSIT_RING) if ring else n) * transit

        if g.staging_slots != "auto":
            staging = g.staging_slots
        else:  # the most it wants that fit half the budget, at least one
            staging = max([n for n in range(1, want + 1) if reserve(n) <= gpu_budget // 2], default=1)
        rows = min(staging, placement.TRANSIT_RING) if ring else staging
        reserved = reserve(staging)
        if gpu_budget < f.slot:
            return Expected(error="^" + re.escape(f"{gpu_key}: {gpu_budget} bytes is smaller than one expert ({f.slot} bytes at bf16)"))
        if gpu_budget < reserved:
            return Expected(error="^" + re.escape(f"{gpu_key}: {gpu_budget} bytes cannot hold the {staging} staging slot(s)")
                            + f".*{reserved}")
        hot = min(f.n, (gpu_budget - reserved) // f.slot)
    rest = f.n - hot
    cpu_on = c.size.budget is not None or bool(c.size.fraction)
    if rest and cpu_on and c.precision not in f.precisions:
        return Expected(error=r"^tiers\.cpu\.precision: ")
    cstride = f.stride.get(c.precision, 0)
    cpu_budget = c.size.budget if c.size.budget is not None else int(c.size.fraction * f.n * cstride)
    if c.size.budget is not None and rest and cpu_budget < cstride:
        return Expected(error="^" + re.escape(f"tiers.cpu.budget: {cpu_budget} bytes is smaller than one expert ({cstride} bytes at {c.precision})"))
    warm = min(rest, cpu_budget // cstride) if cstride else 0
    cold = rest - warm
    if cold and cfg.nvme.precision not in f.precisions:
        return Expected(error=r"^tiers\.nvme\.precision: ")
    return Expected(hot, warm, cold, staging, transit, rows, gpu_budget, cpu_budget)


def check(f: Facts, manifest, cfg, exp: Expected) -> None:
    """The placement matches the expectation key for key, and its invariants hold."""
    assert exp.error is None
    p = plan_placement(cfg, manifest)
    assert (len(p.hot), len(p.warm), len(p.cold)) == (exp.hot, exp.warm, exp.cold)
    order = f.order()
    assert p.hot == tuple(sorted(order[: exp.hot]))
    assert p.warm == tuple(sorted(order[exp.hot : exp.hot + exp.warm]))
    assert p.cold == tuple(sorted(order[exp.hot + exp.warm :]))
    assert_partition(p, manifest)
    assert (p.gpu_budget, p.cpu_budget) == (exp.gpu_budget, exp.cpu_budget)
    assert len(p.groups) == 1
    (grp,) = p.groups
    assert grp.layers == f.layers
    assert (grp.slot_bytes, grp.hot, grp.staging, grp.transit_bytes, grp.transit_rows) == (f.slot, exp.hot, exp.staging, exp.transit, exp.rows)
    assert p.gpu_bytes == (exp.hot + exp.staging) * f.slot + exp.rows * exp.transit
    assert p.gpu_bytes <= p.gpu_budget
    assert len(p.warm) * f.stride.get(cfg.cpu.precision, 0) <= p.cpu_budget


def assert_partition(p, manifest) -> None:
    keys = manifest.keys
    hot, warm, cold = set(p.hot), set(p.warm), set(p.cold)
    assert len(hot) == len(p.hot) and len(warm) == len(p.warm) and len(cold) == len(p.cold)  # no duplicates
    assert not (hot & warm) and not (hot & cold) and not (warm & cold)
    assert hot | warm | cold == set(keys)
    assert len(p.hot) + len(p.warm) + len(p.cold) == len(keys)
