"""Does a checkpoint of gpt-oss-20b's real shapes, shipped in MXFP4, pack, load and decode near its bytes bound?

    PYTHONPATH=. python3 experiments/gpt_oss_full.py [--layers 24] [--tokens 32] [--prefill 2048] [--reps 3]
                                                      [--work DIR] [--out experiments/results/gpt_oss_full.json] [--tiny]

On a CUDA machine (``--tiny``: tiny shapes on the CPU, a smoke run of this script). Each phase
runs in a process of its own, so that each one's peak host RSS (VmHWM) is its own:

- ``write``: a random-weight checkpoint of gpt-oss-20b's shapes (24 layers of 32 experts, top-4,
  hidden and intermediate 2880, 64 query and 8 KV heads of 64, vocabulary 201088, sliding and full
  attention layers alternating), its experts as gpt-oss ships them: MXFP4 ``*_blocks`` (random
  bytes) and ``*_scales`` (random exponents 116-120, so that weights stay within +-0.05), bf16
  biases; every other tensor bf16. Written layer by layer, generated on the GPU.
- ``pack``: ``tiers.loader.pack.pack`` of it in the ``mxfp4`` precision (the checkpoint's bytes kept).
- one ``arm`` each, loaded from that pack with every tier in ``mxfp4`` (hot experts kept MXFP4 on
  the GPU, ``tiers.gpu.precision: mxfp4``; the committed result was measured at commit abe43ae,
  before hot experts stayed quantized, with them dequantized into bf16 slots at load; the rest warm
  in pinned RAM as MXFP4, 4.25 bits per weight over PCIe):
  - ``gpu25``: a GPU budget of 25% of the checkpoint's expert bytes (MXFP4), ``tiers.gpu.budget``;
  - ``gpu25_bf16``: ``tiers.gpu.fraction: 0.25``, 25% of the experts' bytes at bf16 (the YAML default);
  - ``all_hot``: every expert on the GPU (``fraction: 1.0``), the same model with nothing moved;

  every expert not hot is warm (a cpu budget that holds them all), so decode reads no disk.

  Per arm: load seconds and VmHWM, decode ms/token (``tools.measure.decode_ms_per_token``,
  ``--tokens`` greedy tokens at batch 1 from a 16-token prompt, CUDA graphs on as by default),
  a ``--prefill``-token prefill (median of ``--reps`` after a warm-up), the bytes each moves,
  peak GPU memory and the greedy tokens.

Host memory per phase: VmHWM, and the peak of RssAnon sampled every 10 ms (VmHWM also counts the
pages of the files a phase maps, which the page cache can drop; RssAnon is what it allocated,
pinned pool included).

Bounds: a decode token's (a prefill's) bytes over 55 GB/s, the H2D rate LIMITS.md gives; and
that plus the all-hot arm's time, the bench's bound (``tools.bench_bounds``).
"""
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

H2D_GB_S = 55.0
SHAPE = dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, num_attention_heads=64,
             num_key_value_heads=8, head_dim=64, vocab_size=201088, sliding_window=128, layers=24)
TINY = dict(hidden_size=64, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, sliding_window=8, layers=4)
SCALES = (116, 121)  # exponent bytes drawn from [116, 121): blocks scaled by 2**-11 .. 2**-7, values within +-0.047
ARMS = {
    "gpu25": None,  # gpu.budget: 25% of the MXFP4 expert bytes, set in ``arm``
    "gpu25_bf16": {"fraction": 0.25},
    "all_hot": {"fraction": 1.0},
}


def config(shape: dict):
    from transformers import GptOssConfig

    kw = dict(shape)
    layers = kw.pop("layers")
    return GptOssConfig(num_hidden_layers=layers, layer_types=["sliding_attention", "full_attention"] * (layers // 2), **kw)


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def vm_hwm_mb() -> float:
    """This process's peak resident set (VmHWM), MB: mapped file pages it touched count too."""
    return _status_mb("VmHWM")


class AnonPeak:
    """The peak of this process's anonymous resident memory (RssAnon: not the page cache's
    mapped file pages, which VmHWM also counts), sampled every 10 ms on a thread, MB."""

    def __init__(self):
        import threading

        self.peak, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _status_mb("RssAnon"))
            self._stop.wait(0.01)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _status_mb("RssAnon"))


