"""What a loaded model's tiers hold and did, as plain data: the stats, the runtime manifest, the load summary.

Owns reading the manager's collaborators into ``TierStats`` (``tiers.stats``), into the runtime
manifest (``tiers.manifest``: per expert its tier, slot, precision, encoding and bytes; per pool
its slot shape, stride, dtype and count and each slot's state; the host slab's layout; memory
outside the budget), JSON-serializable, and into one summary line per tier printed at load.
"""
from __future__ import annotations

from typing import Any

from tiers.stats import TierStats
from tiers.store.table import Home

GIB = 1 << 30


def _human(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def _precision(mgr: Any, home: Home) -> str:
    return {Home.GPU: mgr.cfg.gpu.precision, Home.CPU: mgr.cfg.cpu.precision, Home.NVME: mgr.cfg.nvme.precision}[home]


def _expert_bytes(mgr: Any, key, home: Home) -> int:
    """What an expert takes in its tier: its slot at compute precision on the GPU (its blob when it
    stays quantized there), its blob elsewhere."""
    if home is Home.GPU and mgr.gpu_pool is None:
        return mgr.manifest.layers[key.layer].layout.nbytes()
    return mgr.manifest.blob(key, _precision(mgr, home)).stride


def _encoding(mgr: Any, key, home: Home) -> str:
    """The precision whose blob layout the expert's bytes in its tier use: its tier's, or the higher
    one pack kept it at (``--min-sqnr``); bf16 for a hot slot."""
    if home is Home.GPU and mgr.gpu_pool is None:
        return "bf16"
    return mgr.manifest.blob(key, _precision(mgr, home)).precision


def _kept(mgr: Any, keys, precision: str) -> str:
    """``", 3 kept at int8"`` where pack kept some of ``keys`` at a higher precision than ``precision``."""
    higher: dict[str, int] = {}
    for k in keys:
        enc = mgr.manifest.blob(k, precision).precision
        if enc != precision:
            higher[enc] = higher.get(enc, 0) + 1
    return "".join(f", {n} kept at {enc}" for enc, n in sorted(higher.items()))


def gpu_bytes(mgr: Any) -> dict[str, int]:
    slots = sum(p.nbytes for p in mgr.pools)
    transit = sum(t.numel() for t in mgr.staging.transit.values())
    blobs = mgr.gpu_pool.capacity if mgr.gpu_pool is not None else 0
    return {"slots": slots, "transit": transit, "quantized_hot": blobs, "total": slots + transit + blobs}


def host_layout(mgr: Any) -> dict[str, int]:
    """The pinned slab's parts, in bytes (warm experts, disk ring buffers, uploads, promotion buffers, spares)."""
    return {"capacity": mgr.host.capacity, "used": mgr.host.used, "pinned": int(mgr.host.pinned), **mgr.host.parts}


def stats(mgr: Any) -> TierStats:
    mgr.settle()
    mgr.stats_.resolve()
    s = mgr.stats_
    static = mgr.resident.hits()
    direct_gpu, direct_cpu, direct_bytes, untimed = mgr.direct.served()
    residency = {h.value: {"experts": 0, "bytes": 0} for h in Home}
    for k, r in mgr.table.items():  # where each expert lives now (the rebalancer moves them)
        residency[r.home.value]["experts"] += 1
        residency[r.home.value]["bytes"] += _expert_bytes(mgr, k, r.home)
    hot = sum(p.hot for p in mgr.pools)
    staging = sum(p.n_slots for p in mgr.pools) - hot
    cached = sum(1 for p in mgr.pools for slot in p.staging if mgr.table.occupant(p.index, slot) is not None)
    host = host_layout(mgr)
    memory = {"gpu_bytes": gpu_bytes(mgr)["total"], "gpu_budget": mgr.placement.gpu_budget, "host_bytes": mgr.host.capacity,
              "host_pinned": int(mgr.host.pinned), "host_pool_bytes": host.get("warm", 0), "host_ring_bytes": mgr.host.capacity - host.get("warm", 0),
              "cpu_budget": mgr.placement.cpu_budget}
    return TierStats(
        residency=residency,
        hits=s.hits | {"gpu": s.hits["gpu"] + static + direct_gpu, "cpu": s.hits["cpu"] + direct_cpu},
        misses=s.misses | {"gpu": s.misses["gpu"] + direct_cpu},
        bytes_moved=s.bytes_moved | {"cpu": s.bytes_moved.get("cpu", 0) + direct_bytes},
        stage_seconds=s.stage_seconds,
        stall_seconds=s.stall_seconds,
        untimed_bytes=untimed,
        gpu_slots={"hot": hot, "staging": staging, "cached": cached},
        read_ahead=s.read_ahead_report(),
        direct={"on": int(mgr.direct.enabled), "decode_calls": s.direct_calls, "stacks": s.direct_stacks},
        streamed={"calls": s.streamed_calls, "parts": s.streamed_parts, "whole": s.whole_calls, "unused": s.unused_reads,
                  "unused_bytes": s.unused_bytes},
        memory=memory,
        device=str(mgr.device),
        rebalance=mgr.rebalancer.report() if mgr.rebalancer is not None else {},
        graphs=mgr.decode_graphs.counts(),
        whole_graphs=mgr.prefill_graphs.counts(),
        step_graphs=mgr.steps.report() if mgr.steps is not None else {"on": 0},
    )


def manifest(mgr: Any) -> dict:
    """The runtime manifest (see the module docstring); checks the table's invariants first."""
    mgr.settle()
    mgr.table.check()
    t = mgr.table
    first = mgr.parallel.first if mgr.parallel is not None else dict.fromkeys(mgr.manifest.layers, 0)  # experts by the model's ids
    experts = []
    for k, r in sorted(t.items()):
        pool = mgr.pool_of[k.layer].index
        experts.append({"layer": k.layer, "expert": first[k.layer] + k.expert, "tier": r.home.value, "hot": r.hot,
                        "slot": None if r.slot is None else [pool, r.slot], "precision": _precision(mgr, r.home),
                        "encoding": _encoding(mgr, k, r.home), "bytes": _expert_bytes(mgr, k, r.home), "host_offset": r.host_offset})
    pools = []
    for p, g in zip(mgr.pools, mgr.placement.groups):
        slots = []
        for s in range(p.n_slots):
            v = t.slot(p.index, s)
            slots.append({"slot": s, "occupant": None if v.occupant is None else [v.occupant[0], first[v.occupant[0]] + v.occupant[1]],
                          "state": v.state.value,
                          "readers": v.readers, "hot": v.hot, "reserved": v.reserved})
        pools.append({"index": p.index, "layers": list(g.layers), "count": p.n_slots, "hot": p.hot, "staging": p.n_slots - p.hot,
                      "dtype": str(p.dtype).removeprefix("torch."), "slot_bytes": p.slot_bytes,
                      "tensors": [{"name": n, "shape": list(s.shape[1:]), "stride": list(s.stride()[1:])} for n, s in p.slabs.items()],
                      "transit_rows": g.transit_rows, "transit_bytes": g.transit_bytes, "slots": slots})
    step = mgr.steps.report() if mgr.steps is not None else {}
    outside = {"step_graph_kv_cache": step.get("cache_bytes", 0),
               "direct_tables": sum(x.numel() * x.element_size() for x in (mgr.direct._starts, mgr.direct._resident) if x is not None)}
    ranks = {} if mgr.parallel is None else {"parallel": {"rank": mgr.parallel.rank, "world": mgr.parallel.world}}
    return {"device": str(mgr.device), **ranks, "summary": summary(mgr), "experts": experts, "pools": pools,
            "gpu": {"budget": mgr.placement.gpu_budget, **gpu_bytes(mgr), "outside_budget": outside},
            "host": {"budget": mgr.placement.cpu_budget, **host_layout(mgr)}}


def summary(mgr: Any) -> list[str]:
    """One line per tier: what its budget bought."""
    p, cfg = mgr.placement, mgr.cfg
    hot = sum(pool.hot for pool in mgr.pools)
    staging = sum(pool.n_slots - pool.hot for pool in mgr.pools)
    used = gpu_bytes(mgr)["total"]
    total = len(mgr.manifest.keys)
    gpu = f"gpu: {hot} hot + {staging} staging slots, {_human(used)} of {_human(p.gpu_budget)} ({hot} of {total} experts hot)"
    if p.gpu_pool:
        gpu = (f"gpu: {len(p.gpu_pool)} of {total} experts hot in {cfg.gpu.precision}{_kept(mgr, p.gpu_pool, cfg.gpu.precision)} "
               f"({_human(p.gpu_pool_bytes)}) + {staging} staging "
               f"slots, {_human(used)} of {_human(p.gpu_budget)}")
    elif staging and not hot:
        gpu += "; the staging slots misses need took the whole budget, so no expert is hot: raise tiers.gpu.fraction or budget"
    host = host_layout(mgr)
    cpu = (f"cpu: {len(p.warm)} warm experts ({cfg.cpu.precision}{_kept(mgr, p.warm, cfg.cpu.precision)}), {_human(host.get('warm', 0))} of {_human(p.cpu_budget)}, "
           f"{_human(host['capacity'])} {'pinned' if host['pinned'] else 'not pinned (no CUDA)'} with buffers")
    nvme = f"nvme: {len(p.cold)} cold experts ({cfg.nvme.precision}{_kept(mgr, p.cold, cfg.nvme.precision)}) read from {mgr.manifest.root}"
    return [gpu, cpu, nvme]
