"""tiers-bench: decode and prefill with offloaded experts, against all-GPU, naive lazy .to() and accelerate.

    python tools/bench.py [--model mixtral|qwen3_moe] [--layers N] [--tokens 32] [--prefill 2048]
                          [--arms all] [--out bench/results] [--device cuda] [--tiny]

Builds a random-weight model of real shapes (Mixtral-8x7B with 8 layers, or Qwen3-30B-A3B with 12
layers, by default), saves and packs it, then measures each arm in one run:

- ``all_gpu``: every expert on the GPU, transformers' default experts implementation;
- ``lazy``: experts in pageable CPU memory, each hit expert moved with ``.to()`` when used;
- ``accelerate``: ``accelerate.dispatch_model`` with the experts modules on "cpu";
- ``tiers_<gpu%>_<cpu precision>``: Tiers at a GPU budget of 100%, 50% and 25% of expert bytes,
  the rest warm in pinned RAM (INT8 or bf16); ``tiers_0_<precision>`` holds only the staging
  slots, the same GPU budget for experts as the lazy and accelerate arms; ``tiers_100_*`` is
  timed over at least ``STATIC_ARM_REPS`` repetitions, since it differs from all-GPU by less than
  the host's drift across two;
- ``<arm>@skewed``: the same arm routed by a skewed, sticky trace (``tools.routing``), with the
  rebalancer on for Tiers; ``<tiers arm>@skewed_norebal``: the same routing, rebalancer off;
  ``<tiers arm>@skewed_routed``: the rebalancer on, loaded with the routing its ``@skewed`` arm
  counted (``tiers.load(..., routing=)``; that arm must come earlier in ``--arms``) and timed
  without the rebalancer's warm-up: what a routing file saves a new process.

Per arm: decode ms/token and tok/s at batch 1 (Tiers arms also against an all-GPU measurement of
the same routing, its repetitions interleaved with theirs; each repetition's pair of decodes is in
the JSON too; and ``--interleave`` decode steps of the arm and that model taking turns, each step
timed alone, ``tools.measure.interleaved_decode``), prefill time, bytes moved per token per source
tier, achieved H2D GB/s, GPU hit rate, peak GPU memory, and the bound
``all-GPU ms/token + moved bytes / 55 GB/s``. The cache policy's hit rate is replayed against
Belady's MIN on the recorded routing trace and on a skewed, sticky synthetic trace
(``tools.trace.TraceModel``). The offload table holds each offloaded Tiers arm's largest decode
overhead over its statistics against accelerate's and naive lazy's (``bench_bounds.offload_overheads``).
Writes ``bench-<model>.json``, ``.md`` and ``.png`` (decode ms/token per arm against its bytes bound;
needs matplotlib, the ``bench`` extra) under ``--out``; ``--report FILE.json`` runs nothing and writes
that JSON's Markdown and plot again, its figures derived by this version.

The run itself is ``tools.bench_run``; a Tiers arm's measurement ``tools.bench_tiers``; the arm
names ``tools.bench_arms``; the derived figures ``tools.bench_bounds``; the report
``tools.bench_report`` and ``tools.bench_plot``; every access to the runtime's internals
``tools.bench_runtime``.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages, not this folder's files
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [os.path.dirname(_here)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

from tiers.tools.bench_arms import order_error  # noqa: E402
from tiers.tools.bench_bounds import add_bounds  # noqa: E402
from tiers.tools.bench_plot import plot  # noqa: E402
from tiers.tools.bench_report import markdown  # noqa: E402
from tiers.tools.bench_run import run  # noqa: E402
from tiers.tools.bench_tiers import INTERLEAVE_BLOCK  # noqa: E402
from tiers.tools.measure import SHAPES, write_result  # noqa: E402


def parser() -> argparse.ArgumentParser:
    """The flags (``tiers-bench --help``)."""
    ap = argparse.ArgumentParser(prog="tiers-bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="mixtral")
    ap.add_argument("--layers", type=int, help="MoE layers (default: 8 for mixtral, 12 for qwen3_moe)")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per timed run")
    ap.add_argument("--prefill", type=int, default=2048, help="prefill length")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (median)")
    ap.add_argument("--interleave", type=int, default=192,
                    help="Tiers arms: decode steps timed in turn with the paired all-GPU model, after the repetitions (0: skip)")
    ap.add_argument("--prefill-marks", type=int, default=0,
                    help="Tiers arms: this many more prefills after the timed ones, each with a timeline of its copies, "
                         "layer boundaries and host time (tools.timeline.marked_prefill; 0: none)")
    ap.add_argument("--slow-tokens", type=int, default=4, help="decode tokens for the lazy and accelerate arms (one timed run)")
    ap.add_argument("--hf-dir", help="where to write the save_pretrained checkpoint before packing (e.g. a tmpfs)")
    ap.add_argument("--arms", default="all", help="comma-separated arms, or all")
    ap.add_argument("--staging-slots", default="auto", help="Tiers staging slots: an integer or auto (the YAML default)")
    ap.add_argument("--rebalance-every", type=int, default=8, help="Tiers @skewed arms: rebalance the tiers every this many tokens (0: off)")
    ap.add_argument("--zipf", type=float, default=1.2, help="skewed routing: per-layer Zipf exponent")
    ap.add_argument("--reuse", type=float, default=0.5, help="skewed routing: probability a token reuses an expert of the previous one")
    ap.add_argument("--copy-sweep", action="store_true", help="measure H2D GB/s per copy size (CUDA)")
    ap.add_argument("--cold-read-gb", type=float, default=0.0, help="measure cold reads of this many GB against O_DIRECT (0: skip)")
    ap.add_argument("--cold-read-rounds", type=int, default=2,
                    help="rounds of the cold-read passes, odd ones in reverse order (2: each pass once early and once late)")
    ap.add_argument("--reader-threads", type=int, default=4)
    ap.add_argument("--warmup-tokens", type=int, default=32, help="tokens generated before timing (all arms but lazy and accelerate)")
    ap.add_argument("--attention-warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="before any arm, generate with the all-GPU model at every KV length the run decodes at, twice, timed: "
                         "torch's attention builds a plan per new shape where cuDNN is among its backends (--no-attention-warmup: "
                         "the runs up to Qwen3's 51 and Mixtral's 39)")
    ap.add_argument("--rebalance-warmup", type=int, default=0,
                    help="Tiers @skewed arms with the rebalancer: this many more tokens generated before timing, so the timed "
                         "repetitions see a settled hot set (0: none, the rebalancer still settling while timed)")
    ap.add_argument("--graphs", choices=["on", "off"], default="on", help="Tiers arms' tiers.gpu.graphs (default: on, the YAML default)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--workdir", help="keep the checkpoint and the pack here")
    ap.add_argument("--out", default="bench/results", help="directory for bench-<model>.json, .md and .png")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run of the harness")
    ap.add_argument("--report", metavar="JSON",
                    help="run nothing: rewrite the Markdown and the plot beside this bench JSON from it (figures derived again); also the "
                         "partial JSON of a run that did not finish")
    return ap


def check(ap: argparse.ArgumentParser, args) -> None:
    """Refuse flags that cannot run, before any arm has (``ap.error`` exits)."""
    block = max(INTERLEAVE_BLOCK, args.rebalance_every)
    if args.interleave < 0 or 0 < args.interleave < block:
        ap.error(f"--interleave: expected 0 or at least one block of {block} steps, got {args.interleave}")
    if args.prefill_marks < 0:
        ap.error(f"--prefill-marks: expected a count >= 0, got {args.prefill_marks}")
    if args.rebalance_warmup < 0:
        ap.error(f"--rebalance-warmup: expected a token count >= 0, got {args.rebalance_warmup}")
    if args.cold_read_gb and not 1 <= args.cold_read_rounds <= 64:  # refused now, not after the arms have run
        ap.error(f"--cold-read-rounds: expected an integer in [1, 64], got {args.cold_read_rounds}")
    error = order_error(args.arms.split(",") if args.arms != "all" else [])
    if error:  # a routed arm loads what its @skewed arm counted: that arm runs first
        ap.error(f"--arms: {error}")


def report(path: Path) -> int:
    """``--report``: the Markdown and the plot of a bench JSON written by this tool, its bounds and
    summaries derived again, next to it (the JSON itself is left as it is)."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        sys.exit(f"--report {path}: not a readable bench JSON ({e})")
    if not isinstance(result, dict) or not isinstance(result.get("arms"), dict) or "command" not in result:
        sys.exit(f"--report {path}: not a bench JSON (no 'arms' or 'command')")
    md = markdown(add_bounds(result))
    path.with_suffix(".md").write_text(md)
    plot(result, path.with_suffix(".png"))
    print(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser()
    args = ap.parse_args(argv)
    if args.report:
        return report(Path(args.report))
    check(ap, args)
    args.argv = argv
    result = run(args)
    out = Path(args.out)
    stem = f"bench-{args.model}{'-tiny' if args.tiny else ''}"
    write_result(out / f"{stem}.json", result)
    md = markdown(result)
    (out / f"{stem}.md").write_text(md)
    plot(result, out / f"{stem}.png")
    (out / f"bench-{args.model}.partial.json").unlink(missing_ok=True)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
