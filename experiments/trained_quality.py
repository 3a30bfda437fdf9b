"""Quality of the trained byte-level Qwen3-MoE through Tiers, against the untiered bf16 model.

    python experiments/trained_quality.py [--windows 16] [--length 512] [--out FILE]

Packs ../shared/models/qwen3-moe-bytes-6m (beside the repository) in bf16 and int8 into a temporary
folder, and runs ``--windows`` windows of ``--length`` bytes of its held-out eval.txt, evenly spaced
from its start to its end, in one batched forward on the CPU through

- ``transformers``: ``from_pretrained`` in bf16, its default experts implementation (grouped_mm);
- ``tiers_bf16``: gpu 25% bf16, cpu 50% bf16, the rest bf16 on disk;
- ``tiers_int8``: gpu 25% bf16 (hot), cpu 50% int8, the rest int8 on disk.

For each Tiers arm it prints the figures of tests/quality.py against ``transformers`` (bits per byte
of both, mean KL(transformers || arm) per predicted byte in nats, top-1 agreement), whether its
logits are bit-identical, the tier hits, and the spread of the per-window mean KL (its standard
error over windows). tests/tiers/test_trained_model.py checks the same figures on the same windows.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages and the tests' helper
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [_root, os.path.join(_root, "tests")]

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from quality import TRAINED_MODEL, eval_windows, figures, logits_of, trained_model_missing  # noqa: E402

ARMS = {
    "tiers_bf16": {"tiers": {"gpu": {"fraction": 0.25}, "cpu": {"fraction": 0.5, "precision": "bf16"}, "nvme": {"precision": "bf16"}}},
    "tiers_int8": {"tiers": {"gpu": {"fraction": 0.25}, "cpu": {"fraction": 0.5, "precision": "int8"}, "nvme": {"precision": "int8"}}},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--out", type=Path, help="write the JSON here too")
    args = ap.parse_args()
    if (why := trained_model_missing()) is not None:
        sys.exit(why)

    import tiers
    from tiers.loader.pack import pack

    ids = eval_windows((TRAINED_MODEL / "eval.txt").read_bytes(), args.windows, args.length)
    ref = AutoModelForCausalLM.from_pretrained(TRAINED_MODEL, dtype=torch.bfloat16).eval()
    ref_logits = logits_of(ref, ids)
    result = {
        "command": "python experiments/trained_quality.py " + " ".join(sys.argv[1:]),
        "model": "../shared/models/qwen3-moe-bytes-6m",
        "windows": {"count": args.windows, "length": args.length, "predictions": args.windows * (args.length - 1),
                    "text": "eval.txt, evenly spaced from its first byte to its last"},
        "device": "cpu", "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": {"version": transformers.__version__, "experts_implementation": ref.config._experts_implementation},
    }
    with tempfile.TemporaryDirectory() as tmp:
        packed = Path(tmp) / "packed"
        pack(TRAINED_MODEL, packed, precisions=["bf16", "int8"], progress=False)
        for arm, config in ARMS.items():
            model = tiers.load(packed, config, device="cpu", progress=False)
            logits = logits_of(model, ids)
            stats = tiers.stats(model).as_dict()
            per_window = [figures(ref_logits[w:w + 1], logits[w:w + 1], ids[w:w + 1]).mean_kl for w in range(args.windows)]
            result[arm] = {
                "config": config,
                **figures(ref_logits, logits, ids).as_dict(unit="byte"),
                "bit_identical": torch.equal(ref_logits, logits),
                "mean_kl_stderr": statistics.stdev(per_window) / len(per_window) ** 0.5 if len(per_window) > 1 else None,
                "mean_kl_per_window_min_max": [min(per_window), max(per_window)],
                "experts": {t: stats["residency"][t]["experts"] for t in ("gpu", "cpu", "nvme")},
                "hits": stats["hits"],
            }
            del model
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
