"""tiers-inspect: summarize a packed checkpoint's manifest, or print a saved runtime manifest or stats JSON.

    python tools/inspect.py PACKED_DIR [--json]
    python tools/inspect.py manifest.json      # json.dump(tiers.manifest(model), ...)
    python tools/inspect.py stats.json         # json.dump(tiers.stats(model).as_dict(), ...)
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages, not this folder's files (this one shadows stdlib inspect)
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [os.path.dirname(_here)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

from tiers.loader.packed import read_manifest  # noqa: E402
from tiers.stats import TierStats  # noqa: E402


def describe(path: str) -> dict:
    m = read_manifest(path)
    out = {"path": str(m.root), "model_type": m.model_type, "precisions": list(m.precisions), "layers": []}
    for L, e in m.layers.items():
        row = {"layer": L, "module": e.module, "experts": e.layout.num_experts,
               "tensors": {t.name: list(t.shape) for t in e.layout.tensors}, "blob_bytes": {}, "min_sqnr_db": {},
               "kept_higher": {p: n for p in m.precisions if (n := e.layout.num_experts - e.encodings[p].get(p, 0))}}
        for p in m.precisions:
            row["blob_bytes"][p] = e.blobs[p].nbytes
            sq = [x[p].sqnr_db for x in e.experts if x[p].sqnr_db is not None]
            row["min_sqnr_db"][p] = min(sq) if sq else None
        out["layers"].append(row)
    out["experts"] = sum(r["experts"] for r in out["layers"])
    out["dense_bytes"] = sum(f["nbytes"] for f in m.dense_files.values())
    prior = m.routing_prior
    out["routing_prior"] = None if prior is None else {
        "layers": sorted(prior), "lookups": int(sum(sum(row) for row in prior.values()))}
    out["calibration"] = m.pack.get("calibration")  # pack --calibration: int4 rounded by GPTQ for this text
    out["min_sqnr_db"] = m.pack.get("min_sqnr_db")  # pack --min-sqnr: experts below it in int4 or nf4 kept at int8
    return out


def runtime_table(doc: dict) -> str:
    """A runtime manifest (``tiers.manifest``) as text: the summary, each pool's slots, the tiers' experts."""
    lines = list(doc.get("summary", []))
    for p in doc["pools"]:
        states: dict[str, int] = {}
        for s in p["slots"]:
            states[s["state"]] = states.get(s["state"], 0) + 1
        shapes = ", ".join(f"{t['name']} {tuple(t['shape'])}" for t in p["tensors"])
        lines.append(f"pool {p['index']}: layers {p['layers'][0]}-{p['layers'][-1]}, {p['count']} slots ({p['hot']} hot, {p['staging']} staging) "
                     f"of {p['slot_bytes'] / 2**20:.2f} MiB {p['dtype']} [{shapes}]; states: "
                     + ", ".join(f"{n} {k}" for k, n in sorted(states.items())))
    tiers: dict[str, list] = {}
    for e in doc["experts"]:
        tiers.setdefault(e["tier"], []).append(e)
    for tier in ("gpu", "cpu", "nvme"):
        es = tiers.get(tier, [])
        precisions = sorted({e["precision"] for e in es})
        kept: dict[str, int] = {}  # experts whose bytes use another precision's layout (pack --min-sqnr)
        for e in es:
            if e.get("encoding", e["precision"]) not in (e["precision"], "bf16"):
                kept[e["encoding"]] = kept.get(e["encoding"], 0) + 1
        lines.append(f"{tier}: {len(es)} experts, {sum(e['bytes'] for e in es) / 2**20:.1f} MiB ({', '.join(precisions) or '-'}"
                     + "".join(f", {n} kept at {enc}" for enc, n in sorted(kept.items())) + ")")
    host, gpu = doc["host"], doc["gpu"]
    lines.append(f"host slab: {host['capacity'] / 2**20:.1f} MiB, " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in host.items()
                                                                           if k not in ("capacity", "used", "pinned", "budget")))
    lines.append("gpu outside the budget: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in gpu["outside_budget"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tiers-inspect", description=__doc__.splitlines()[0])
    ap.add_argument("target", help="a packed directory, or a JSON file written from tiers.manifest(model) or tiers.stats(model).as_dict()")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    target = Path(args.target)
    try:
        if target.is_file():
            d = json.loads(target.read_text())
            if "pools" in d and "experts" in d:
                print(json.dumps(d, indent=1) if args.json else runtime_table(d))
                return 0
            print(json.dumps(d, indent=1) if args.json else TierStats(**{k: d[k] for k in (
                "residency", "hits", "misses", "bytes_moved", "stage_seconds", "stall_seconds", "gpu_slots", "memory", "device")}))
            return 0
        info = describe(args.target)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        print(f"tiers-inspect: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"{info['path']}: {info['model_type']}, {info['experts']} experts in {len(info['layers'])} MoE layers, "
          f"precisions {info['precisions']}, dense {info['dense_bytes'] / 2**20:.1f} MiB")
    prior = info["routing_prior"]
    print("routing prior: none (loads without a routing file place experts round-robin over layers)" if prior is None else
          f"routing prior: {prior['lookups']} lookups over MoE layers {prior['layers']} (loads without a routing file rank by it)")
    cal = info["calibration"]
    if cal:
        print(f"int4 calibrated (GPTQ) on {cal.get('tokens')} tokens of {cal.get('file')}"
              + (f"; {cal['uncalibrated']} experts no calibration token reached kept the plain fit" if "uncalibrated" in cal else ""))
    if info["min_sqnr_db"] is not None:
        kept: dict[str, int] = {}
        for r in info["layers"]:
            for p, n in r["kept_higher"].items():
                kept[p] = kept.get(p, 0) + n
        print(f"experts below {info['min_sqnr_db']:g} dB SQNR kept at a higher precision (--min-sqnr): "
              + (", ".join(f"{p} {n} of {info['experts']}" for p, n in kept.items()) or "none"))
    print(f"{'layer':>5}  {'experts':>7}  " + "  ".join(f"{p + ' KiB':>10} {p + ' dB':>8}" for p in info["precisions"]))
    for r in info["layers"]:
        cells = []
        for p in info["precisions"]:
            sq = r["min_sqnr_db"][p]
            cells.append(f"{r['blob_bytes'][p] / 1024:>10.1f} {'exact' if sq is None else f'{sq:.1f}':>8}")
        print(f"{r['layer']:>5}  {r['experts']:>7}  " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
