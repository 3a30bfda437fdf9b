"""The composition root: one model's tiers built from a placement, and the entry of every layer call.

Owns building the collaborators and the one flow of a layer call (``serve``): the facts about the
call, the decision (``tiers.paths.dispatch``), the path that runs it. Each collaborator owns its
part and is handed what it needs:

- store: the table (every expert's home and every slot's state), the slot pools (memory), the
  pinned host pool, the disk store;
- transfer: streams, staging (copies and dequantization), uploads (small pinned indices),
  read-ahead of cold experts;
- policy: the cache over staging slots (per pool), the rebalancer;
- paths: resident, direct, held, streamed, whole;
- graphs: CUDA graphs of decode calls and of recurring prefill plans (step graphs are installed
  on the model by ``tiers.api.load``).

Also the phase (generate's decode stage, a step graph running), the counting every call shares
(``count_call``), loading the hot and warm experts, and closing.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
from tqdm.auto import tqdm

from tiers import quant
from tiers.config import TiersConfig
from tiers.graphs.graph_cache import GraphCache
from tiers.loader.blob import BLOB_ALIGN, align
from tiers.loader.layout import ExpertKey
from tiers.loader.packed import Manifest
from tiers.paths import compute
from tiers.paths.direct import DirectPath
from tiers.paths.dispatch import Facts, Path, dispatch
from tiers.paths.held import HeldPath
from tiers.paths.resident import ResidentPath
from tiers.paths.routing import HOST_ROUTED_ROWS, route
from tiers.paths.streamed import StreamedPath
from tiers.paths.whole import WholePath
from tiers.policy.placement import Placement
from tiers.policy.rebalancer import Rebalancer
from tiers.policy.slot_cache import SlotCache
from tiers.slots import Slots
from tiers.stats import StatsCollector
from tiers.store.disk_store import DiskStore
from tiers.store.host_pool import HostPool
from tiers.store.pools import BlobPool, SlotPool
from tiers.store.table import Home, Residency, Table
from tiers.transfer.read_ahead import ReadAhead
from tiers.transfer.staging import Staging
from tiers.transfer.streams import Streams
from tiers.transfer.uploads import Uploads


@dataclass
class Phase:
    decoding: bool = False  # inside generate's decode stage, on a device that follows its switch to batched_mm (not the CPU)
    in_step: bool = False  # inside a decode step run as one graph (``tiers.graphs.step_graphs``)
    step_opened: bool = False  # a step's runner opened this token's count, then the step ran op by op


class Manager:
    LOAD_THREADS = 8  # reader threads at load time (pread and the first read's CRC32 release the GIL)

    def __init__(self, manifest: Manifest, cfg: TiersConfig, placement: Placement, *, device: torch.device,
                 streams: Streams | None = None, clock: Callable[[], float] = time.perf_counter, verify: str = "first",
                 progress: bool = True):
        self.manifest, self.cfg, self.placement, self.device = manifest, cfg, placement, device
        self.streams = streams or Streams(device)
        self.phase = Phase()
        self.parallel = None  # a tiers.parallel.ExpertParallel, set by tiers.load under expert parallelism
        self.batched_decode = device.type != "cpu"  # transformers switches grouped_mm to batched_mm for decode, except on the CPU
        self.stats_ = StatsCollector()
        rebalancing = cfg.rebalance.every_tokens > 0 and len(placement.hot) < len(manifest.keys)
        if rebalancing:
            self._check_rebalance_precisions()
        # -- store: one pool per expert signature, hot slots first; the table; host and disk
        self.pools: list[SlotPool] = []
        self.pool_of: dict[int, SlotPool] = {}
        for i, g in enumerate(placement.groups):
            pool = SlotPool(i, manifest.layers[g.layers[0]].layout, g.n_slots, g.hot, device=device, dtype=torch.bfloat16)
            self.pools.append(pool)
            self.pool_of.update({L: pool for L in g.layers})
        self.host = HostPool(self._host_bytes(rebalancing), pin=device.type == "cuda")
        self.gpu_pool = BlobPool(placement.gpu_pool_bytes, device) if placement.gpu_pool else None  # quantized hot experts
        homes = {k: Residency(Home.GPU) for k in placement.hot}
        homes |= {k: Residency(Home.GPU, self.gpu_pool.alloc(manifest.ref(k, cfg.gpu.precision).nbytes)) for k in placement.gpu_pool}
        homes |= {k: Residency(Home.CPU, self.host.alloc(manifest.ref(k, cfg.cpu.precision).nbytes, "warm")) for k in placement.warm}
        homes |= {k: Residency(Home.NVME) for k in placement.cold}
        self.table = Table(homes, [p.n_slots for p in self.pools], {L: p.index for L, p in self.pool_of.items()})
        needed = ({cfg.gpu.precision} if placement.hot or placement.gpu_pool else set()) | ({cfg.cpu.precision} if placement.warm else set())
        needed |= {cfg.nvme.precision} if placement.cold else set()
        if rebalancing:  # any expert may move to any tier
            needed |= {cfg.gpu.precision, cfg.cpu.precision, cfg.nvme.precision}
        # one chunk thread: the CRC of a first read overlaps the rest of it (tools/coldread.py measured more threads slower)
        self.disk = DiskStore(manifest, sorted(needed), verify=verify, read_threads=1)
        # -- transfer
        self.uploads = Uploads(self.host, self.streams, device, self._upload_length())
        transit = {p.index: (g.transit_rows, g.transit_bytes) for p, g in zip(self.pools, placement.groups)}
        self.staging = Staging(manifest, self.table, self.pools, transit, self.host, self.disk, self.uploads, self.streams, self.stats_,
                               precisions=(cfg.cpu.precision, cfg.nvme.precision), rings=bool(placement.cold or rebalancing), clock=clock,
                               gpu_pool=(self.gpu_pool, cfg.gpu.precision) if self.gpu_pool is not None else None)
        cold_reads = bool(placement.cold or rebalancing)
        self.read_ahead = ReadAhead(self.table, self.disk, self.staging, self.stats_, cfg.nvme.precision) if cold_reads else None
        # -- policy
        n_experts = max(e.layout.num_experts for e in manifest.layers.values())
        self.caches = [SlotCache(self.table, p.index, p.staging, g.layers, n_experts) for p, g in zip(self.pools, placement.groups)]
        self.slots = Slots(manifest, self.table, self.pools, self.pool_of, self.caches, self.staging, self.read_ahead, self.streams, self.stats_)
        self._load(progress)
        # -- paths and graphs
        on_cuda = device.type == "cuda" and cfg.gpu.graphs
        self.decode_graphs = GraphCache(device, on_cuda)  # generate's decode calls, where they run no host work
        self.prefill_graphs = GraphCache(device, on_cuda)  # whole-layer calls' plans and windows, where their shapes recur
        self.steps: Any = None  # the model's step graphs (``tiers.graphs.step_graphs.install``), if any
        self.resident = ResidentPath(self)
        self.rebalancer = Rebalancer(self, cfg.rebalance, threads=2) if rebalancing else None
        self.direct = DirectPath(self)
        self.held = HeldPath(self)
        self.streamed = StreamedPath(self)
        self.whole = WholePath(self, self.streamed)
        self.layer_keys = {L: [ExpertKey(L, e) for e in range(entry.layout.num_experts)] for L, entry in manifest.layers.items()}
        self.first_layer = min((L for L in manifest.layers if not self.resident.qualifies(L)), default=None)

    # -- building --------------------------------------------------------------------------------
    def _check_rebalance_precisions(self) -> None:
        m, cfg = self.manifest, self.cfg
        for key, p in (("tiers.gpu.precision", cfg.gpu.precision), ("tiers.cpu.precision", cfg.cpu.precision),
                       ("tiers.nvme.precision", cfg.nvme.precision)):
            if p not in m.precisions:
                raise ValueError(f"tiers.rebalance: moving experts between tiers needs {key} {p!r} packed in {str(m.root)!r} "
                                 f"(packed: {list(m.precisions)}); re-pack, or set tiers.rebalance.every_tokens: 0")
        mixed = next((L for L, e in m.layers.items() if len(e.encodings[cfg.cpu.precision]) > 1), None)
        if mixed is not None:  # a promoted expert would not fit the warm place of the one it replaces
            encodings = ", ".join(sorted(m.layers[mixed].encodings[cfg.cpu.precision]))
            raise ValueError(f"tiers.rebalance.every_tokens: the rebalancer swaps warm experts place for place, and layer {mixed} of "
                             f"{str(m.root)!r} holds its {cfg.cpu.precision} experts in two encodings ({encodings}: pack --min-sqnr); "
                             f"set it to 0, or use a pack without --min-sqnr")

    def _host_bytes(self, rebalancing: bool) -> int:
        """The pinned pool: warm experts, a disk ring buffer per staging slot, promotion buffers, uploads."""
        m, cfg, p = self.manifest, self.cfg, self.placement
        warm = sum(m.blob(k, cfg.cpu.precision).stride for k in p.warm)
        rings = 0
        if p.cold or rebalancing:
            for g in p.groups:
                rings += g.staging * max(m.layers[L].largest(cfg.nvme.precision).stride for L in g.layers)
        promote = Rebalancer.buffer_bytes(m, cfg, p) if rebalancing else 0
        return warm + rings + promote + Uploads.BUFFERS * align(self._upload_length() * 8, BLOB_ALIGN)

    def _upload_length(self) -> int:
        """int64 entries an upload buffer holds: a slot map [E + 1], or a host-routed call's int32
        indices (4 per row, plus an offset per slot of its pool)."""
        n_experts = max(e.layout.num_experts for e in self.manifest.layers.values())
        return max(n_experts + 1, (4 * HOST_ROUTED_ROWS + max(g.n_slots for g in self.placement.groups) + 1) // 2 + 1)

    def _load(self, progress: bool) -> None:
        """Read every hot expert into its slot (slots in a row per pool, in key order) and every warm
        one into its place in the pinned pool, on ``LOAD_THREADS`` threads; hot experts are read
        ahead into a few scratch buffers while this thread copies the previous ones up, in order."""
        hot, warm = list(self.placement.hot), list(self.placement.warm)
        bar = tqdm(total=len(hot) + len(warm) + len(self.placement.gpu_pool), desc="loading experts", unit="expert", disable=not progress)
        gp, cp = self.cfg.gpu.precision, self.cfg.cpu.precision
        next_slot = [0] * len(self.pools)
        threads = max(1, min(self.LOAD_THREADS, os.cpu_count() or 1))
        with ThreadPoolExecutor(threads, thread_name_prefix="tiers-load") as ex:
            if hot:
                ahead = min(4, threads, len(hot))  # scratch buffers in flight: bounded host memory
                scratch = [torch.empty(max(self.manifest.ref(k, gp).nbytes for k in hot), dtype=torch.uint8) for _ in range(ahead)]
                reads = {i: ex.submit(self.disk.read, hot[i], gp, scratch[i]) for i in range(ahead)}
                for i, key in enumerate(hot):
                    reads.pop(i).result()
                    pool = self.pool_of[key.layer]
                    slot = next_slot[pool.index]
                    next_slot[pool.index] += 1
                    buf = scratch[i % ahead][: self.manifest.ref(key, gp).nbytes]
                    src = buf if quant.get_scheme(gp).lossless else buf.to(self.device)
                    # a copy from pageable memory returns once the bytes are taken: the buffer is free again
                    self.manifest.blob(key, gp).dequantize_into(src, pool.tensors(slot))
                    self.table.place_hot(key, pool.index, slot)
                    if i + ahead < len(hot):
                        reads[i + ahead] = ex.submit(self.disk.read, hot[i + ahead], gp, scratch[i % ahead])
                    bar.update(1)
            futures = [ex.submit(self.disk.read, k, cp, self.host.view(self.table[k].host_offset, self.manifest.ref(k, cp).nbytes)) for k in warm]
            for f in futures:
                f.result()
                bar.update(1)
            if self.gpu_pool is not None:
                self._load_gpu_pool(ex, bar)
        bar.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _load_gpu_pool(self, ex: ThreadPoolExecutor, bar: Any) -> None:
        """Read every quantized hot expert's blob and copy it to its place in the GPU's blob pool, the
        next ones read while this thread copies (two scratch buffers)."""
        gp, keys = self.cfg.gpu.precision, list(self.placement.gpu_pool)
        size = max(self.manifest.ref(k, gp).nbytes for k in keys)
        scratch = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]
        reads = {i: ex.submit(self.disk.read, keys[i], gp, scratch[i][: self.manifest.ref(keys[i], gp).nbytes]) for i in range(min(2, len(keys)))}
        for i, key in enumerate(keys):
            reads.pop(i).result()
            n = self.manifest.ref(key, gp).nbytes
            self.gpu_pool.view(self.table[key].host_offset, n).copy_(scratch[i % 2][:n])  # from pageable memory: done on return
            if i + 2 < len(keys):
                reads[i + 2] = ex.submit(self.disk.read, keys[i + 2], gp, scratch[i % 2][: self.manifest.ref(keys[i + 2], gp).nbytes])
            bar.update(1)

    # -- a layer call --------------------------------------------------------------------------------
    def proxy(self, module: torch.nn.Module, pool: SlotPool) -> compute.SlotExperts:
        return compute.proxy(module, pool.slabs, pool.n_slots)

    def facts(self, layer: int, tokens: int, top_k: int) -> Facts:
        """What ``dispatch`` reads about a call, before its routing (no side effect)."""
        pool, phase = self.pool_of[layer], self.phase
        if self.resident.qualifies(layer):
            return Facts(True, phase.decoding, False, False, False, False, 0, 0)
        direct = phase.decoding and self.direct.qualifies(layer, tokens * top_k)
        whole = not phase.decoding and self.whole.qualifies(layer, tokens, top_k)
        room = self.direct.room(pool) if phase.decoding else sum(1 for s in pool.staging if not self.table.reserved(pool.index, s))
        cold, misses = False, 0
        if whole:  # only a whole-layer call reads these: a scan of the layer's experts
            table = self.table
            for key in self.layer_keys[layer]:
                r = table[key]
                if r.slot is None:
                    misses += 1
                    cold = cold or r.home is Home.NVME
        return Facts(False, phase.decoding, direct, whole, cold, self.slots.recorded is not None, room, misses)

    def serve(self, module: torch.nn.Module, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor) -> torch.Tensor:
        """One layer call; under expert parallelism, through the ranks owning its experts (``tiers.parallel``)."""
        if self.parallel is not None:
            return self.parallel.serve(self.serve_local, module, layer, hidden_states, top_k_index, top_k_weights)
        return self.serve_local(module, layer, hidden_states, top_k_index, top_k_weights)

    def serve_local(self, module: torch.nn.Module, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
        """One layer call over this manager's experts: its facts, the decision, the path (see ``tiers.paths.dispatch``)."""
        T, k = top_k_index.shape
        phase = self.phase
        if phase.decoding and not phase.in_step and layer == self.first_layer:
            self._open_decode_token(T)  # before the decision: its swaps land (and a cooled expert leaves direct's reach) first
        facts = self.facts(layer, T, k)
        path = dispatch(facts)
        if path is Path.RESIDENT:
            return self.resident.run(module, layer, hidden_states, top_k_index, top_k_weights)
        if path is Path.WHOLE:
            return self.whole.run(module, layer, hidden_states, top_k_index, top_k_weights)
        if path is Path.DIRECT:
            if not phase.in_step:
                self.whole.settle()  # this call counts after the whole-layer calls before it
            return self.direct.run(module, layer, hidden_states, top_k_index, top_k_weights)
        self.whole.settle()
        pool = self.pool_of[layer]
        if phase.decoding:
            self.direct.leave(pool)
            facts = replace(facts, room=self.direct.room(pool))
        with torch.no_grad():
            routing = route(top_k_index, module.num_experts)
        self.count_call(layer, routing.hit, T, prefill=not phase.decoding)
        self.whole.note_share(layer, routing.hit, T, k)
        if not routing.hit:  # no routed expert: the grouped forward would leave every row unwritten
            return torch.zeros_like(hidden_states)
        rows = [self.table[ExpertKey(layer, e)] for e in routing.hit]
        need = sum(not r.hot for r in rows)
        misses = sum(r.slot is None for r in rows)
        path = dispatch(replace(facts, routed=True, picks_known=routing.picks is not None, need=need, misses=misses))
        run = self.held.run if path is Path.HELD else self.streamed.run
        return run(module, layer, hidden_states, top_k_index, top_k_weights, routing)

    def count_call(self, layer: int, keys: list[int], tokens: int, *, prefill: bool) -> None:
        """What every host-routed call counts when its routing is on the host: the cache policy's
        visit (it forecasts by layer order), the decode stage's calls, the rebalancer's routing;
        a prefill call at the first pooled layer opens its token there (a decode token is opened
        before its first call's decision, ``_open_decode_token``)."""
        pool = self.pool_of[layer]
        ek = [ExpertKey(layer, e) for e in keys]
        self.caches[pool.index].visit(layer, ek)
        if not prefill:  # a whole-layer call counted at a decode token's start is still a prefill's
            self.direct.note_call(pool)
        if self.rebalancer is not None:
            if prefill and layer == self.first_layer:
                self.rebalancer.open_token(tokens)
            self.rebalancer.count(ek)

    def _open_decode_token(self, tokens: int) -> None:
        """A decode token reaches its first pooled layer: count it for the rebalancer (landing its
        swaps), unless a step's runner did, and bring direct decode's tables up to date."""
        self.whole.settle()
        if self.rebalancer is not None and not self.phase.step_opened:
            self.rebalancer.open_token(tokens)
        self.phase.step_opened = False
        self.direct.refresh()

    # -- generate's decode stage and step graphs -----------------------------------------------------
    def begin_decode(self) -> None:
        self.direct.begin_stage()
        if self.steps is not None:
            self.steps.begin_stage()

    def end_decode(self) -> None:
        if self.steps is not None:
            self.steps.end_stage()  # generate's cache gets what the step graphs wrote
        self.direct.end_stage()

    def begin_step(self, top_k: int) -> bool:
        """A one-token decode step is about to run as one graph, whose experts calls do only their
        device work: do the host's part of every layer's call now (the rebalancer's token, each
        call's counts). True when every MoE layer's call can run inside the graph (resident, or
        direct); otherwise the step runs op by op, its calls counting themselves, the token opened."""
        self.whole.settle()
        opened = self.rebalancer is not None and self.first_layer is not None
        if opened:
            self.rebalancer.open_token(1)
        self.direct.refresh()
        layers = self.manifest.layers
        if not all(self.resident.qualifies(L) or self.direct.qualifies(L, top_k) for L in layers):
            self.phase.step_opened = opened
            return False
        for L in layers:
            if self.resident.qualifies(L):
                self.resident.host_hits += top_k  # what ``ResidentPath.count`` counts for one token
            else:
                self.direct.counted(L)
        return True

    def step_bound(self) -> list[torch.Tensor]:
        return self.direct.step_bound()

    # -- reporting and closing -------------------------------------------------------------------
    def settle(self) -> None:
        self.whole.settle()

    def reset_stats(self) -> None:
        """Start counting afresh."""
        self.whole.settle()  # calls made before count before
        self.stats_.reset()
        self.resident.reset()
        self.direct.reset()
        self.decode_graphs.reset_counts()
        self.prefill_graphs.reset_counts()
        if self.steps is not None:
            self.steps.reset_counts()

    def close(self) -> None:
        self.whole.settle()
        if self.rebalancer is not None:
            self.rebalancer.close()
        if self.read_ahead is not None:
            self.read_ahead.close()
            self.slots.drain()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.host.close()
        self.disk.close()
