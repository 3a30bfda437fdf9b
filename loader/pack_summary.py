"""What a pack did, as ``pack`` returns it and tiers-pack prints it."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .destination import StaleDir
from .promote import NEXT


@dataclass
class PackSummary:
    dst: Path
    experts: int
    layers: int
    bytes_per_precision: dict[str, int]
    dense_bytes: int
    seconds: float
    skipped_keys: list[str] = field(default_factory=list)
    routing_prior: bool = False
    removed: list[StaleDir] = field(default_factory=list)  # staging directories of dead packs, removed first
    calibration: dict | None = None  # the manifest's pack.calibration: int4 rounded by GPTQ for this text
    min_sqnr: float | None = None  # pack(min_sqnr=): experts below it in int4 or nf4 kept at int8
    promoted: dict[str, int] | None = None  # per 4-bit precision: how many experts it keeps at the next higher one

    def __str__(self) -> str:
        per = ", ".join(f"{p}: {_human(n)}" for p, n in self.bytes_per_precision.items())
        s = (
            f"packed {self.experts} experts in {self.layers} MoE layers into {self.dst} in {self.seconds:.1f} s\n"
            f"  experts by precision: {per}\n  dense: {_human(self.dense_bytes)}"
        )
        if self.routing_prior:
            s += "\n  routing prior: embedded (loads without a routing file rank the experts by it)"
        if self.calibration:
            c = self.calibration
            s += (f"\n  int4 calibrated (GPTQ) on {c['tokens']} tokens of {c['file']}; {c['uncalibrated']} experts no calibration "
                  f"token reached kept the plain fit")
        if self.promoted is not None:
            kept = ", ".join(f"{p} {n} of {self.experts} at {NEXT[p]}" for p, n in self.promoted.items())
            s += f"\n  experts below {self.min_sqnr:g} dB SQNR kept at a higher precision: {kept}"
        if self.skipped_keys:
            s += f"\n  skipped {len(self.skipped_keys)} checkpoint keys the model does not use: {self.skipped_keys[:5]}"
        if self.removed:
            n = len(self.removed)
            s += (f"\n  removed {n} staging director{'y' if n == 1 else 'ies'} that packs no longer running left beside the "
                  f"destination ({_human(sum(r.nbytes for r in self.removed))}): {', '.join(r.path.name for r in self.removed)}")
        return s


def _human(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
