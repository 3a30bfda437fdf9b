"""Shared by the streamed-path tests: the tiers a streamed call runs under, and the layers it stages."""
from __future__ import annotations


def tiers_config(precision: str = "bf16", fraction: float = 0.4, staging: int = 4, cpu: dict | None = None) -> dict:
    """``fraction`` of the GPU hot, ``staging`` staging slots, the rest in ``precision`` (``cpu``: the host tier's size)."""
    return {"gpu": {"fraction": fraction, "staging_slots": staging}, "cpu": (cpu or {"budget": "64MiB"}) | {"precision": precision},
            "nvme": {"precision": precision}}


def staged_layers(mgr) -> list[int]:
    """The layers whose experts are not all resident: their calls go through the staging slots."""
    return [L for L in sorted(mgr.manifest.layers) if not mgr.resident.qualifies(L)]
