"""Expert parallelism: each rank of a torch.distributed group serves a block of every MoE layer's experts from its own tiers.

With ``tiers.parallel.experts`` and a default process group of more than one rank, rank ``r``
of ``W`` owns experts ``[start_r, start_{r+1})`` of every MoE layer: a contiguous block of
``E // W``, the first ``E % W`` ranks one more (``shares``). Its manager sees only those, renumbered
from 0 (``local_manifest``), and places them in its own three tiers under its own budgets; the
dense weights are every rank's. A layer call (``ExpertParallel.serve``) sends each (token, pick)
row to the rank owning its expert with ``all_to_all_single``, the owner computes the expert's
output for each row it received in one call of its own manager (each row as a pick of weight
one, so the output is the expert's, unweighted), and the rows come back the same way. The calling
rank then weights and sums them per token exactly as transformers' experts forward does, so the
output is bit-identical to one process's. NCCL carries the exchange on GPUs, gloo on CPUs.

``agree`` makes a load fail on every rank when it fails on one: each rank reports its outcome
to all (a collective that the group's timeout bounds), and every rank raises naming the ranks
that failed and why. ``summed`` adds ``TierStats`` over the ranks (``tiers.stats(model,
all_ranks=True)``).
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from tiers.loader.packed import Manifest
from tiers.stats import TierStats

Loaded = TypeVar("Loaded")


def shares(num_experts: int, world: int) -> list[int]:
    """Block starts, ``world + 1`` of them: rank ``r`` owns ``[starts[r], starts[r + 1])``."""
    base, extra = divmod(num_experts, world)
    starts = [0]
    for r in range(world):
        starts.append(starts[-1] + base + (r < extra))
    return starts


def group_of(enabled: bool) -> tuple[int, int] | None:
    """``(rank, world)`` of the default process group when expert parallelism applies, else None.
    A ValueError naming the key when it is asked for without an initialized group."""
    if not enabled:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("tiers.parallel.experts: true needs torch.distributed's default process group; call "
                         "torch.distributed.init_process_group() first (torchrun sets its environment), or leave the key out")
    world = dist.get_world_size()
    return (dist.get_rank(), world) if world > 1 else None


def default_device() -> torch.device | None:
    """Where a rank loads when ``device`` is not given: its own GPU, ``cuda:LOCAL_RANK`` (torchrun
    sets it), not the one every rank would see as current; None without CUDA (the CPU)."""
    if not torch.cuda.is_available():
        return None
    local = os.environ.get("LOCAL_RANK")
    return torch.device("cuda", int(local) if local is not None else torch.cuda.current_device())


def agree(run: Callable[[], Loaded], rank: int, world: int, signature: Callable[[Loaded], Any],
          close: Callable[[Loaded], None]) -> Loaded:
    """``run()`` on every rank, then one exchange of outcomes: a RuntimeError on every rank when
    any failed (on a failing rank, chained to its own error), naming each failing rank's error,
    or when the ranks' results differ in ``signature`` (say, two checkpoints); a rank that
    succeeded ``close``s its result before it raises."""
    error: BaseException | None = None
    result = None
    try:
        result = run()
    except Exception as e:  # noqa: BLE001 (any failure must reach the other ranks, not leave them waiting)
        error = e
    outcomes: list[Any] = [None] * world
    dist.all_gather_object(outcomes, (f"{type(error).__name__}: {error}", None) if error is not None else (None, signature(result)))
    failed = {r: why for r, (why, _) in enumerate(outcomes) if why is not None}
    if (failed or any(sig != outcomes[0][1] for _, sig in outcomes)) and error is None:
        close(result)
    if failed:
        listed = "; ".join(f"rank {r}: {why}" for r, why in failed.items())
        raise RuntimeError(f"tiers.load failed on {len(failed)} of {world} ranks ({listed})") from error
    if any(sig != outcomes[0][1] for _, sig in outcomes):
        listed = "; ".join(f"rank {r}: {sig}" for r, (_, sig) in enumerate(outcomes))
        raise RuntimeError(f"tiers.load: the ranks loaded different models; every rank must load the same checkpoint ({listed})")
    return result


def local_manifest(manifest: Manifest, rank: int, world: int) -> Manifest:
    """The manifest as rank ``rank`` serves it: each MoE layer's block of experts, numbered from 0
    (and the routing prior's counts of them)."""
    layers = {}
    for L, entry in manifest.layers.items():
        s = shares(entry.layout.num_experts, world)
        layout = dataclasses.replace(entry.layout, num_experts=s[rank + 1] - s[rank])
        layers[L] = dataclasses.replace(entry, layout=layout, experts=entry.experts[s[rank]:s[rank + 1]])
    prior = manifest.routing_prior
    return dataclasses.replace(manifest, layers=layers, routing_prior=None if prior is None else local_counts(prior, rank, world))


def local_counts(counts: dict[int, list], rank: int, world: int) -> dict[int, list]:
    """Routing counts per layer (a routing prior or file) restricted to rank ``rank``'s block."""
    out = {}
    for L, c in counts.items():
        s = shares(len(c), world)
        out[L] = list(c[s[rank]:s[rank + 1]])
    return out


class ExpertParallel:
    """The layer call of a rank under expert parallelism (module docstring)."""

    def __init__(self, rank: int, world: int, manifest: Manifest, device: torch.device):
        self.rank, self.world = rank, world
        experts_per_layer = manifest.experts_per_layer
        # what every rank must agree on: the model and its experts
        self.signature = (manifest.model_type, tuple(experts_per_layer.items()), manifest.precisions)
        self.starts = {L: torch.tensor(shares(n, world), device=device) for L, n in experts_per_layer.items()}
        self.first = {L: shares(n, world)[rank] for L, n in experts_per_layer.items()}  # this rank's expert 0, per layer

    def serve(self, local: Callable[..., torch.Tensor], module: torch.nn.Module, layer: int, hidden_states: torch.Tensor,
              top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """``local(module, layer, rows, ids [N, 1], weights [N, 1])``: this rank's manager's call."""
        T, k = top_k_index.shape
        H = hidden_states.shape[-1]
        starts = self.starts[layer]
        picks = top_k_index.reshape(-1)
        owner = torch.bucketize(picks, starts[1:], right=True)  # starts[r] <= e < starts[r + 1]
        order = torch.argsort(owner, stable=True)
        send = torch.bincount(owner, minlength=self.world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        send_n, recv_n = send.tolist(), recv.tolist()
        rows = _exchange(hidden_states[order // k], recv_n, send_n)
        ids = _exchange((picks - starts[owner])[order], recv_n, send_n)
        if rows.shape[0]:
            ones = torch.ones((rows.shape[0], 1), dtype=top_k_weights.dtype, device=rows.device)
            out = local(module, layer, rows, ids[:, None], ones)
        else:  # no row for this rank's experts: nothing to compute
            out = rows.new_empty((0, H))
        back = _exchange(out.to(hidden_states.dtype), send_n, recv_n)
        expert_out = torch.empty_like(back)
        expert_out[order] = back
        # as transformers' experts forward weights and sums (transformers.integrations.moe)
        weighted = expert_out * top_k_weights.reshape(-1, 1)
        return weighted.view(T, k, H).sum(dim=1).to(hidden_states.dtype)


def _exchange(t: torch.Tensor, recv_n: list[int], send_n: list[int]) -> torch.Tensor:
    """``t``'s rows, ``send_n[r]`` of them to rank r in order; ``recv_n[r]`` rows back from each."""
    wire = t.contiguous().reshape(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)  # rows as bytes: every backend carries uint8
    out = wire.new_empty((sum(recv_n), wire.shape[1]))
    dist.all_to_all_single(out, wire, output_split_sizes=recv_n, input_split_sizes=send_n)
    return out.view(t.dtype).reshape(sum(recv_n), *t.shape[1:])


def summed(stats: TierStats) -> TierStats:
    """``stats`` summed over the ranks of the default group: every count, byte and second."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, stats.as_dict())
    total = every[0]
    for other in every[1:]:
        total = _add(total, other)
    fields = {f.name for f in dataclasses.fields(TierStats)}
    return TierStats(**{k: v for k, v in total.items() if k in fields})


def _add(a: Any, b: Any) -> Any:
    if isinstance(a, dict):
        return {k: _add(a[k], b[k]) if k in b else a[k] for k in a} | {k: v for k, v in b.items() if k not in a}
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return a + b
    return a  # text (the device): the first rank's