def _random(name: str, shape: tuple, gen: torch.Generator, device) -> dict[str, torch.Tensor]:
    """One checkpoint tensor (or, for an experts weight, its MXFP4 blocks and scales), on the CPU."""
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        e, k, n = shape  # the module's layout [experts, in, out]; MXFP4 runs its blocks along ``in``
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=gen, device=device, dtype=torch.uint8)
        scales = torch.randint(*SCALES, (e, n, k // 32), generator=gen, device=device, dtype=torch.uint8)
        return {name + "_blocks": blocks.cpu(), name + "_scales": scales.cpu()}
    if len(shape) == 1 and "norm" in name:
        return {name: torch.ones(shape, dtype=torch.bfloat16)}
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02)
    return {name: t.to(torch.bfloat16).cpu()}


def write(src: Path, shape: dict, device) -> dict:
    """The checkpoint, one safetensors file per layer and one for the rest, with its index and config."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    cfg = config(shape)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    groups: dict[str, list[str]] = {}
    for k in shapes:
        part = k.split(".")
        groups.setdefault(f"layer{int(part[2]):03d}" if k.startswith("model.layers.") else "rest", []).append(k)
    gen = torch.Generator(device=device).manual_seed(0)
    src.mkdir(parents=True)
    weight_map, total = {}, 0
    for i, (group, names) in enumerate(sorted(groups.items())):
        tensors = {}
        for k in names:
            tensors.update(_random(k, shapes[k], gen, device))
        fname = f"model-{i:05d}.safetensors"
        save_file(tensors, str(src / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    doc = cfg.to_dict()
    doc["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (src / "config.json").write_text(json.dumps(doc, indent=1))
    return {"checkpoint_bytes": total, "files": len(groups)}


def pack_phase(src: Path, dst: Path, device) -> dict:
    from tiers.loader.pack import pack

    pack(src, dst, precisions=("mxfp4",), overwrite=True, progress=False, device=device)
    return {}


def _moved(model) -> int:
    import tiers

    return sum(tiers.stats(model).as_dict()["bytes_moved"].values())


def _gen(model, prompt, n: int):
    return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)


def arm(packed: Path, name: str, args, device) -> dict:
    """Load ``packed`` as arm ``name`` and measure it (see the module docstring)."""
    import tiers
    from tiers.tools.measure import decode_ms_per_token, prefill_seconds, sync

    sizes = json.loads(Path(args.work, "expert_bytes.json").read_text())
    gpu = ARMS[name] or {"budget": int(0.25 * sizes["mxfp4"])}
    cfg = {"tiers": {"gpu": {**gpu, "precision": "mxfp4"}, "cpu": {"budget": sizes["mxfp4_stride"], "precision": "mxfp4"},
                     "nvme": {"precision": "mxfp4"}}}
    t0 = time.perf_counter()
    model = tiers.load(packed, cfg, device=device, progress=False)
    sync(device)
    out = {"config": cfg, "load_s": time.perf_counter() - t0, "load_vm_hwm_mb": vm_hwm_mb(), "load_rss_anon_mb": _status_mb("RssAnon")}
    placed = tiers.manifest(model)
    out["tiers"] = {t: sum(e["tier"] == t for e in placed["experts"]) for t in ("gpu", "cpu", "nvme")}
    out["hot"] = sum(e["hot"] for e in placed["experts"])
    out["staging_slots"] = sum(p["staging"] for p in placed["pools"])
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(1)).to(device)
    long = torch.randint(0, vocab, (1, args.prefill), generator=torch.Generator().manual_seed(2)).to(device)
    out["tokens"] = _gen(model, prompt, args.tokens)[0, 16:].tolist()  # also the warm-up
    before = _moved(model)
    _gen(model, prompt, 1)
    one = _moved(model) - before
    _gen(model, prompt, args.tokens + 1)
    out["decode_bytes_per_token"] = (_moved(model) - before - 2 * one) / args.tokens
    out["decode_ms_per_token"] = decode_ms_per_token(model, prompt, args.tokens, device, args.reps)
    before = _moved(model)
    with torch.no_grad():
        model(long)
    out["prefill_bytes"] = _moved(model) - before
    out["prefill_s"] = prefill_seconds(model, long, device, args.reps)
    out["stats"] = tiers.stats(model).as_dict()
    if device.type == "cuda":
        out["peak_gpu_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    out["vm_hwm_mb"] = vm_hwm_mb()
    return out


def child(phase: str, args, extra: list[str] = ()) -> dict:
    """Run ``phase`` in a fresh interpreter; its result, with its wall time and VmHWM."""
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", phase, "--work", args.work, "--layers", str(args.layers),
           "--tokens", str(args.tokens), "--prefill", str(args.prefill), "--reps", str(args.reps), *extra]
    if args.tiny:
        cmd.append("--tiny")
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    result = json.loads(Path(args.work, f"{phase}{'-' + extra[-1] if extra else ''}.json").read_text())
    result["wall_s"] = time.perf_counter() - t0
    print(phase, *extra, json.dumps({k: v for k, v in result.items() if k not in ("stats", "tokens")}), flush=True)
    return result


def bounds(arms: dict) -> dict:
    """Each offloaded arm against its bytes bound and against all-hot."""
    hot = arms["all_hot"]
    out = {}
    for name, a in arms.items():
        if name == "all_hot":
            continue
        dec = a["decode_bytes_per_token"] / H2D_GB_S / 1e6  # ms
        pre = a["prefill_bytes"] / H2D_GB_S / 1e9  # s
        out[name] = {
            "decode_bytes_bound_ms": dec, "decode_over_bytes_bound": a["decode_ms_per_token"] / dec if dec else None,
            "decode_over_bound_with_all_hot": a["decode_ms_per_token"] / (dec + hot["decode_ms_per_token"]),
            "decode_over_all_hot": a["decode_ms_per_token"] / hot["decode_ms_per_token"],
            "prefill_bytes_bound_s": pre, "prefill_over_bytes_bound": a["prefill_s"] / pre if pre else None,
            "prefill_over_bound_with_all_hot": a["prefill_s"] / (pre + hot["prefill_s"]),
            "prefill_over_all_hot": a["prefill_s"] / hot["prefill_s"],
            "same_tokens_as_all_hot": a["tokens"] == hot["tokens"],
        }
    return out


def expert_bytes(packed: Path) -> dict:
    """The pack's experts: their count, their bytes in ``mxfp4`` and at bf16, and their host
    pool's bytes (``mxfp4_stride``: each blob's stride in the pool, which holds them all)."""
    from tiers.loader.layout import ExpertKey
    from tiers.loader.packed import read_manifest

    m = read_manifest(packed)
    out = {"experts": 0, "mxfp4": 0, "bf16": 0, "mxfp4_stride": 0}
    for L, entry in m.layers.items():
        n = entry.layout.num_experts
        out["experts"] += n
        out["bf16"] += n * entry.layout.nbytes(torch.bfloat16)
        out["mxfp4"] += sum(m.ref(ExpertKey(L, e), "mxfp4").nbytes for e in range(n))
        out["mxfp4_stride"] += n * entry.blobs["mxfp4"].stride
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--work", default=None, help="where the checkpoint and the pack go (default: a new temporary folder)")
    ap.add_argument("--out", default="experiments/results/gpt_oss_full.json")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--phase", choices=["write", "pack", "arm"], help=argparse.SUPPRESS)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    shape = dict(TINY if args.tiny else SHAPE)
    args.layers = shape["layers"] = args.layers or shape["layers"]
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.phase:
        work = Path(args.work)
        anon = AnonPeak()
        t0 = time.perf_counter()
        if args.phase == "write":
            result = write(work / "hf", shape, device)
        elif args.phase == "pack":
            result = pack_phase(work / "hf", work / "packed", device)
            Path(work, "expert_bytes.json").write_text(json.dumps(expert_bytes(work / "packed")))
        else:
            result = arm(work / "packed", args.arm, args, device)
        result.update(seconds=time.perf_counter() - t0, vm_hwm_mb=vm_hwm_mb(), peak_rss_anon_mb=anon.stop())
        Path(work, f"{args.phase}{'-' + args.arm if args.arm else ''}.json").write_text(json.dumps(result))
        return 0
    own = args.work is None
    args.work = args.work or tempfile.mkdtemp(prefix="tiers-gpt-oss-")
    argv = [a for i, a in enumerate(sys.argv[1:]) if a not in ("--out", "--work") and sys.argv[i] not in ("--out", "--work")]
    result = {"command": "python3 experiments/gpt_oss_full.py " + " ".join(argv), "shape": shape, "torch": torch.__version__,
              "device": "cpu" if args.tiny else torch.cuda.get_device_name(device)}
    try:
        result["write"] = child("write", args)
        result["pack"] = child("pack", args)
        result["expert_bytes"] = json.loads(Path(args.work, "expert_bytes.json").read_text())
        shutil.rmtree(Path(args.work, "hf"))
        result["arms"] = {a: child("arm", args, ["--arm", a]) for a in args.arms.split(",")}
        if "all_hot" in result["arms"]:
            result["bounds"] = bounds(result["arms"])
    finally:
        if own:
            shutil.rmtree(args.work, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result.get("bounds"), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
