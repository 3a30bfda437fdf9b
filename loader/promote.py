"""Mixed precision by expert: the experts pack keeps at the next higher precision (``pack(min_sqnr=)``).

An expert whose worst tensor quantizes below ``min_sqnr`` dB of SQNR in a 4-bit precision is
served, wherever that precision is asked for, from its blob of the next higher precision
(``NEXT``), which the pack must hold too. Its reference for the 4-bit precision names that blob
(the same file, offset, size, checksum and SQNR) and records the blob's layout as its
``encoding``, so no byte is stored twice; the tiers decode each expert by its own encoding.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

NEXT = {"int4": "int8", "nf4": "int8"}  # a 4-bit precision -> the precision its worst experts are kept at


def check_min_sqnr(min_sqnr: float | None, precisions: Sequence[str]) -> None:
    """Refuse a ``min_sqnr`` that is not a number, or that packs no precision it applies to or not
    the precision it would keep experts at (ValueError naming ``--min-sqnr`` and what to add)."""
    if min_sqnr is None:
        return
    if isinstance(min_sqnr, bool) or not isinstance(min_sqnr, (int, float)) or not math.isfinite(min_sqnr):
        raise ValueError(f"--min-sqnr: expected a finite number of dB, got {min_sqnr!r}")
    lossy = [p for p in precisions if p in NEXT]
    if not lossy:
        raise ValueError(f"--min-sqnr {min_sqnr}: it keeps the worst experts of {' and '.join(sorted(NEXT))} at a higher precision, "
                         f"and neither is packed (precisions: {','.join(precisions)})")
    missing = sorted({NEXT[p] for p in lossy} - set(precisions))
    if missing:
        need = "; ".join(f"{p} keeps its worst experts at {NEXT[p]}" for p in lossy if NEXT[p] in missing)
        raise ValueError(f"--min-sqnr {min_sqnr}: {need}, which is not packed; add {','.join(missing)} to the precisions "
                         f"(--precisions {','.join([*precisions, *missing])})")


def promote(entry: dict, min_sqnr: float) -> list[str]:
    """Point an expert's manifest entry (``{precision: reference}``) for each 4-bit precision whose
    recorded SQNR is below ``min_sqnr`` at its blob of the next higher precision; the precisions
    it did that for."""
    done = []
    for p, higher in NEXT.items():
        ref = entry.get(p)
        if ref is not None and ref["sqnr_db"] is not None and ref["sqnr_db"] < min_sqnr:
            entry[p] = {**entry[higher], "encoding": higher}
            done.append(p)
    return done
