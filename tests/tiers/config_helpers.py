"""Shared by the config tests: the precisions and size units as the spec states them, and a dotted-key document builder."""
from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, settings

PRECISIONS = ("bf16", "bnb8", "int4", "int8", "mxfp4", "nf4")  # what quant registers; spelled out so a new scheme is a conscious change
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

UNITS = {  # re-stated here, not imported: the test is the spec
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}


def at(dotted: str, value) -> dict:
    """``at("tiers.gpu.fraction", 2)`` -> ``{"tiers": {"gpu": {"fraction": 2}}}``."""
    parts = dotted.split(".")
    doc: dict = {parts[-1]: value}
    for p in reversed(parts[:-1]):
        doc = {p: doc}
    return doc


def raises_for(key: str):
    """A ValueError whose message starts with the dotted key."""
    return pytest.raises(ValueError, match="^" + re.escape(key) + ":")
