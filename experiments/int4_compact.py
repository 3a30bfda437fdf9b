"""Can int4 at group 32 keep its quality with compact statistics (8-bit scale code, 4-bit zero, one fp32 scale a row)?

    python experiments/int4_compact.py [--arms NAME,...] [--calibrations self,plain] [--out experiments/results/int4_compact.json]

On the CPU (``--threads``, 2 by default). The compact format stores, per group of G inputs, a
scale code ``k`` (uint8) and an integer zero point ``z`` (0..15, two a byte), and per row one
fp32 ``row_scale``: the group's scale is ``row_scale * SCALE_MAP[k]`` (one fp32 product), an
element decodes to ``(q - z) * scale`` in fp32, rounded once to bf16. That is
``4 + 12 / G + 32 / C`` bits a weight (4.417 at G = 32 and C = 768, 4.391 at C = 2048; on this
model's rows of 128 and 160 inputs, 4.625 and 4.6), against ``4 + 24 / G`` for today's fp16 scale
and 1/16-step zero point (4.75 at 32, 4.375 at 64).

Each arm packs ../shared/models/qwen3-moe-bytes-6m in bf16 + int4 and takes tiers-quality's
figures over eval.txt's 16 windows of 512 bytes (``experiments/int4_quality.py``'s). The
``base_*`` arms are ``quant.int4`` untouched: the former statistics (fp16 scale, zero point in
1/16 steps) when the experiment was run, the compact format itself since (commit after bff9f39;
the results' ``shipped_g32_*`` rows). A compact arm swaps int4's encoder for the
run: it stores the decoded bf16 values themselves (a ``data`` field, the path int4 keeps biases
in), which are exactly what the compact fields decode to, so the figures are the format's while
the loader is unchanged. Its fit: ``row_scale`` is the row's largest round-to-nearest group scale
(range with 0 included / 15) on the weights as given, times ``margin`` (GPTQ's updates can widen
later groups); then, per group (in GPTQ: at its first column, on the weights as the earlier
columns' errors left them), every zero point 0..15 with the scale codes within ``--window`` of
the codes nearest to the group's round-to-nearest scale and to its least-squares scale
(``quant.int4``'s alternating least squares), keeping the pair of least squared error, codes by
rounding. GPTQ itself is ``quant.gptq.quantize``'s loop with that group fit.

``--calibrations``: ``self`` is GPTQ calibrated on 64 windows of 512 bytes the model samples
itself (``experiments/self_calibration.py``'s sampling, from ``--seed``; cached in ``--cache``), ``plain`` no
calibration (the plain fit).
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages and the tests' helper
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [_root, os.path.join(_root, "tests"), os.path.join(_root, "experiments")]

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from quality import TRAINED_MODEL, eval_windows, trained_model_missing  # noqa: E402

LEVELS = 15
WINDOWS, LENGTH = 64, 512


@dataclass(frozen=True)
class Variant:
    """A compact arm: group size, scale map (``log<D>``: ``2**((k - 255) / D)``; ``linear``:
    ``(k + 1) / 256``; ``fp32``: the fitted scale unrounded, a reference for the integer zero
    alone) and the margin on the row scale."""

    group: int
    smap: str
    margin: float = 1.0

    def table(self) -> torch.Tensor | None:
        k = torch.arange(256, dtype=torch.float64)
        if self.smap == "fp32":
            return None
        if self.smap == "linear":
            return ((k + 1) / 256).to(torch.float32)
        assert self.smap.startswith("log"), self.smap
        return torch.exp2((k - 255) / float(self.smap[3:])).to(torch.float32)

    def bits(self, cols: int) -> float:
        g = next(d for d in range(min(self.group, cols), 0, -1) if cols % d == 0)
        n = cols // g
        return (cols * 4 + n * 8 + math.ceil(n / 2) * 8 + 32) / cols


def nearest_code(s: torch.Tensor, rs: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The index of ``table`` nearest (in log) to ``s / rs``, ``s`` and ``rs`` [n]."""
    r = (s / rs).clamp(min=1e-30).log()  # [n]
    return (table.log()[None, :] - r[:, None]).abs().argmin(dim=1)  # [n]


