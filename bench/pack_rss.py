"""Peak memory of `pack` on a multi-GB checkpoint, against the size of its largest MoE layer.

    python bench/pack_rss.py [--workdir DIR] [--layers 4] [--hidden 2048] [--intermediate 5632] [--out bench/results/pack_rss.json]

Builds a random-weight Mixtral-style checkpoint with save_pretrained (sharded at 500MB), then
packs it (bf16 + int8) in a fresh child process and reads that child's peak RSS (VmHWM) and its
anonymous part at the end. The baseline is a child that imports the same modules and builds the
meta skeleton without packing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import sys, json, time
sys.path.insert(0, {root!r})
from transformers import AutoConfig
from tiers.loader.pack import pack
from tiers.loader.skeleton import build_skeleton
mode, src, dst = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
if mode == "pack":
    s = pack(src, dst, precisions=["bf16", "int8"], overwrite=True, progress=False)
    extra = {{"experts": s.experts, "bytes_per_precision": s.bytes_per_precision}}
else:
    build_skeleton(AutoConfig.from_pretrained(src))
    extra = {{}}
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
kib = lambda k: int(status[k].strip().split()[0]) * 1024
print(json.dumps({{"seconds": time.perf_counter() - t0, "peak_rss": kib("VmHWM"), "rss_anon_end": kib("RssAnon"), "rss_file_end": kib("RssFile"), **extra}}))
"""


def child(mode: str, src: Path, dst: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT)), mode, str(src), str(dst)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench/results/pack_rss.json"))
    args = ap.parse_args()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    work = Path(args.workdir or tempfile.mkdtemp(prefix="tiers-packrss-"))
    src, dst = work / "hf", work / "packed"
    cfg = AutoConfig.for_model("mixtral", hidden_size=args.hidden, intermediate_size=args.intermediate,
                               num_hidden_layers=args.layers, num_local_experts=args.experts, num_attention_heads=16,
                               num_key_value_heads=8, vocab_size=32000)
    if not (src / "config.json").exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(src, max_shard_size="500MB")
    ckpt_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    layer_bytes = args.experts * 3 * args.hidden * args.intermediate * 2
    base = child("skeleton", src, dst)
    t0 = time.perf_counter()
    packed = child("pack", src, dst)
    result = {
        "command": "python " + " ".join(sys.argv),
        "checkpoint_bytes": ckpt_bytes,
        "largest_moe_layer_bytes_bf16": layer_bytes,
        "expert_bytes_bf16": layer_bytes // args.experts,
        "baseline_peak_rss": base["peak_rss"],
        "pack": packed,
        "pack_wall_seconds": time.perf_counter() - t0,
        "peak_rss_over_baseline": packed["peak_rss"] - base["peak_rss"],
        "peak_rss_over_baseline_in_layers": (packed["peak_rss"] - base["peak_rss"]) / layer_bytes,
        "peak_rss_over_checkpoint": packed["peak_rss"] / ckpt_bytes,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
