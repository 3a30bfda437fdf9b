"""Host time to count a static layer's prefill call: the engine's marks against the count it replaced.

    python bench/static_count.py [--model qwen3_moe] [--layers 12] [--experts 128] [--top-k 8]
                                 [--rows 2048] [--forwards 200] [--device cuda] --out FILE

A layer whose experts are all hot (every layer at a 100% budget) runs the untiered model's
experts forward; the only work Tiers adds is counting the call's distinct experts as GPU hits,
without a sync. On a host-bound prefill each kernel launch of that count shows in the prefill's
time. This loads a model of the given counts (tiny hidden sizes: the count depends on the counts
alone) at a 100% budget and times, for ``--forwards`` forwards of ``--rows`` tokens through every
layer, the host's time per layer call of

- ``marks``: ``TierManager.count_static`` (one ``index_fill_`` into the layer's row of marks;
  every ``STATIC_MARK_ROWS`` calls a sum and a clear), and
- ``before``: the count it replaced (a zeroed buffer, the marks, a slice summed and added: four
  launches per call),

alternating the two forward by forward, each timed from its first launch to its last with the
device synced before and after; the median and the fastest forward of each, and the two counts
(which must agree).
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402


def count_before(hits: torch.Tensor, n: int, top_k_index: torch.Tensor) -> None:
    """The count a static call made before the marks: four kernel launches per call."""
    used = torch.zeros(n + 1, dtype=torch.long, device=top_k_index.device)
    used.index_fill_(0, top_k_index.reshape(-1), 1)
    hits += used[:n].sum()


def measure(packed, *, rows: int, top_k: int, forwards: int, device: torch.device) -> dict:
    import tiers
    from tiers.integration import manager_of

    model = tiers.load(packed, {"tiers": {"gpu": {"fraction": 1.0}}}, device=device, progress=False)
    mgr = manager_of(model)
    layers = sorted(mgr.static_maps)
    n = mgr.manifest.layers[layers[0]].layout.num_experts
    g = torch.Generator().manual_seed(0)
    picks = [torch.randint(0, n, (rows, top_k), generator=g).to(device) for _ in layers]
    hits_before = torch.zeros((), dtype=torch.long, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def forward(how: str) -> float:
        sync()
        t0 = time.perf_counter()
        for L, idx in zip(layers, picks):
            if how == "marks":
                mgr.count_static(L, idx)
            else:
                count_before(hits_before, n, idx)
        t1 = time.perf_counter()
        sync()
        return (t1 - t0) / len(layers) * 1e6

    mgr.reset_stats()
    forward("marks"), forward("before")  # first launches apart
    mgr.reset_stats()
    hits_before.zero_()
    us: dict[str, list[float]] = {"marks": [], "before": []}
    for i in range(forwards):
        for how in (("marks", "before") if i % 2 == 0 else ("before", "marks")):
            us[how].append(forward(how))
    counted = {"marks": tiers.stats(model).hits["gpu"], "before": int(hits_before.item())}
    mgr.close()
    return {
        "layers": len(layers), "experts": n, "rows": rows, "top_k": top_k, "forwards": forwards,
        "host_us_per_call": {k: {"median": statistics.median(v), "fastest": min(v)} for k, v in us.items()},
        "hits_counted": counted, "counts_agree": counted["marks"] == counted["before"],
        "mark_rows": mgr.STATIC_MARK_ROWS,
    }


def main() -> int:
    from tiers.tools.measure import build_counts_model, write_result

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3_moe", choices=["qwen3_moe", "mixtral"])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rows", type=int, default=2048, help="tokens per forward (a prefill's)")
    ap.add_argument("--forwards", type=int, default=200)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    shape, packed, _ = build_counts_model(args, "tiers-static-count-")
    device = torch.device(args.device)
    result = {"command": "python bench/static_count.py " + " ".join(sys.argv[1:]), "shape": shape, "device": str(device),
              **measure(packed, rows=args.rows, top_k=args.top_k, forwards=args.forwards, device=device)}
    print({k: result[k] for k in ("host_us_per_call", "counts_agree")}, flush=True)
    write_result(args.out, result)
    return 0 if result["counts_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
