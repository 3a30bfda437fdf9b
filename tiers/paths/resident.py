"""Resident path: a layer whose every expert is hot runs what the untiered model runs, without a sync.

Owns the layers that qualify (every expert hot at load) and their views of the slabs: the load
puts a layer's hot experts in consecutive slots in expert order, so the layer runs transformers'
own grouped_mm forward (batched_mm in generate's decode stage on a GPU, replayed as a decode
graph) on that row of the slabs with its own expert ids, exactly as the untiered module does.
Its lookups are counted as GPU hits without a sync: a one-token call's on the host, a longer
call's distinct experts marked on the device and summed when the stats are read.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from transformers.integrations.moe import batched_mm_experts_forward, grouped_mm_experts_forward

from tiers.loader.layout import ExpertKey
from tiers.paths import compute


class ResidentPath:
    MARK_ROWS = 64  # a long call costs one kernel to count (its row of marks), summed when the rows run out

    def __init__(self, mgr: Any):
        self.mgr = mgr
        self.views: dict[int, dict[str, torch.Tensor]] = {}  # layer -> its row of the slabs
        for L, entry in mgr.manifest.layers.items():
            keys = [ExpertKey(L, e) for e in range(entry.layout.num_experts)]
            if not all(mgr.table[k].hot for k in keys):
                continue
            slots = [mgr.table[k].slot for k in keys]
            assert slots == list(range(slots[0], slots[0] + len(slots))), f"layer {L}: hot slots {slots} are not in a row"
            self.views[L] = {n: slab[slots[0] : slots[0] + len(slots)] for n, slab in mgr.pool_of[L].slabs.items()}
        self.device_hits = torch.zeros((), dtype=torch.long, device=mgr.device)
        self.host_hits = 0
        self._marks: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._row: dict[int, int] = {}

    def qualifies(self, layer: int) -> bool:
        return layer in self.views

    def count(self, layer: int, top_k_index: torch.Tensor) -> None:
        """Count the call's distinct experts as GPU hits without a sync (a router's top-k picks
        are distinct): for one token on the host, for more on the device."""
        if top_k_index.shape[0] == 1:
            self.host_hits += top_k_index.shape[-1]
            return
        marks = self._marks.get(layer)
        if marks is None:
            n = self.mgr.manifest.layers[layer].layout.num_experts
            slab = torch.zeros(self.MARK_ROWS, n + 1, dtype=torch.bool, device=top_k_index.device)  # column n: the sentinel
            marks = self._marks[layer] = (slab, list(slab.unbind(0)))
        r = self._row.get(layer, 0)
        marks[1][r].index_fill_(0, top_k_index.reshape(-1), True)  # one kernel per call
        self._row[layer] = r + 1
        if r + 1 == self.MARK_ROWS:
            self._fold(layer)

    def _fold(self, layer: int | None = None) -> None:
        """Add the marked rows of ``layer`` (every layer: None) to the device count, and clear them."""
        for L in [layer] if layer is not None else list(self._marks):
            slab, _ = self._marks[L]
            if self._row.get(L, 0):
                self.device_hits += slab[: self._row[L], :-1].sum()
                slab.zero_()
                self._row[L] = 0

    def hits(self) -> int:
        """Lookups counted so far (syncs)."""
        self._fold()
        return int(self.device_hits.item()) + self.host_hits

    def reset(self) -> None:
        self._fold()
        self.device_hits.zero_()
        self.host_hits = 0

    def run(self, module: torch.nn.Module, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor) -> torch.Tensor:
        mgr = self.mgr
        if not mgr.phase.in_step:  # a step graph's runner counted it (``Manager.begin_step``)
            self.count(layer, top_k_index)
        view = self.views[layer]
        px = compute.proxy(module, view, module.num_experts)
        if not mgr.phase.decoding:
            return grouped_mm_experts_forward(px, hidden_states, top_k_index, top_k_weights)
        step = functools.partial(batched_mm_experts_forward, px)
        return mgr.decode_graphs.run(("static", layer), tuple(view.values()), step, (hidden_states, top_k_index, top_k_weights))
