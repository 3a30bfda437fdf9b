"""Synthetic routing traces: uniform, or skewed and temporally correlated.

Random-weight routers route almost uniformly, which understates what caching can do; real
routers are skewed (a few experts per layer take most tokens) and sticky (consecutive tokens
often reuse an expert). The model here, per layer:

- popularity: expert ``e`` has weight ``1 / rank(e) ** zipf_s`` under a per-layer random ranking
  (``zipf_s = 0`` is uniform);
- stickiness: each expert the previous token used in this layer is kept with probability
  ``reuse_p``; the remaining of the ``top_k`` picks are drawn without replacement by popularity.

A trace is a LongTensor ``[tokens, layers, top_k]`` of expert indices, each row's picks distinct.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tiers.loader.layout import ExpertKey

_CHUNK = 512  # tokens whose random draws are made at once: bounds memory at CHUNK * layers * experts doubles


@dataclass(frozen=True)
class TraceModel:
    num_layers: int
    num_experts: int
    top_k: int
    zipf_s: float = 0.0
    reuse_p: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if not 0.0 <= self.reuse_p <= 1.0:
            raise ValueError(f"reuse_p must be in [0, 1], got {self.reuse_p}")
        if self.zipf_s < 0:
            raise ValueError(f"zipf_s must be >= 0, got {self.zipf_s}")

    def popularity(self) -> torch.Tensor:
        """[layers, experts] probabilities of the Zipf prior under each layer's random ranking."""
        g = torch.Generator().manual_seed(self.seed)
        ranks = torch.arange(1, self.num_experts + 1, dtype=torch.float64)
        base = ranks.pow(-self.zipf_s)
        base = base / base.sum()
        return torch.stack([base[torch.randperm(self.num_experts, generator=g)] for _ in range(self.num_layers)])

    def sample(self, tokens: int) -> torch.Tensor:
        """[tokens, layers, top_k] expert indices drawn by the model above; the same for the same seed.

        One step per token, every layer at once. Keep decisions are uniform draws below ``reuse_p``;
        the fresh picks are the largest keys ``log(popularity) + Gumbel noise`` with the kept experts
        masked out, which is the same as drawing them one at a time without replacement in
        proportion to popularity (the Gumbel-top-k trick). Each row is the kept experts in the
        previous row's order, then the fresh ones in draw order.
        """
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        n_layers, k = self.num_layers, self.top_k
        g = torch.Generator().manual_seed(self.seed + 1)
        log_pop = self.popularity().log()  # [L, E]
        out = torch.empty(tokens, n_layers, k, dtype=torch.long)
        pos = torch.arange(k)  # [k]
        prev = torch.zeros(n_layers, k, dtype=torch.long)  # [L, k] the previous token's picks
        for start in range(0, tokens, _CHUNK):
            n = min(_CHUNK, tokens - start)
            kept = torch.rand(n, n_layers, k, generator=g) < self.reuse_p  # [n, L, k] keep each previous pick?
            if start == 0:
                kept[0] = False  # the first token has no previous picks
            u = torch.rand(n, n_layers, self.num_experts, dtype=torch.float64, generator=g)  # [n, L, E]
            keys = log_pop - u.log_().neg_().log_()  # [n, L, E] log-popularity plus Gumbel(0, 1) noise, -log(-log u)
            masks = torch.zeros(n, n_layers, k, dtype=torch.float64).masked_fill_(kept, float("-inf"))  # [n, L, k]
            need = k - kept.sum(-1, keepdim=True)  # [n, L, 1] fresh picks per layer
            take = torch.cat([kept, pos < need], -1)  # [n, L, 2k], exactly k per row: kept ones, then the first `need` fresh
            for t in range(n):
                key = keys[t].scatter_add_(1, prev, masks[t])  # [L, E]; a kept expert is not drawn again (picks are distinct)
                fresh = key.topk(k, dim=1).indices  # [L, k] in draw order
                prev = torch.cat([prev, fresh], 1)[take[t]].view(n_layers, k)  # [L, k] kept first, then fresh
                out[start + t] = prev
        return out


def lookups(trace: torch.Tensor, layers: list[int]) -> list[ExpertKey]:
    """The order the engine looks experts up in: token by token, layer by layer, experts ascending."""
    seq = []
    for row in trace.tolist():
        for i, picks in enumerate(row):
            seq.extend(ExpertKey(layers[i], e) for e in sorted(set(picks)))
    return seq
