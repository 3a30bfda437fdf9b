"""A prefill's timeline without a profiler: host clock readings and CUDA events at marked points.

A profiler slows the host about two-fold, which changes whether the copy engine waits on Python or
Python on the GPU, so these marks use clocks alone: ``hook_layers`` marks each decoder layer's start
and each experts call's start and end; ``instrument`` adds, for a Tiers model, the return of each
call's route sync, each streamed part's copies (events on the copy stream), each part's kernels and
read-aheads; ``split`` turns one prefill's marks into per-layer and total figures (the copy
stream's busy time, its gaps within a layer and at layer boundaries, the tails; the fields are
described in ``experiments/prefill_split.py``). ``marking`` takes the marks over a block, ``marked_prefill`` over one
prefill. Used by that script and by ``tools/bench.py --prefill-marks``.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
import traceback
import warnings

import torch


class Marks:
    """Host clock readings and device events at named points, on a chosen stream."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.raw: list[tuple[str, int, float, object]] = []
        self.on = False
        self.layer = 0  # the layer of the last mark

    def mark(self, what: str, layer: int, stream=None) -> None:
        if not self.on:
            return
        self.layer = layer
        ev = None
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)  # None: the current stream
        self.raw.append((what, layer, time.perf_counter(), ev))

    def resolved(self) -> list[tuple[str, int, float, float]]:
        """(what, layer, host ms, device ms) from the first mark; device NaN without CUDA."""
        if not self.raw:
            return []
        if self.cuda:
            torch.cuda.synchronize()
        h0, e0 = self.raw[0][2], self.raw[0][3]
        return [(w, L, (t - h0) * 1e3, e0.elapsed_time(ev) if self.cuda else float("nan")) for w, L, t, ev in self.raw]


def split(marks: list[tuple[str, int, float, float]]) -> dict:
    """Per-layer and total figures of one prefill from its resolved marks (see the module's doc)."""
    by_layer: dict[int, list] = {}
    for m in marks:
        by_layer.setdefault(m[1], []).append(m)
    done = sorted(d for w, _, _, d in marks if w in ("copy_end", "ahead_end"))  # the copy stream runs in order
    rows = []
    layer_at = {L: (h, d) for w, L, h, d in marks if w == "layer"}
    for layer in sorted(by_layer):
        ms = by_layer[layer]
        first = {}
        for w, _, h, d in ms:
            first.setdefault(w, (h, d))
        starts = [d for w, _, _, d in ms if w == "copy_start"]
        ends = [d for w, _, _, d in ms if w == "copy_end"]
        row = {"layer": layer}
        if layer in layer_at and layer + 1 in layer_at:
            row["host_layer_ms"] = layer_at[layer + 1][0] - layer_at[layer][0]
            row["device_layer_ms"] = layer_at[layer + 1][1] - layer_at[layer][1]
        if "experts" in first and "layer" in first:
            row["host_attn_ms"] = first["experts"][0] - first["layer"][0]
        if "routed" in first and "experts" in first:
            row["host_route_ms"] = first["routed"][0] - first["experts"][0]
        if "experts_end" in first and "routed" in first:
            row["host_call_ms"] = first["experts_end"][0] - first["routed"][0]
        if starts:
            row["parts"] = len(starts)
            row["copy_ms"] = sum(e - s for s, e in zip(starts, ends))
            row["copy_gaps_ms"] = sum(s - e for e, s in zip(ends, starts[1:]))  # in order: s >= e
            last_copy = max((d for d in done if d <= starts[0]), default=None)
            if last_copy is not None:
                row["boundary_ms"] = starts[0] - last_copy
                if "routed" in first:
                    row["boundary_gpu_ms"] = first["routed"][1] - last_copy
                    row["boundary_plan_ms"] = starts[0] - first["routed"][1]
            if "experts_end" in first:
                row["tail_ms"] = first["experts_end"][1] - ends[-1]
        k0 = [d for w, _, _, d in ms if w == "kernels"]
        k1 = [d for w, _, _, d in ms if w == "kernels_end"]
        if k0 and len(k0) == len(k1):
            row["kernel_ms"] = sum(b - a for a, b in zip(k0, k1))
        rows.append(row)
    streamed = [r for r in rows if "copy_ms" in r]
    fields = sorted({k for r in rows for k in r} - {"layer"})
    out = {"layers": rows, "median": {k: statistics.median(r[k] for r in rows if k in r) for k in fields}}
    ends = [d for w, _, _, d in marks if w == "experts_end"]
    device_ms = (max(ends) - marks[0][3]) if ends else float("nan")
    copy_ms = sum(r["copy_ms"] for r in streamed)
    out["total"] = {"device_ms": device_ms, "host_ms": max(h for _, _, h, _ in marks), "copy_ms": copy_ms,
                    "copy_busy": copy_ms / device_ms if device_ms else float("nan"),
                    "copy_gaps_ms": sum(r["copy_gaps_ms"] for r in streamed),
                    "boundary_ms": sum(r.get("boundary_ms", 0.0) for r in streamed),
                    "boundary_gpu_ms": sum(r.get("boundary_gpu_ms", 0.0) for r in streamed),
                    "boundary_plan_ms": sum(r.get("boundary_plan_ms", 0.0) for r in streamed),
                    "tail_ms": sum(r.get("tail_ms", 0.0) for r in streamed), "streamed_layers": len(streamed)}
    return out


