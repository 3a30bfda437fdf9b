"""tiers-pack: convert a Hugging Face MoE checkpoint directory into the packed tier format.

    python tools/pack.py SRC DST [--config tiers.yaml] [--precisions bf16,int8] [--routing routing.json] [--overwrite]
                         [--calibration TEXT [--calibration-windows 64] [--calibration-length 512]] [--min-sqnr DB]
    python tools/pack.py PACKED --set-routing routing.json     # embed a routing prior in an existing pack
    python tools/pack.py PACKED --clear-routing                # remove it
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages, not this folder's files
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [os.path.dirname(_here)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

import argparse  # noqa: E402

import yaml  # noqa: E402

from tiers.loader.calibrate import DEFAULT_LENGTH, DEFAULT_WINDOWS  # noqa: E402
from tiers.loader.pack import DEFAULT_PRECISIONS, pack  # noqa: E402
from tiers.loader.packed import set_routing_prior  # noqa: E402
from tiers.config import load_config, precisions_needed  # noqa: E402

# What a user can cause and fix (a bad path, config or routing file, a full disk, a read-only
# directory): one line on stderr and exit status 2. Anything else is a bug and keeps its traceback.
EXPECTED_ERRORS = (ValueError, OSError, yaml.YAMLError)  # OSError: FileExistsError, PermissionError, ENOSPC, DestinationLocked


def _error(e: BaseException, context: str) -> int:
    msg = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
    if isinstance(e, OSError) and e.errno is not None and e.filename is None:
        msg += f" ({context})"  # e.g. a full disk's ENOSPC names no file (a message of pack's own names its paths)
    print(f"tiers-pack: error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tiers-pack", description=__doc__.splitlines()[0])
    ap.add_argument("src", help="directory written by transformers' save_pretrained (with --set-routing or --clear-routing: "
                    "a packed checkpoint)")
    ap.add_argument("dst", nargs="?", help="output directory (created atomically)")
    ap.add_argument("--config", help="tiers YAML: pack the precisions it names (plus bf16)")
    ap.add_argument("--precisions", help=f"comma-separated precisions (default: {','.join(DEFAULT_PRECISIONS)})")
    ap.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--device", default="cpu", help="where to quantize experts: cpu (default) or cuda (faster for large models)")
    ap.add_argument("--routing", metavar="FILE", help="a routing file (tiers.save_routing) to embed as the routing prior, "
                    "which ranks the experts for the hot and warm sets of loads given no routing file")
    ap.add_argument("--calibration", metavar="FILE", help="calibrate int4 (GPTQ) on this text: UTF-8, tokenized by SRC's "
                    "tokenizer (bytes for a vocabulary of 256), or token ids as .json or .npy; never the text you evaluate on")
    ap.add_argument("--calibration-windows", type=int, default=DEFAULT_WINDOWS, metavar="N",
                    help=f"windows of the calibration text, evenly spaced (default {DEFAULT_WINDOWS})")
    ap.add_argument("--calibration-length", type=int, default=DEFAULT_LENGTH, metavar="TOKENS",
                    help=f"tokens per calibration window (default {DEFAULT_LENGTH})")
    ap.add_argument("--min-sqnr", type=float, metavar="DB", help="keep each expert whose worst tensor quantizes below DB dB of "
                    "SQNR in int4 or nf4 at int8 in that precision's tiers (int8 must be packed too)")
    ap.add_argument("--set-routing", metavar="FILE", help="embed FILE as the routing prior of the packed checkpoint SRC "
                    "(its manifest is replaced whole; nothing is re-packed)")
    ap.add_argument("--clear-routing", action="store_true", help="remove the routing prior of the packed checkpoint SRC")
    args = ap.parse_args(argv)
    if args.set_routing or args.clear_routing:
        if args.dst or args.routing or args.set_routing and args.clear_routing:
            ap.error("--set-routing and --clear-routing take one packed checkpoint and nothing else to pack")
        try:
            manifest = set_routing_prior(args.src, None if args.clear_routing else args.set_routing)
        except EXPECTED_ERRORS as e:
            return _error(e, f"changing the routing prior of {args.src}")
        what = "removed" if manifest.routing_prior is None else f"embedded, counting {len(manifest.routing_prior)} MoE layers"
        print(f"{manifest.root}: routing prior {what}")
        return 0
    if not args.dst:
        ap.error("the following arguments are required: dst")
    precisions, options = list(DEFAULT_PRECISIONS), {}
    if args.config:
        try:
            cfg = load_config(args.config)
            precisions, options = precisions_needed(cfg), cfg.pack_options()
        except EXPECTED_ERRORS as e:
            return _error(e if args.config in str(e) else ValueError(f"--config {args.config!r}: {e}"), f"reading {args.config}")
    try:
        if args.precisions:
            precisions = list(dict.fromkeys(precisions + [p.strip() for p in args.precisions.split(",") if p.strip()]))
        summary = pack(args.src, args.dst, precisions=precisions, overwrite=args.overwrite, progress=not args.quiet, device=args.device,
                       routing=args.routing, options=options, calibration=args.calibration,
                       calibration_windows=args.calibration_windows, calibration_length=args.calibration_length,
                       min_sqnr=args.min_sqnr)
    except EXPECTED_ERRORS as e:
        return _error(e, f"packing {args.src} into {args.dst}")
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
