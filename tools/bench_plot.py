"""A bench run's plot: each arm's decode ms/token beside its bytes bound, as a PNG.

The bound is the Markdown's "bound ms/token" column (``tools.bench_bounds.add_bounds``: the
faster all-GPU measurement of the arm's routing plus its bytes moved per token at 55 GB/s), so
only arms that have one are drawn. matplotlib is the ``bench`` extra's and is imported here
only: without it the plot is skipped with one line on stderr.
"""
from __future__ import annotations

import sys
from pathlib import Path


def bounded_arms(result: dict) -> list[tuple[str, float, float]]:
    """(arm, decode ms/token, bound ms/token) of each arm that has a bound, in the run's order."""
    return [(name, a["decode_ms_per_token"], a["bound_ms_per_token"]) for name, a in result["arms"].items()
            if "error" not in a and a.get("bound_ms_per_token") is not None]


def plot(result: dict, path: Path) -> Path | None:
    """Draw ``result``'s decode ms/token per arm against its bytes bound into the PNG ``path``;
    the path written, or None (said on stderr) without matplotlib or without an arm with a bound."""
    try:
        from matplotlib.figure import Figure  # the bench extra: pip install -e ".[bench]"
    except ImportError:
        print(f"tiers-bench: matplotlib is not installed; no plot {path.name} (pip install -e '.[bench]')", file=sys.stderr)
        return None
    rows = bounded_arms(result)
    if not rows:
        print(f"tiers-bench: no arm has a bytes bound (no all-GPU arm of its routing); no plot {path.name}", file=sys.stderr)
        return None
    names, decode, bound = zip(*rows)
    fig = Figure(figsize=(9, 1.2 + 0.42 * len(rows)), layout="constrained")
    ax = fig.add_subplot()
    y = range(len(rows))
    h = 0.38
    ax.barh([i - h / 2 for i in y], decode, h, label="decode ms/token", color="tab:blue")
    ax.barh([i + h / 2 for i in y], bound, h, label="bytes bound: faster all-GPU of its routing + bytes moved / 55 GB/s",
            color="tab:gray")
    for i, (d, b) in enumerate(zip(decode, bound)):
        ratio = f" ({d / b:.2f}x)" if b > 0 else ""  # a tiny CPU run's difference of medians can come out <= 0
        ax.text(max(d, b, 0), i, f"  {d:.1f} / {b:.1f}{ratio}", va="center", fontsize=8)
    ax.set_yticks(list(y), names, fontsize=9)
    ax.invert_yaxis()  # the run's first arm on top, as in the Markdown
    ax.set_xlim(min(0, *decode, *bound), max(0.001, *decode, *bound) * 1.3)
    ax.set_xlabel("ms per decode token (batch 1)")
    ax.set_title(f"{result['model']} ({result['shape']['layers']} layers) on {result['device']}: decode against its bytes bound",
                 fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.5 / len(rows) - 0.06), ncol=2, fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.savefig(path, dpi=110)
    return path
