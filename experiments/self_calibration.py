"""Without a calibration text, does text the model writes itself calibrate int4's GPTQ as well as the repository's docs?

    python experiments/self_calibration.py [--windows 64,256] [--groups 64,32] [--out experiments/results/self_calibration.json]

On the CPU. Samples windows of 512 bytes from ../shared/models/qwen3-moe-bytes-6m itself (bf16,
transformers' generate, temperature 1, from a newline, 64 sequences a seed), saves them as token
ids (``.npy``: the model writes bytes that are not always UTF-8) and packs bf16 + int4 calibrated on
the first N windows of them (``pack(..., calibration=, calibration_windows=N)``), for each N of
``--windows``; then tiers-quality's figures over 16 windows of 512 bytes of eval.txt, as
``experiments/int4_quality.py`` takes them, beside that script's docs-calibrated arm on the same
windows, and the plain fit's, for each int4 group size of ``--groups`` (``tiers.int4.group``). The
recipe for a user is the same: generate with the model (through Tiers or
transformers), save the ids, pass them to ``tiers-pack --calibration ids.npy``.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages and the tests' helper
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [_root, os.path.join(_root, "tests"), os.path.join(_root, "experiments")]

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from quality import TRAINED_MODEL, eval_windows, trained_model_missing  # noqa: E402

BATCH, LENGTH = 64, 512


def sample(windows: int) -> np.ndarray:
    """``windows`` x ``LENGTH`` bytes the model writes, as int64 ids, ``BATCH`` sequences a seed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TRAINED_MODEL, dtype=torch.bfloat16).eval()
    out = []
    for seed in range(-(-windows // BATCH)):
        torch.manual_seed(seed)
        start = torch.full((BATCH, 1), ord("\n"))
        ids = model.generate(start, max_new_tokens=LENGTH - 1, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
        out.append(ids.numpy().astype(np.int64))
    return np.concatenate(out)[:windows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", default="64,256", help="comma-separated calibration window counts")
    ap.add_argument("--groups", default="64", help="comma-separated int4 group sizes")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if (why := trained_model_missing()) is not None:
        sys.exit(why)
    torch.set_num_threads(1)
    import int4_quality
    from tiers.loader.pack import pack

    counts = [int(n) for n in args.windows.split(",")]
    ids = eval_windows((TRAINED_MODEL / "eval.txt").read_bytes(), 16, 512)
    result = {"command": "python experiments/self_calibration.py " + " ".join(sys.argv[1:]), "model": "../shared/models/qwen3-moe-bytes-6m",
              "eval": "16 windows of 512 bytes of eval.txt (experiments/int4_quality.py's)", "damp": 0.01, "arms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "self.npy"
        np.save(text, sample(max(counts)).reshape(-1))
        arms = {"plain": (None, None), "docs": (int4_quality.calibration_file(Path(tmp)), 64), **{f"self_{n}": (text, n) for n in counts}}
        for group in (int(g) for g in args.groups.split(",")):
            for arm, (path, n) in arms.items():
                name = f"{arm}_group{group}"
                pack(TRAINED_MODEL, Path(tmp) / name, precisions=["bf16", "int4"], progress=False, calibration=path,
                     calibration_windows=n or 64, calibration_length=LENGTH, options={"int4": {"group": group}})
                row = {"group": group, "windows": n, **int4_quality.int4_figures(Path(tmp) / name, ids)}
                result["arms"][name] = row
                print(name, json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
