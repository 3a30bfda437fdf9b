"""tiers-pack: convert a Hugging Face MoE checkpoint directory into the packed tier format.

    python tools/pack.py SRC DST [--config tiers.yaml] [--precisions bf16,int8] [--overwrite]
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages, not this folder's files
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [os.path.dirname(_here)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

import argparse  # noqa: E402

from loader.pack import DEFAULT_PRECISIONS, pack  # noqa: E402
from tiers.config import load_config, precisions_needed  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tiers-pack", description=__doc__.splitlines()[0])
    ap.add_argument("src", help="directory written by transformers' save_pretrained")
    ap.add_argument("dst", help="output directory (created atomically)")
    ap.add_argument("--config", help="tiers YAML: pack the precisions it names (plus bf16)")
    ap.add_argument("--precisions", help=f"comma-separated precisions (default: {','.join(DEFAULT_PRECISIONS)})")
    ap.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--device", default="cpu", help="where to quantize experts: cpu (default) or cuda (faster for large models)")
    args = ap.parse_args(argv)
    precisions = list(DEFAULT_PRECISIONS)
    if args.config:
        precisions = precisions_needed(load_config(args.config))
    if args.precisions:
        precisions = list(dict.fromkeys(precisions + [p.strip() for p in args.precisions.split(",") if p.strip()]))
    try:
        summary = pack(args.src, args.dst, precisions=precisions, overwrite=args.overwrite, progress=not args.quiet, device=args.device)
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        print(f"tiers-pack: error: {e}", file=sys.stderr)
        return 2
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
