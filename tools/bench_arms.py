"""What a bench arm's name stands for: the arm list, each Tiers arm's config, its routing and rebalancer.

Names (``tools/bench.py`` describes each): ``all_gpu``, ``lazy``, ``accelerate`` and
``tiers_<gpu%>_<precision>``, each with ``@skewed`` routed by the skewed trace; Tiers arms
also ``@skewed_norebal`` (the rebalancer off) and ``@skewed_routed`` (loaded with the routing
its ``@skewed`` arm counted).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from tiers.loader.packed import read_manifest
from tiers.tools.bench_runtime import staging_only_gpu

TIERS_ARMS = [(1.0, "bf16"), (0.5, "int8"), (0.25, "int8"), (0.5, "bf16"), (0.25, "bf16")]
ALL_GPU_ARMS = ("all_gpu", "all_gpu@skewed")


def arm_list(spec: str) -> list[str]:
    """The arms ``--arms`` names: comma-separated, or ``all`` (no ``_routed`` arms)."""
    return spec.split(",") if spec != "all" else (
        ["all_gpu", "lazy", "accelerate"] + [f"tiers_{int(f * 100)}_{p}" for f, p in TIERS_ARMS]
        + [f"{a}@skewed" for a in ("all_gpu", "tiers_25_int8", "tiers_50_int8")] + ["tiers_25_int8@skewed_norebal"])


def arm_precisions(arms: list[str]) -> list[str]:
    """The precisions a run packs: bf16 and INT8, and any other its Tiers arms name."""
    named = [a.split("_")[2].split("@")[0] for a in arms if a.startswith("tiers_")]
    return list(dict.fromkeys(["bf16", "int8", *named]))


def rebalances(name: str) -> bool:
    """Whether a Tiers arm runs the rebalancer: ``@skewed`` and ``@skewed_routed`` ones."""
    return name.endswith(("@skewed", "@skewed_routed"))


def routing_source(name: str) -> str | None:
    """The arm whose counted routing a ``@skewed_routed`` arm loads with; None for other arms."""
    return name[: -len("_routed")] if name.endswith("@skewed_routed") else None


def order_error(listed: list[str]) -> str | None:
    """Why ``--arms`` cannot run in the order listed (a routed arm loads what its ``@skewed`` arm
    counted, so that arm runs first); None when it can."""
    for i, name in enumerate(listed):
        source = routing_source(name)
        if source is not None and not name.startswith("tiers_"):
            return f"{name}: only Tiers arms load a routing file"
        if source is not None and source not in listed[:i]:
            return f"{name} loads the routing that {source} counted; list {source} before it"
    return None


def routed(model, name: str, skew: dict, tokens: int):
    """Route ``model`` by the skewed trace (``tools.routing.TraceRouting`` of ``skew``, ``tokens``
    long) for an arm named ``...@skewed...``; a no-op context otherwise."""
    from tiers.tools.routing import TraceRouting

    return TraceRouting(model, **skew, tokens=tokens) if "@skewed" in name else contextlib.nullcontext()


def tiers_config(name: str, args, expert_bytes: int, packed: Path, top_k: int) -> dict:
    """The ``tiers`` config Tiers arm ``name`` loads with, from the run's flags: its GPU fraction and
    precision, every other expert warm in pinned RAM. ``tiers_<gpu%>_<precision>_hot``: the hot
    experts too stay in that precision (``tiers.gpu.precision``), bf16 otherwise."""
    parts = name.split("@")[0].split("_")
    frac, precision = int(parts[1]) / 100, parts[2]
    # the rest of the experts all warm in pinned RAM: a cpu budget that holds every expert
    slots = args.staging_slots if args.staging_slots == "auto" else int(args.staging_slots)
    gpu = {"fraction": frac, "staging_slots": slots} | ({"precision": precision} if parts[3:] == ["hot"] else {})
    if frac == 0:  # no hot experts: just the staging slots and their transit buffers, as the lazy and accelerate arms hold
        n = 2 * top_k if slots == "auto" else slots  # the fewest auto asks for (it takes more for a streamed part's bytes, or experts too large to stack)
        gpu = staging_only_gpu(read_manifest(packed), precision, n)
    return {"tiers": {"gpu": gpu | {"graphs": args.graphs == "on"},
                      "cpu": {"budget": expert_bytes, "precision": precision}, "nvme": {"precision": precision},
                      # the rebalancer follows skewed routing; under uniform routing it has nothing to
                      # learn, and those arms keep the YAML default (off)
                      "rebalance": {"every_tokens": args.rebalance_every if rebalances(name) else 0}}}
