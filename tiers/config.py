"""The YAML config, mapped onto frozen dataclasses and validated at the boundary.

Owns: parsing, defaults and validation. Every error is a ValueError naming the key (dotted,
e.g. ``tiers.gpu.fraction``), the value given and what is allowed. Sizes are a fraction in
[0, 1] (``fraction: 0.25``) or bytes (``budget: 24GiB``, ``budget: 512MB``, ``budget: 1073741824``).
Checks that need the packed checkpoint (a budget smaller than one expert, a precision that
was not packed) happen in ``tiers.policy.placement.plan_placement``. A file is read by
``tiers.config_yaml`` (strict YAML: decimal numbers, true/false and text, no aliases, no key
twice), and every value a message shows goes through its ``show`` (at most about 200 characters,
in bounded work).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiers import quant
from tiers.config_yaml import read_yaml
from tiers.loader.shown import SHOWN, show

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


@dataclass(frozen=True)
class TierSize:
    """Either a fraction of all experts or an absolute byte budget (exactly one is set)."""

    fraction: float | None = None
    budget: int | None = None


@dataclass(frozen=True)
class GpuTier:
    size: TierSize = TierSize(fraction=0.25)
    precision: str = "bf16"  # the packed precision hot experts are loaded from
    staging_slots: int | str = "auto"  # GPU slots for misses, inside the budget; auto: 2 x top-k (up to 4 x for 64 MiB parts) in at most half the budget
    graphs: bool = True  # on CUDA: decode steps, decode layer calls and recurring prefill plans replayed as CUDA graphs


@dataclass(frozen=True)
class CpuTier:
    size: TierSize = TierSize(fraction=0.5)
    precision: str = "int8"


@dataclass(frozen=True)
class NvmeTier:
    precision: str = "int8"


@dataclass(frozen=True)
class Rebalance:
    every_tokens: int = 0  # re-count routing and rebalance the tiers every this many tokens; 0: off
    window: int = 64  # the frequency is counted over the last ``window`` intervals of every_tokens
    max_moves: int = 8  # experts promoted per rebalance, at most (each tier); bounds how fast the tiers settle, not the churn once settled


@dataclass(frozen=True)
class Int4:
    group: int | None = None  # int4's group size (pack; a load checks it against the pack's); None: quant.int4.GROUP


@dataclass(frozen=True)
class Parallel:
    experts: bool = False  # expert parallelism over torch.distributed's default group (tiers.parallel)


@dataclass(frozen=True)
class TiersConfig:
    gpu: GpuTier = field(default_factory=GpuTier)
    cpu: CpuTier = field(default_factory=CpuTier)
    nvme: NvmeTier = field(default_factory=NvmeTier)
    rebalance: Rebalance = field(default_factory=Rebalance)
    int4: Int4 = field(default_factory=Int4)
    parallel: Parallel = field(default_factory=Parallel)

    def pack_options(self) -> dict[str, dict]:
        """What pack passes each precision's encoder (``loader.pack.pack``'s ``options``)."""
        return {"int4": {"group": self.int4.group}} if self.int4.group is not None else {}


def parse_size(value: Any, key: str) -> int:
    """``24GiB`` / ``512MB`` / an int -> bytes."""
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected a size such as 8GiB or 512MB, got {show(value)}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)) and m.group(2).lower() in _UNITS:
        number = float(m.group(1))
        if not math.isfinite(number) or number * _UNITS[m.group(2).lower()] > 2**63:
            raise ValueError(f"{key}: size {show(value)} is out of range")
        n = int(number * _UNITS[m.group(2).lower()])
    else:
        raise ValueError(f"{key}: expected a size such as 8GiB or 512MB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), got {show(value)}")
    if n <= 0:
        raise ValueError(f"{key}: a budget must be positive, got {show(value)}")
    return n


def _check_keys(d: Any, key: str, allowed: set[str]) -> dict:
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ValueError(f"{key}: expected a mapping with keys {sorted(allowed)}, got {type(d).__name__} {show(d)}")
    for k in d:
        if k not in allowed:  # the key itself, unquoted, when it is a short string
            name = k if isinstance(k, str) and len(k) <= SHOWN else show(k)
            raise ValueError(f"{key}.{name}: unknown key; allowed: {sorted(allowed)}")
    return d


def _size(d: dict, key: str, default: TierSize) -> TierSize:
    has_f, has_b = "fraction" in d, "budget" in d
    if has_f and has_b:
        raise ValueError(f"{key}: give either fraction or budget, not both (got fraction={show(d['fraction'])}, budget={show(d['budget'])})")
    if has_b:
        return TierSize(budget=parse_size(d["budget"], f"{key}.budget"))
    if has_f:
        f = d["fraction"]
        if isinstance(f, bool) or not isinstance(f, (int, float)):
            raise ValueError(f"{key}.fraction: expected a number in [0, 1], got {show(f)}")
        if not 0 <= f <= 1:
            raise ValueError(f"{key}.fraction: must be in [0, 1], got {show(f)}")
        return TierSize(fraction=float(f))
    return default


def _flag(d: dict, section: str, name: str, default: bool) -> bool:
    """The true/false key ``section.name`` (``default`` when absent)."""
    value = d.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"{section}.{name}: expected true or false, got {show(value)}")
    return value


def _precision(d: dict, key: str, default: str) -> str:
    p = d.get("precision", default)
    if not isinstance(p, str) or p not in quant.scheme_names():
        raise ValueError(f"{key}.precision: unknown precision {show(p)}; allowed: {list(quant.scheme_names())}")
    return p


KEYS = {
    "gpu": ("fraction", "budget", "precision", "staging_slots", "graphs"),
    "cpu": ("fraction", "budget", "precision"),
    "nvme": ("precision",),
    "rebalance": ("every_tokens", "window", "max_moves"),
    "int4": ("group",),
    "parallel": ("experts",),
}


def parse_config(doc: Any) -> TiersConfig:
    """A parsed YAML document (dict) -> TiersConfig."""
    top = _check_keys(doc, "config", {"tiers"})
    tiers = _check_keys(top.get("tiers"), "tiers", set(KEYS))
    g, c, n, r, i4, par = (_check_keys(tiers.get(t), f"tiers.{t}", set(KEYS[t])) for t in KEYS)
    d = TiersConfig()
    slots = g.get("staging_slots", d.gpu.staging_slots)
    if slots != "auto" and (isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= 1024):
        raise ValueError(f"tiers.gpu.staging_slots: expected an integer in [1, 1024] or auto, got {show(slots)}")
    gpu = GpuTier(_size(g, "tiers.gpu", d.gpu.size), _precision(g, "tiers.gpu", d.gpu.precision), slots,
                  _flag(g, "tiers.gpu", "graphs", d.gpu.graphs))
    cpu_default = d.cpu.size
    if gpu.size.fraction is not None:  # the default cpu share never pushes the sum above 1
        cpu_default = TierSize(fraction=min(d.cpu.size.fraction, round(1.0 - gpu.size.fraction, 12)))
    cpu = CpuTier(_size(c, "tiers.cpu", cpu_default), _precision(c, "tiers.cpu", d.cpu.precision))
    nvme = NvmeTier(_precision(n, "tiers.nvme", d.nvme.precision))
    if gpu.size.fraction is not None and cpu.size.fraction is not None and gpu.size.fraction + cpu.size.fraction > 1.0 + 1e-9:
        raise ValueError(
            f"tiers.gpu.fraction + tiers.cpu.fraction must be <= 1 (nvme holds the rest), got "
            f"{show(gpu.size.fraction)} + {show(cpu.size.fraction)} = {show(gpu.size.fraction + cpu.size.fraction)}"
        )
    group = _int_in(i4, "tiers.int4", "group", 64, 2, 4096) if "group" in i4 else None
    rebalance, parallel = _rebalance(r), Parallel(_flag(par, "tiers.parallel", "experts", d.parallel.experts))
    if parallel.experts and rebalance.every_tokens:
        raise ValueError("tiers.rebalance.every_tokens: the rebalancer does not run under tiers.parallel.experts yet; "
                         "leave one of the two out")
    return TiersConfig(gpu, cpu, nvme, rebalance, Int4(group), parallel)


def _int_in(d: dict, key: str, name: str, default: int, lo: int, hi: int) -> int:
    v = d.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"{key}.{name}: expected an integer in [{lo}, {hi}], got {show(v)}")
    return v


def _rebalance(r: dict) -> Rebalance:
    d = Rebalance()
    return Rebalance(
        every_tokens=_int_in(r, "tiers.rebalance", "every_tokens", d.every_tokens, 0, 1 << 30),
        window=_int_in(r, "tiers.rebalance", "window", d.window, 1, 1024),
        max_moves=_int_in(r, "tiers.rebalance", "max_moves", d.max_moves, 1, 1 << 20),
    )


def load_config(config: str | Path | dict | TiersConfig | None) -> TiersConfig:
    """``config`` may be a YAML file path, an already parsed dict, a TiersConfig, or None (defaults)."""
    if config is None:
        return TiersConfig()
    if isinstance(config, TiersConfig):
        return config
    if isinstance(config, dict):
        return parse_config(config)
    if isinstance(config, (str, Path)):
        path = Path(config)
        if path.is_dir():
            raise ValueError(f"config: {show(str(path))} is a directory, expected a YAML file")
        if not path.is_file():
            raise ValueError(f"config: file {show(str(path))} does not exist")
        return parse_config(read_yaml(path))
    raise ValueError(f"config: expected a YAML path, a dict or None, got {type(config).__name__}")


def precisions_needed(cfg: TiersConfig) -> list[str]:
    """The precisions a pack must hold for this config (bf16 always, for exact hot experts)."""
    return list(dict.fromkeys(["bf16", cfg.gpu.precision, cfg.cpu.precision, cfg.nvme.precision]))
