"""Held path: a host-routed call whose experts all fit the staging slots at once, held together and computed in one go.

Owns one call: every routed expert is held in a slot (the misses staged into the cache's
victims, ``Slots.acquire_layer``), then the experts' arithmetic runs over the slots as
transformers runs it: batched_mm with each pick's slot as its expert id in generate's decode
stage on a GPU, else grouped_mm over windows of the slabs, its rows sorted by slot on the host
(picks known) or on the device (a prefill's).
"""
from __future__ import annotations

from typing import Any

import torch

from tiers.paths import compute
from tiers.paths.routing import Routing


class HeldPath:
    def __init__(self, mgr: Any):
        self.mgr = mgr

    def run(self, module: torch.nn.Module, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor, routing: Routing) -> torch.Tensor:
        mgr = self.mgr
        slots = mgr.slots
        held = slots.acquire_layer(layer, routing.hit)
        assert held is not None, f"layer {layer}: the dispatch chose the held path for {len(routing.hit)} experts that do not fit its slots"
        try:
            pool = mgr.pool_of[layer]
            px = compute.proxy(module, pool.slabs, pool.n_slots)
            k = top_k_index.shape[-1]
            if routing.picks is not None:
                slot_of = {h.key.expert: h.slot for h in held}
                picked = [slot_of[e] for e in routing.picks]  # per (token, pick) row
                run = compute.batched_picks if mgr.phase.decoding else compute.grouped_picks
                return run(px, mgr.uploads, hidden_states, top_k_weights, picked, k, lambda: slots.wait_all(held))
            slots.wait_all(held)
            slot_of = mgr.uploads.slot_map(module.num_experts, pool.n_slots, [h.key.expert for h in held], [h.slot for h in held])
            slot_rows = sorted((h.slot, routing.counts[h.key.expert]) for h in held if routing.counts[h.key.expert])
            offsets = mgr.uploads.ints([o for w in compute.windows(slot_rows) for o in w["offs"]])
            return compute.grouped_device(px, hidden_states, top_k_index, top_k_weights, slot_of, slot_rows, offsets)
        finally:
            slots.release_all(held)