def fit_groups(x: torch.Tensor, rs: torch.Tensor, table: torch.Tensor | None, window: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [n, G] (float), group scales fp32 [n] (``rs * table[k]``) and integer zeros [n] (float)
    for groups ``x`` [n, G] of rows whose row scale is ``rs`` [n]: the least squared error over
    every zero point and the scale codes near the round-to-nearest and least-squares scales."""
    from tiers.quant import int4

    s0, off0 = int4._rtn(x)  # [n, 1] each
    s1, _ = int4._least_squares(x, s0, off0)
    if table is None:  # fp32 scales: the two fits, and a few steps around them
        cands = [c * (0.8 + 0.02 * i) for c in (s0[:, 0], s1[:, 0]) for i in range(31)]  # 0.8x to 1.4x
    else:
        ks = [nearest_code(s[:, 0], rs, table) for s in (s0, s1)]  # [n] each
        cands = [rs * table[(k + d).clamp(0, 255)] for k in ks for d in range(-window, window + 1)]
    z = torch.arange(LEVELS + 1, dtype=torch.float32)[None, :, None]  # [1, 16, 1]
    best_err = torch.full((x.shape[0],), float("inf"))
    best_s, best_z = torch.ones(x.shape[0]), torch.zeros(x.shape[0])
    for s in cands:  # [n]
        sv = s[:, None, None]  # [n, 1, 1]
        q = (x[:, None, :] / sv + z).round_().clamp_(0, LEVELS)  # [n, 16, G]
        err = ((q - z) * sv - x[:, None, :]).pow_(2).sum(-1)  # [n, 16]
        e, zi = err.min(dim=1)  # [n]
        take = e < best_err
        best_err = torch.where(take, e, best_err)
        best_s = torch.where(take, s, best_s)
        best_z = torch.where(take, zi.to(torch.float32), best_z)
    q = (x / best_s[:, None] + best_z[:, None]).round_().clamp_(0, LEVELS)
    return q, best_s, best_z


def row_scales(w: torch.Tensor, group: int, margin: float) -> torch.Tensor:
    """fp32 [R]: each row's largest round-to-nearest group scale of ``w`` [R, C], times ``margin``."""
    x = w.view(w.shape[0], -1, group)
    span = x.amax(-1).clamp(min=0) - x.amin(-1).clamp(max=0)  # [R, C/G]
    rs = span.amax(-1) / LEVELS * margin
    return torch.where(rs > 0, rs, torch.ones_like(rs))


def plain(w: torch.Tensor, group: int, v: Variant, window: int) -> torch.Tensor:
    """Decoded fp32 [R, C] of ``w`` [R, C], the fit alone."""
    rows, cols = w.shape
    rs = row_scales(w, group, v.margin)
    x = w.view(-1, group)  # [R * C/G, G]
    q, s, z = fit_groups(x, rs.repeat_interleave(cols // group), v.table(), window)
    return ((q - z[:, None]) * s[:, None]).view(rows, cols)


def gptq(w: torch.Tensor, hessian: torch.Tensor, group: int, v: Variant, window: int, damp: float = 0.01) -> torch.Tensor:
    """Decoded fp32 [R, C] of ``w`` [R, C] rounded by ``quant.gptq.quantize``'s loop, each group
    fitted as ``fit_groups`` does; ``row_scale`` from the weights as given."""
    from tiers.quant import gptq as g

    cols = w.shape[1]
    table = v.table()
    rs = row_scales(w, group, v.margin)  # [R]
    w = w.clone()
    h = hessian.to(torch.float32).clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    u = g._inverse_factor(h, damp)
    out = torch.empty_like(w)
    block = max(1, g.BLOCK // group) * group
    for a in range(0, cols, block):
        b = min(a + block, cols)
        wb = w[:, a:b]
        err = torch.empty_like(wb)
        ub = u[a:b, a:b]
        for i in range(b - a):
            if i % group == 0:
                _, s, z = fit_groups(wb[:, i:i + group].clone(), rs, table, window)  # [R] each
            col = wb[:, i]
            qc = (col / s + z).round().clamp(0, LEVELS)
            deq = (qc - z) * s
            out[:, a + i] = deq
            e = (col - deq) / ub[i, i]
            wb[:, i:].sub_(e[:, None] * ub[i, i:][None, :])
            err[:, i] = e
        w[:, b:].sub_(err @ u[a:b, b:])
    return out


def patch_int4(v: Variant, window: int):
    """Swap int4's encoder for ``v``'s (fields: the decoded bf16 values); returns the undo."""
    from tiers.quant import core, int4

    cls = int4.Int4
    saved = {n: cls.__dict__[n] for n in ("fields", "quantize")}

    def fields(self, shape, *, columns=False, group=int4.GROUP):
        return (core.FieldSpec("data", torch.bfloat16, tuple(shape)),)

    def quantize(self, weight, *, columns=False, group=int4.GROUP, hessian=None):
        shape = tuple(weight.shape)
        if weight.dim() < 2:
            return core.QuantizedTensor(self.name, shape, {"data": weight.detach().to(torch.bfloat16).contiguous()})
        w = weight.detach().to(torch.float32)
        w = w.transpose(-1, -2) if columns else w  # [*lead, R, C]
        cols = w.shape[-1]
        g = int4.group_of(cols, group)
        w2 = w.reshape(-1, cols).contiguous()
        d = gptq(w2, hessian, g, v, window) if hessian is not None else plain(w2, g, v, window)
        d = d.view(w.shape)
        d = d.transpose(-1, -2) if columns else d
        return core.QuantizedTensor(self.name, shape, {"data": d.to(torch.bfloat16).contiguous()})

    cls.fields, cls.quantize = fields, quantize

    def undo():
        cls.fields, cls.quantize = saved["fields"], saved["quantize"]
    return undo


ARMS = {
    "base_g32": None, "base_g64": None,
    "compact_g32_log32": Variant(32, "log32"),
    "compact_g32_log32_m1.3": Variant(32, "log32", 1.3),
    "compact_g32_log32_m2": Variant(32, "log32", 2.0),
    "compact_g32_log24_m1.5": Variant(32, "log24", 1.5),
    "compact_g32_log16_m1.3": Variant(32, "log16", 1.3),
    "compact_g32_log16_m2": Variant(32, "log16", 2.0),
    "compact_g32_linear": Variant(32, "linear"),
    "compact_g32_linear_m1.3": Variant(32, "linear", 1.3),
    "compact_g32_linear_m1.5": Variant(32, "linear", 1.5),
    "compact_g32_fp32": Variant(32, "fp32"),
    "compact_g64_log32_m1.3": Variant(64, "log32", 1.3),
}


def self_text(cache: Path, seed: int) -> Path:
    """The model's own 64 windows of 512 bytes as ids (.npy), sampled once into ``cache``: seed 0 is
    ``experiments/self_calibration.py``'s sample, another seed the same recipe from that seed."""
    if not cache.is_file():
        import self_calibration

        manual_seed = torch.manual_seed
        torch.manual_seed = lambda s: manual_seed(s + seed)  # sample() seeds 0, 1, ... one a batch
        try:
            np.save(cache, self_calibration.sample(WINDOWS).reshape(-1))
        finally:
            torch.manual_seed = manual_seed
    return cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated among {', '.join(ARMS)}")
    ap.add_argument("--calibrations", default="self,plain")
    ap.add_argument("--window", type=int, default=8, help="scale codes searched either side of each fit's nearest")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="the sampled text's seed (0: self_calibration.py's)")
    ap.add_argument("--cache", type=Path, help="where the sampled ids are kept (default /tmp/int4_compact_self64_seed<seed>.npy)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if (why := trained_model_missing()) is not None:
        sys.exit(why)
    torch.set_num_threads(args.threads)
    import int4_quality
    from tiers.loader.pack import pack

    ids = eval_windows((TRAINED_MODEL / "eval.txt").read_bytes(), 16, 512)
    result = {"command": "python experiments/int4_compact.py " + " ".join(sys.argv[1:]), "model": "../shared/models/qwen3-moe-bytes-6m",
              "eval": "16 windows of 512 bytes of eval.txt (experiments/int4_quality.py's)", "damp": 0.01, "window": args.window, "seed": args.seed,
              "note": "each arm's sampled text is its name's seed (none: 0); pack_seconds on 2 shared CPU cores",
              "self_text": f"{WINDOWS} windows of {LENGTH} bytes the model sampled (experiments/self_calibration.py's sample)", "arms": {}}
    if args.out and args.out.is_file():  # arms run before are kept (a run can be split), with their commands
        before = json.loads(args.out.read_text())
        result["arms"] = before["arms"]
        result["commands"] = (before["commands"] if "commands" in before else [before["command"]]) + [result.pop("command")]
    cache = args.cache or Path(f"/tmp/int4_compact_self64_seed{args.seed}.npy")
    text = self_text(cache, args.seed) if "self" in args.calibrations.split(",") else None
    with tempfile.TemporaryDirectory() as tmp:
        for arm in args.arms.split(","):
            v = ARMS[arm]
            group = 64 if arm == "base_g64" else 32 if v is None else v.group
            for cal in args.calibrations.split(","):
                name = f"{arm}_{cal}" + (f"_seed{args.seed}" if cal == "self" and args.seed else "")
                undo = patch_int4(v, args.window) if v is not None else (lambda: None)
                t0 = time.perf_counter()
                try:
                    pack(TRAINED_MODEL, Path(tmp) / name, precisions=["bf16", "int4"], progress=False,
                         calibration=text if cal == "self" else None, calibration_windows=WINDOWS, calibration_length=LENGTH,
                         options={"int4": {"group": group}})
                    seconds = round(time.perf_counter() - t0, 1)
                    figs = int4_quality.int4_figures(Path(tmp) / name, ids)
                finally:
                    undo()
                bits = {c: (Variant(group, "").bits(c) if v is not None else 4 + 24 / next(d for d in range(min(group, c), 0, -1) if c % d == 0))
                        for c in (128, 160, 768, 2048)}
                row = {"group": group, "smap": v and v.smap, "margin": v and v.margin, "calibration": cal, "pack_seconds": seconds,
                       "bits_by_row_length": bits, **figs}
                result["arms"][name] = row
                print(name, json.dumps(row), flush=True)
                if args.out:
                    args.out.write_text(json.dumps(result, indent=1) + "\n")
                shutil.rmtree(Path(tmp) / name)


if __name__ == "__main__":
    main()
