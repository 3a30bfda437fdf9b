"""What does checking every cold read (``tiers.load(..., verify="always")``) cost decode, against the first read only?

    PYTHONPATH=. python3 experiments/verify_cost.py [--layers 12] [--tokens 32] [--reps 6] [--out experiments/results/verify_cost.json]

On a CUDA machine. Builds the bench's random-weight Qwen3-30B-A3B shapes (``tools.measure.SHAPES``),
packs them in bf16 and INT8, and loads two models of each placement, one per ``verify`` mode:

- ``bench``: the bench's 25% INT8 arm (``tiers_25_int8``): 25% of expert bytes hot in bf16, every
  other expert warm in pinned RAM as INT8 (a cpu budget of all experts' bf16 bytes); decode never
  reads the disk;
- ``warm``: as ``bench`` but a cpu fraction of 0.75, which leaves some experts cold;
- ``cold``: 25% hot, 25% of experts warm in INT8 and the rest cold (INT8 on disk), the page
  cache warm (the files were just written);
- ``cold_disk``: the same two models, the expert files' page cache dropped before every
  repetition, so cold reads come from the disk.

Per placement, repetitions alternate the two modes (which goes first alternates too); each is
``tools.measure.decode_ms_per_token`` of ``--tokens`` greedy tokens at batch 1 (CUDA graphs on,
as the YAML default). Records the median of each mode, their ratio, the bytes per token each
source tier moved, and that both modes generate the same tokens. Also the host's ``zlib.crc32``
rate, which bounds the check: an INT8 expert of these shapes is 4.7 MB.
"""
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

MODES = ("first", "always", "always_1mib")  # the last: "always" with the disk store's chunks at 1 MiB, not 8
PLACEMENTS = {  # "bench" holds every expert not hot warm, as tools.bench_arms.tiers_config does: its budget is set in main
    "bench": {"gpu": {"fraction": 0.25}, "cpu": {"budget": None, "precision": "int8"}, "nvme": {"precision": "int8"}},
    "warm": {"gpu": {"fraction": 0.25}, "cpu": {"fraction": 0.75, "precision": "int8"}, "nvme": {"precision": "int8"}},
    "cold": {"gpu": {"fraction": 0.25}, "cpu": {"fraction": 0.25, "precision": "int8"}, "nvme": {"precision": "int8"}},
}


def crc_rate(nbytes: int = 256 << 20, reps: int = 3) -> float:
    """``zlib.crc32`` GB/s over ``nbytes`` of random bytes, best of ``reps``."""
    data = os.urandom(nbytes)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        zlib.crc32(data)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def moved(model) -> dict:
    import tiers

    return dict(tiers.stats(model).as_dict()["bytes_moved"])


def timed_pair(models: dict, prompt, args, device, drop: list | None) -> dict:
    """Alternating repetitions of each mode's decode: ms/token per repetition and bytes per token per tier."""
    from tiers.store.disk_store import drop_page_cache
    from tiers.tools.measure import decode_ms_per_token

    modes = list(models)
    ms = {m: [] for m in modes}
    bytes_per_token = {}
    for r in range(args.reps):
        for mode in (modes if r % 2 == 0 else modes[::-1]):  # each mode first as often as last
            if drop is not None:
                drop_page_cache(drop)
            before = moved(models[mode])
            ms[mode].append(decode_ms_per_token(models[mode], prompt, args.tokens, device, 1))
            after = moved(models[mode])
            # generate 1 and generate tokens+1: (tokens + 2) tokens' lookups, the prompt's prefill twice
            bytes_per_token[mode] = {k: (after[k] - before.get(k, 0)) / (args.tokens + 2) for k in after}
    med = {m: statistics.median(v) for m, v in ms.items()}
    return {"ms_per_token": ms, "median_ms_per_token": med, "over_first": {m: med[m] / med["first"] for m in modes[1:]},
            "bytes_per_token_incl_prefill": bytes_per_token}


def load(packed: Path, cfg: dict, device, mode: str):
    """``tiers.load`` in ``mode``: its ``verify``, and for ``always_1mib`` 1 MiB disk chunks."""
    import functools

    import tiers
    import tiers.manager

    if mode != "always_1mib":
        return tiers.load(packed, cfg, device=device, progress=False, verify=mode)
    real = tiers.manager.DiskStore
    tiers.manager.DiskStore = functools.partial(real, chunk_bytes=1 << 20)
    try:
        return tiers.load(packed, cfg, device=device, progress=False, verify="always")
    finally:
        tiers.manager.DiskStore = real


def run_placement(name: str, packed: Path, prompt, args, device) -> dict:

    cfg = {"tiers": PLACEMENTS[name]}
    if name == "bench":
        cfg["tiers"]["cpu"]["budget"] = args.expert_bytes
    models = {m: load(packed, cfg, device, m) for m in args.modes}
    kw = dict(do_sample=False, pad_token_id=0, max_new_tokens=16, min_new_tokens=16)
    tokens = {m: models[m].generate(prompt, **kw)[0].tolist() for m in models}  # also the warm-up
    out = {name: timed_pair(models, prompt, args, device, None)}
    out[name]["same_tokens"] = all(t == tokens["first"] for t in tokens.values())
    if name == "cold":
        files = sorted({str(packed / f) for f in os.listdir(packed) if f.endswith(".safetensors")})
        out["cold_disk"] = timed_pair(models, prompt, args, device, files)
    del models
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--hf-dir", default="/dev/shm/tiers-verify-hf")
    ap.add_argument("--out", default="experiments/results/verify_cost.json")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {MODES}, the first one the baseline")
    ap.add_argument("--placements", default="warm,cold", help=f"of {tuple(PLACEMENTS)}; cold also runs cold_disk")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: a smoke run of this script")
    args = ap.parse_args()
    args.modes = args.modes.split(",")
    from tiers.loader.pack import pack
    from tiers.tools.measure import SHAPES, TINY, build, expert_bytes_of

    device = torch.device("cpu" if args.tiny else "cuda")
    argv = [a for i, a in enumerate(sys.argv[1:]) if a != "--out" and sys.argv[i] != "--out"]  # no machine's path
    result = {"command": "python3 experiments/verify_cost.py " + " ".join(argv),
              "device": "cpu" if args.tiny else torch.cuda.get_device_name(device),
              "torch": torch.__version__, "zlib": zlib.ZLIB_RUNTIME_VERSION, "crc32_gb_s": crc_rate(), "tokens": args.tokens, "reps": args.reps}
    shape = dict((TINY if args.tiny else SHAPES)["qwen3_moe"], layers=args.layers)
    result["shape"] = shape
    model = build("qwen3_moe", shape, device)
    args.expert_bytes = result["expert_bytes_bf16"] = expert_bytes_of(model)
    prompt = torch.randint(0, shape["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(1)).to(device)
    work = Path(tempfile.mkdtemp(prefix="tiers-verify-"))
    t0 = time.perf_counter()
    model.save_pretrained(args.hf_dir)
    del model
    pack(args.hf_dir, work / "packed", precisions=["bf16", "int8"], overwrite=True, progress=False, device=device)
    shutil.rmtree(args.hf_dir, ignore_errors=True)
    result["save_and_pack_s"] = time.perf_counter() - t0
    try:
        for name in args.placements.split(","):
            result.update(run_placement(name, work / "packed", prompt, args, device))
            print(json.dumps({k: result[k] for k in result if k in (*PLACEMENTS, "cold_disk")}, indent=1), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
