"""Does keeping the int4 experts of lowest SQNR at int8 (pack --min-sqnr) buy back int4's quality loss on a trained model?

    python experiments/min_sqnr_quality.py --model ../shared/models/qwen3-moe-bytes-6m --fractions 0.1,0.25,0.5 \\
        --out experiments/results/min_sqnr_quality.json

Packs the model once without ``--min-sqnr`` (bf16, int8, int4); for each fraction F, takes the
threshold below which F of the experts' recorded int4 SQNRs lie and packs with ``--min-sqnr`` at
it. As a control, for each F it also keeps as many experts at int8 chosen at random (``--seeds``
draws), written as pack writes a kept expert (its int4 reference aliases its int8 blob, manifest
resealed). Each pack's int4 is measured against its bf16 by ``tools/quality.py`` on the model's
held-out ``eval.txt``; the int4 tier's bytes are the sum of its experts' blob strides.
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from tiers.loader.manifest_parse import checksum
from tiers.loader.pack import pack
from tiers.loader.packed import MANIFEST, read_manifest
from tiers.tools import quality


def measure(root: Path, text: str, windows: int, scratch: Path, precision: str = "int4") -> dict:
    """tools/quality.py's row of ``precision`` for the pack at ``root``, with that tier's bytes and its experts kept at int8."""
    out = scratch / f"{root.name}-{precision}.json"
    rc = quality.main([str(root), text, "--precisions", precision, "--windows", str(windows), "--json", str(out), "--no-progress"])
    assert rc == 0, rc
    row = json.loads(out.read_text())["precisions"][precision]
    m = read_manifest(root)
    row["tier_bytes"] = sum(m.blob(k, precision).stride for k in m.keys)
    row["kept_at_int8"] = sum(m.ref(k, precision).encoding is not None for k in m.keys)
    return row


def keep_at_random(plain: Path, dst: Path, n: int, seed: int) -> None:
    """A copy of ``plain`` whose int4 references of ``n`` random experts alias their int8 blobs."""
    shutil.copytree(plain, dst)
    doc = json.loads((dst / MANIFEST).read_text())
    refs = [x for layer in doc["layers"] for x in layer["experts"]]
    for x in random.Random(seed).sample(refs, n):
        x["int4"] = {**x["int8"], "encoding": "int8"}
    doc["checksum"] = checksum(doc)
    (dst / MANIFEST).write_text(json.dumps(doc, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="../shared/models/qwen3-moe-bytes-6m")
    ap.add_argument("--fractions", default="0.1,0.25,0.5")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    text = str(Path(args.model) / "eval.txt")
    scratch = Path(tempfile.mkdtemp(prefix="min_sqnr_"))
    try:
        plain = scratch / "plain"
        pack(args.model, plain, precisions=("bf16", "int8", "int4"), progress=False)
        m = read_manifest(plain)
        sqnr = sorted(m.ref(k, "int4").sqnr_db for k in m.keys)
        result = {"command": shlex.join(["python", *sys.argv]), "model": args.model, "text": text, "windows": args.windows,
                  "experts": len(sqnr), "int4_sqnr_db": {"min": sqnr[0], "median": sqnr[len(sqnr) // 2], "max": sqnr[-1]},
                  "int4": measure(plain, text, args.windows, scratch), "int8": measure(plain, text, args.windows, scratch, "int8"),
                  "rows": []}
        for f in (float(x) for x in args.fractions.split(",")):
            n = round(f * len(sqnr))
            thr = sqnr[n]  # the experts strictly below it: n of them where SQNRs do not tie
            mixed = scratch / f"min_sqnr_{f}"
            pack(args.model, mixed, precisions=("bf16", "int8", "int4"), progress=False, min_sqnr=thr)
            row = {"fraction": f, "min_sqnr_db": thr, "by_sqnr": measure(mixed, text, args.windows, scratch), "at_random": []}
            for seed in range(args.seeds):
                rnd = scratch / f"random_{f}_{seed}"
                keep_at_random(plain, rnd, row["by_sqnr"]["kept_at_int8"], seed)
                row["at_random"].append(measure(rnd, text, args.windows, scratch))
            result["rows"].append(row)
            print(f"F={f}: {row['by_sqnr']['kept_at_int8']} kept, KL {row['by_sqnr']['mean_kl']:.5f} by SQNR, "
                  f"{[round(r['mean_kl'], 5) for r in row['at_random']]} at random", flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
