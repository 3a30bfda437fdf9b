"""Does GPTQ with a calibration text bring the trained model's int4 experts closer to bf16 than int4's plain fit?

    python experiments/int4_quality.py [--windows 16] [--length 512] [--out FILE]

Packs ../shared/models/qwen3-moe-bytes-6m (beside the repository) twice into a temporary folder, in
bf16 and int4 (its default group, ``quant.int4.GROUP``: 64 until int4 took compact statistics at 32):
once with int4's plain fit (no calibration data), once calibrated
(``pack(..., calibration=)``: GPTQ) on the repository's README.md and docs/*.md concatenated, 64
windows of 512 bytes (never eval.txt, the held-out text the figures are taken over). Then
tiers-quality's figures (``tiers.tools.quality``) over ``--windows`` windows of ``--length`` bytes of
eval.txt, every expert dequantized from int4 against every expert in bf16: mean KL per byte, bits
per byte, top-1 agreement. ``--damp`` lists further GPTQ dampings to measure (``quant.gptq``'s
``damp``, 0.01 by default); ``--text NAME=FILE`` further calibration texts, each an arm ``gptq_NAME``
(pack's defaults otherwise). tests/loader/test_calibration.py checks the same figures on fewer
windows.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages and the tests' helper
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [_root, os.path.join(_root, "tests")]

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from quality import TRAINED_MODEL, eval_windows, trained_model_missing  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def calibration_file(folder: Path) -> Path:
    """The repository's README.md and docs/*.md, concatenated, in ``folder``."""
    path = folder / "calibration.txt"
    path.write_text("\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]),
                    encoding="utf-8")
    return path


def int4_figures(packed: Path, ids: torch.Tensor) -> dict:
    """tiers-quality's figures of the pack's int4 against its bf16 over the windows ``ids``."""
    from tiers.tools.quality import loaded, measure

    class _Bar:
        def update(self, n):
            pass

    with loaded(str(packed), "bf16", "cpu") as ref, loaded(str(packed), "int4", "cpu") as model:
        return measure(ref, model, ids, 8, _Bar()).figures().as_dict(unit="byte")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--damp", default="", help="comma-separated further GPTQ dampings to measure (0.01 always)")
    ap.add_argument("--text", action="append", default=[], metavar="NAME=FILE", help="a further calibration text to measure")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: GPTQ's many small ops run fastest on one)")
    ap.add_argument("--out", type=Path, help="write the JSON here too")
    args = ap.parse_args()
    if (why := trained_model_missing()) is not None:
        sys.exit(why)

    torch.set_num_threads(args.threads)
    from tiers.loader.pack import pack
    from tiers.quant import gptq, int4

    ids = eval_windows((TRAINED_MODEL / "eval.txt").read_bytes(), args.windows, args.length)
    result = {"command": "python experiments/int4_quality.py " + " ".join(sys.argv[1:]),
              "model": "../shared/models/qwen3-moe-bytes-6m", "group": int4.GROUP,
              "windows": {"count": args.windows, "length": args.length, "predictions": args.windows * (args.length - 1),
                          "text": "eval.txt, evenly spaced from its first byte to its last"},
              "calibration": "README.md + docs/*.md concatenated, 64 windows of 512 bytes", "device": "cpu", "threads": args.threads,
              "torch": torch.__version__, "arms": {}}
    arms = {"plain": (None, None), "gptq": (0.01, None), **{f"gptq_damp_{d}": (float(d), None) for d in args.damp.split(",") if d},
            **{f"gptq_{t.partition('=')[0]}": (0.01, Path(t.partition('=')[2])) for t in args.text}}
    original = gptq.quantize
    with tempfile.TemporaryDirectory() as tmp:
        docs = calibration_file(Path(tmp))
        for arm, (damp, text) in arms.items():
            packed = Path(tmp) / arm
            t0 = time.perf_counter()
            if damp is not None:
                gptq.quantize = functools.partial(original, damp=damp)
            try:
                summary = pack(TRAINED_MODEL, packed, precisions=["bf16", "int4"], progress=False,
                               calibration=None if damp is None else text or docs)
            finally:
                gptq.quantize = original
            row = {"damp": damp, "text": None if damp is None else str(text or "README.md + docs/*.md"), "pack_seconds": round(time.perf_counter() - t0, 1), **int4_figures(packed, ids)}
            if summary.calibration:
                row["calibration"] = summary.calibration
            result["arms"][arm] = row
            print(arm, json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