def hook_layers(model, marks: Marks) -> list:
    """Marks at each decoder layer's start and its experts call's start and end; returns the undo callables."""
    undo = []
    for i, layer in enumerate(model.model.layers):
        undo.append(layer.register_forward_pre_hook(lambda m, a, i=i: marks.mark("layer", i)).remove)
        experts = layer.mlp.experts
        undo.append(experts.register_forward_pre_hook(lambda m, a, i=i: marks.mark("experts", i)).remove)
        undo.append(experts.register_forward_hook(lambda m, a, o, i=i: marks.mark("experts_end", i)).remove)
    return undo


def wrap_call(obj, attr: str, before=None, after=None):
    """Replace ``obj.attr`` by a wrapper that calls ``before`` and ``after`` (each with the call's
    arguments) around it; returns the callable that undoes it."""
    fn = getattr(obj, attr)

    def wrapped(*a, **k):
        if before:
            before(*a, **k)
        out = fn(*a, **k)
        if after:
            after(*a, **k)
        return out
    setattr(obj, attr, wrapped)
    return lambda: delattr(obj, attr)


def instrument(model, mgr, marks: Marks) -> list:
    """Hooks and wrappers that mark a Tiers ``model``'s prefill; returns the undo callables."""
    undo = hook_layers(model, marks)
    copy = mgr.staging.copy_stream
    pending: list = []  # the layer of a part whose first read is not queued yet

    def wrap(obj, attr: str, before=None, after=None) -> None:
        undo.append(wrap_call(obj, attr, before, after))

    def part_begins(s, p):
        pending[:] = [s.layer]

    def part_ends(s, p):
        if not pending:  # a read was queued: the copy stream's last work is this part's copies
            marks.mark("copy_end", s.layer, copy)
        pending.clear()

    def first_read(key, *a):
        if pending:
            marks.mark("copy_start", pending[0], copy)  # after the part's wait for its buffer
            pending.clear()
    # a host-routed call counts itself right after its routing sync returns
    wrap(mgr, "count_call", before=lambda layer, *a, **k: marks.mark("routed", layer))
    wrap(mgr.streamed, "read_part", part_begins, part_ends)
    wrap(mgr.staging, "fetch", first_read)
    wrap(mgr.streamed, "wait_part", after=lambda s, p: marks.mark("kernels", s.layer))
    wrap(mgr.streamed, "end_part", after=lambda s, p: marks.mark("kernels_end", s.layer))
    # the plan's upload: does it wait behind the copy stream's reads?
    wrap(mgr.uploads, "int_lists", before=lambda *a, **k: marks.mark("upload", marks.layer),
         after=lambda *a, **k: marks.mark("uploaded", marks.layer))
    return undo


