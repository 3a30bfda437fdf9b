"""Shared by the rebalancer tests: a checked CPU manager over bf16 tiers, and serving calls on it bit-exactly.

Every tier is bf16, so any expert served from any tier, before or after a move, must equal its
packed weights exactly (``read_truth``). Calls are driven as the host-routed paths make them:
``Manager.count_call`` (which opens a token at the first pooled layer: ``Rebalancer.open_token``,
then ``Rebalancer.count``), then ``Slots.acquire_layer``/``wait_all``/``release_all``. After every
rebalance and every landing the table's invariants are checked (``checked``).
"""
from __future__ import annotations

import functools

import torch

from tiers.config import load_config
from tiers.loader.layout import ExpertKey
from tiers.loader.packed import read_manifest
from tiers.manager import Manager
from tiers.policy import rebalance, rebalancer
from tiers.policy.placement import plan_placement
from tiers.store.disk_store import DiskStore
from tiers.store.table import Home

K = lambda L, e: ExpertKey(L, e)  # noqa: E731

BF16 = {"gpu": {"fraction": 0.25, "staging_slots": 2, "precision": "bf16"}, "cpu": {"fraction": 0.25, "precision": "bf16"},
        "nvme": {"precision": "bf16"}}


def plan_on_any_gain(monkeypatch) -> None:
    """Make the rebalancer plan with margin 0 and significance 0, so that small counts move experts."""
    monkeypatch.setattr(rebalancer, "plan_moves", functools.partial(rebalance.plan_moves, margin=0.0, significance=0.0))


def checked(mgr: Manager) -> Manager:
    """Check the table's invariants after every rebalance and every landing of ``mgr``'s rebalancer."""
    rb = mgr.rebalancer
    plan, land = rb.rebalance, rb.land

    def rebalance_checked(freq):
        moves = plan(freq)
        mgr.table.check()
        return moves

    def land_checked(wait=False):
        land(wait)
        mgr.table.check()

    rb.rebalance, rb.land = rebalance_checked, land_checked
    return mgr


def manager(packed, every=4, *, streams=None, **rebalance_cfg) -> Manager:
    cfg = load_config({"tiers": BF16 | {"rebalance": {"every_tokens": every} | rebalance_cfg}})
    manifest = read_manifest(packed)
    mgr = Manager(manifest, cfg, plan_placement(cfg, manifest), device=torch.device("cpu"), streams=streams, progress=False)
    return checked(mgr)


def read_truth(packed) -> dict:
    """Every expert's bf16 weights as packed, read from disk: what any tier must serve."""
    manifest = read_manifest(packed)
    disk = DiskStore(manifest, ["bf16"])
    out = {}
    for k in manifest.keys:
        buf = torch.empty(manifest.ref(k, "bf16").nbytes, dtype=torch.uint8)
        disk.read(k, "bf16", buf)
        layout = manifest.layers[k.layer].layout
        t = {x.name: torch.empty(x.shape, dtype=torch.bfloat16) for x in layout.tensors}
        manifest.blob(k, "bf16").dequantize_into(buf, t)
        out[k] = t
    disk.close()
    return out


def check_held(mgr, held, truth) -> None:
    try:
        mgr.slots.wait_all(held)
        for h in held:
            for name, t in h.tensors.items():
                assert torch.equal(t, truth[h.key][name]), f"{h.key} {name} differs after a move"
    finally:
        mgr.slots.release_all(held)


def serve(mgr, layer, experts, truth) -> None:
    """Hold ``experts`` of ``layer`` as the held path does and check every one's weights bit-exactly;
    more misses than free staging slots: one at a time (what the streamed path's parts hold)."""
    held = mgr.slots.acquire_layer(layer, experts)
    if held is not None:
        check_held(mgr, held, truth)
        return
    for e in experts:
        h = mgr.slots.acquire(K(layer, e))
        assert h is not None, f"{K(layer, e)}: every staging slot is held"
        check_held(mgr, [h], truth)


def drive(mgr, calls, truth):
    """Serve ``calls`` (layer, experts) one token each, counted as a host-routed call counts them."""
    for layer, experts in calls:
        mgr.count_call(layer, experts, 1, prefill=True)
        serve(mgr, layer, experts, truth)


def hot_keys(mgr) -> set:
    return {k for k, r in mgr.table.items() if r.hot}


def warm_count(mgr) -> int:
    return sum(r.home is Home.CPU for _, r in mgr.table.items())


def skewed_calls(tokens, favourite):
    return [(L, sorted({favourite[L], (t * 3 + L) % 8})) for t in range(tokens) for L in range(3)]
