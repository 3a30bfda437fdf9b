"""The routing sync: a layer call's routed experts brought to the host in one device-to-host copy.

Owns ``Routing`` and ``route``. A call of at most ``HOST_ROUTED_ROWS`` (token, pick) rows (decode)
brings its picks themselves; a longer one (prefill) the number of rows routed to each expert,
counted on the device. The host-routed paths (held, streamed) need this to stage their misses.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

HOST_ROUTED_ROWS = 64  # a call with at most this many (token, pick) rows brings its picks to the host


@dataclass(frozen=True)
class Routing:
    hit: list[int]  # the experts the call uses, ascending
    counts: list[int]  # rows routed to each expert id (the sentinel id E last)
    picks: list[int] | None  # the picks in row order, for a call of at most HOST_ROUTED_ROWS rows (else None)


def rows_per_expert(picks: list[int], n: int) -> list[int]:
    """The (token, pick) rows routed to each expert id of ``n`` (and the sentinel, id ``n``)."""
    counts = [0] * (n + 1)
    for e in picks:
        counts[e] += 1
    return counts


def route(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """One sync: the dynamic schedule needs the routed experts on the host to stage misses."""
    flat = top_k_index.reshape(-1)
    if flat.numel() <= HOST_ROUTED_ROWS:
        picks = flat.tolist()
        counts = rows_per_expert(picks, num_experts)
        if counts[num_experts]:  # sentinel picks (expert parallelism): leave them to the device-side sort
            picks = None
    else:
        counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
        counts = counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)).tolist()  # rows per expert
        picks = None
    return Routing([e for e in range(num_experts) if counts[e]], counts, picks)
