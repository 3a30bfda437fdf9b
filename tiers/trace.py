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

from loader.layout import ExpertKey


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
        g = torch.Generator().manual_seed(self.seed + 1)
        pop = self.popularity()  # [L, E]
        out = torch.empty(tokens, self.num_layers, self.top_k, dtype=torch.long)
        prev: list[list[int]] = [[] for _ in range(self.num_layers)]
        for t in range(tokens):
            for layer in range(self.num_layers):
                keep = [e for e in prev[layer] if torch.rand((), generator=g).item() < self.reuse_p]
                w = pop[layer].clone()
                if keep:
                    w[keep] = 0.0
                need = self.top_k - len(keep)
                fresh = torch.multinomial(w, need, replacement=False, generator=g).tolist() if need else []
                picks = keep + fresh
                out[t, layer] = torch.tensor(picks)
                prev[layer] = picks
        return out


def lookups(trace: torch.Tensor, layers: list[int]) -> list[ExpertKey]:
    """The order the engine looks experts up in: token by token, layer by layer, experts ascending."""
    seq = []
    for row in trace.tolist():
        for i, picks in enumerate(row):
            seq.extend(ExpertKey(layers[i], e) for e in sorted(set(picks)))
    return seq
