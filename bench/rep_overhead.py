"""Decode overhead per repetition for bench results already written: per arm, the median over
repetitions of its ms/token less its paired all-GPU model's in the same repetition, and that over
the arm's bytes bound (``tools.bench_bounds.rep_overhead_ms``; results from before the bench kept each
repetition are skipped).

    python bench/rep_overhead.py bench/results/bench-qwen3_moe-run27.json [...]

Prints a Markdown table: file, arm, the two medians' difference over the bytes bound (what the
bench's table reports as "overhead / bytes" against the pair), the per-repetition overhead in
ms/token and over the bytes bound.
"""
import json
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tiers.tools.bench_bounds import bytes_bound_ms, rep_overhead_ms  # noqa: E402


def rows(path: str) -> list[str]:
    with open(path) as f:
        result = json.load(f)
    out = []
    for name, a in result["arms"].items():
        reps = rep_overhead_ms(a)
        if reps is None:
            continue
        bound_ms = bytes_bound_ms(a)
        medians = a.get("paired_overhead_over_bytes_bound")
        out.append(f"| {os.path.basename(path)} | {name} | " + ("-" if medians is None else f"{medians:.2f}")
                   + f" | {reps:.2f} | " + (f"{reps / bound_ms:.2f}" if bound_ms else "-") + " |")
    return out


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit(__doc__.strip().splitlines()[3].strip())
    print("| file | arm | medians' difference / bytes bound | per-repetition overhead ms/token | over bytes bound |")
    print("|---|---|---|---|---|")
    for path in argv:
        for line in rows(path):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