@contextlib.contextmanager
def marking(model, mgr, marks: Marks):
    """``instrument``'s marks on a Tiers ``model`` and its manager, taken while the block runs
    (``marks.on``); the hooks and wrappers are undone after it, whatever it raised."""
    undo = instrument(model, mgr, marks)
    try:
        marks.on = True
        yield
    finally:
        marks.on = False
        for u in reversed(undo):
            u()


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _where(f) -> tuple[str, bool]:
    """A frame as ``path:line`` (relative to this repository, from ``site-packages`` on, or the
    file's name alone), and whether it is this repository's code."""
    path = os.path.abspath(f.filename)
    installed = os.sep + "site-packages" + os.sep
    if path.startswith(_REPO + os.sep) and installed not in path:
        return f"{os.path.relpath(path, _REPO)}:{f.lineno}", True
    return f"{path.split(installed)[-1] if installed in path else os.path.basename(path)}:{f.lineno}", False


def _site(frames: list) -> str:
    """Where a call was made: the innermost frame of this repository's code, followed by the
    innermost frame of all in brackets where that one lies outside it."""
    inner, ours = _where(frames[-1])
    if ours:
        return inner
    mine = next((w for w, o in map(_where, reversed(frames)) if o), None)
    return inner if mine is None else f"{mine} ({inner})"


@contextlib.contextmanager
def host_syncs(on: bool, set_mode=None, get_mode=None):
    """The synchronizing CUDA calls made in the block, as torch's sync debug mode reports them
    (copies to the host such as ``.tolist()``, ``.item()``, stream and device synchronizes; it
    does not report every kind), each as ``_site``'s ``path:line``, into the list yielded; the
    mode is set back to what it was, whatever the block raised. Nothing is recorded when not
    ``on`` (no CUDA). ``set_mode``, ``get_mode``: torch's setter and getter, replaced in tests."""
    sites: list[str] = []
    if not on:
        yield sites
        return
    set_mode = set_mode or torch.cuda.set_sync_debug_mode
    previous = (get_mode or torch.cuda.get_sync_debug_mode)()

    recording = [False]  # the block's syncs only: torch's setter itself warned on CUDA (run 50, as it set "warn")

    def note(message, category, filename, lineno, file=None, line=None):
        if recording[0] and "synchroniz" in str(message):  # the stack without this handler and the warnings module's dispatch
            frames = traceback.extract_stack()[:-1]
            while len(frames) > 1 and os.path.abspath(frames[-1].filename) == os.path.abspath(warnings.__file__):
                frames.pop()
            sites.append(_site(frames))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        set_mode("warn")
        recording[0] = True
        try:
            yield sites
        finally:
            recording[0] = False
            set_mode(previous)


def rebalancer_counts(mgr) -> dict[str, int]:
    """The rebalancer's counters now (empty without a rebalancer), for ``rebalancer_change``."""
    return dict(mgr.rebalancer.counts) if mgr.rebalancer is not None else {}


def rebalancer_change(mgr, before: dict[str, int]) -> dict[str, int]:
    """What the rebalancer did since ``before`` (``rebalancer_counts``): each counter's change."""
    return {k: mgr.rebalancer.counts[k] - v for k, v in before.items()}


def marked_prefill(model, mgr, ids: torch.Tensor) -> dict:
    """One prefill of a Tiers ``model`` with every mark of ``instrument``, then counted
    (the stats settle its whole-layer calls): ``split``'s per-layer and total figures, the
    prefill's wall time (``prefill_ms``, marks included, to the device's end), the bytes it moved,
    the copy stream's rate over its busy time (``copy_gbps``), and what the rebalancer did from its
    start to its count (``rebalancer``: the change of each of its counters), and the synchronizing
    CUDA calls the forward made (``host_syncs``, ``host_syncs``' sites; empty without CUDA)."""
    cuda = ids.device.type == "cuda"
    marks = Marks(cuda)
    from tiers import report

    before = sum(report.stats(mgr).bytes_moved.values())
    counts = rebalancer_counts(mgr)
    with marking(model, mgr, marks):
        t0 = time.perf_counter()
        with torch.no_grad(), host_syncs(cuda) as syncs:
            model(ids)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    out = split(marks.resolved())
    moved = sum(report.stats(mgr).bytes_moved.values()) - before
    copy_ms = out["total"]["copy_ms"]
    out.update(prefill_ms=wall * 1e3, moved_bytes=moved, copy_gbps=moved / copy_ms / 1e6 if copy_ms > 0 else None, host_syncs=syncs,
               rebalancer=rebalancer_change(mgr, counts))
    return out
