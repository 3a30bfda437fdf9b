"""Which staging slot a miss takes: a layer-aware forecast of each cached expert's next use.

Owns routing statistics per expert and the recency order of a pool's staging slots, nothing about
who sits where: the occupants, readers and reservations are read from the table
(``tiers.store.table``) at each choice. Hot slots are never offered. Time is counted in lookups
and layer calls, never a wall clock, so a replayed routing trace is deterministic. Invariant:
``victim`` returns only a staging slot nobody holds and no path reserved; an empty one before an
occupied one.

The choice evicts the expert whose next use is expected farthest away (an online estimate of
Belady's MIN). Layers are called in a fixed cycle, so an expert of layer ``l`` cannot be used
before ``l``'s next call: ``d`` calls from now (1 for the next layer, ``n`` for the layer just
called). With a chance ``p`` of use per call of its layer, the expected wait is
``d + n * (1/p - 1)`` layer calls. LRU is exactly wrong on this cycle: the least recently used
expert is the one needed next.

The chance ``p``, per expert, is learned apart for two states (the Markov chain): its layer's
last call used it, or did not, since routing is sticky (a token often keeps the experts the last
one used) and skewed (a few experts take most fresh picks). Each is pulled towards a prior worth
``PRIOR`` calls: for the unused state its long-run popularity (a slow moving average), for the
used state the layer's pooled reuse rate ``r`` plus ``(1 - r)`` times that popularity. A layer
uses the chain only while its two states differ by ``SIGNIFICANCE`` standard errors; otherwise
(uniform routing, where per-expert counts are noise) ``p`` is the larger of a fast and a slow
moving average. On the bench's traces this kept 0.947 of Belady's hits on skewed routing against
0.937 for the forecast alone and 0.809 for LRU (``bench/results/bench-qwen3_moe-run60.md``).
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from tiers.loader.layout import ExpertKey
from tiers.store.table import Home, Residency, Table


class SlotCache:
    """The policy of one pool's staging slots (``slots``), called ``layers`` in a cycle of
    ``experts`` experts each; ``table`` and ``pool`` say who sits in them."""

    FAST, SLOW = 0.9, 0.02  # the moving averages' rates
    PRIOR = 8.0  # calls a state's prior is worth
    SIGNIFICANCE = 4.0  # standard errors by which a layer's two states must differ for the chain to be used

    def __init__(self, table: Table, pool: int, slots: Iterable[int], layers: Sequence[int], experts: int | None):
        self.table, self.pool = table, pool
        self._order: OrderedDict[int, None] = OrderedDict.fromkeys(slots)  # least recently used first
        self.position = {layer: i for i, layer in enumerate(layers)}  # layer -> place in the cycle
        self.experts = experts  # per layer; None: the chain is always used
        self.calls: dict[int, int] = {}  # layer -> calls so far
        self.current: int | None = None
        self.in_call: set[ExpertKey] = set()  # experts the current call uses
        self._counted: set[ExpertKey] = set()  # ... and has looked up so far
        self._avg: dict[ExpertKey, tuple[float, float, int]] = {}  # key -> (fast, slow, at call)
        self._waits: dict[ExpertKey, float] = {}  # within the current call: counts change only at a visit
        # the chain's counts, per layer
        self.last: dict[int, frozenset[int]] = {}  # experts its last call used
        self.steps: dict[int, int] = {}  # calls after its first
        self.kept: dict[int, tuple[int, int]] = {}  # (experts kept from one call to the next, chances to)
        self.fresh: dict[int, tuple[int, int]] = {}  # (experts used after a call that did not use them, chances to)
        self.chained: dict[int, bool] = {}  # whether its two states differ
        self._na: dict[int, dict[int, int]] = {}  # expert -> calls after one that used it
        self._ha: dict[int, dict[int, int]] = {}  # ... of which used it again
        self._hb: dict[int, dict[int, int]] = {}  # expert -> uses after a call that did not use it

    # -- what happened ---------------------------------------------------------------------------
    def visit(self, layer: int, keys: Iterable[ExpertKey] = ()) -> None:
        """A call of ``layer`` begins and will look up ``keys``."""
        keys = list(keys)
        cur = frozenset(k.expert for k in keys)
        prev = self.last.get(layer)
        if prev is not None:
            self._count_transition(layer, prev, cur)
        self.last[layer] = cur
        self.calls[layer] = self.calls.get(layer, 0) + 1
        self.current = layer
        self.in_call = set(keys)
        self._counted = set()
        self._waits.clear()

    def _count_transition(self, layer: int, prev: frozenset[int], cur: frozenset[int]) -> None:
        self.steps[layer] = self.steps.get(layer, 0) + 1
        na, ha, hb = self._na.setdefault(layer, {}), self._ha.setdefault(layer, {}), self._hb.setdefault(layer, {})
        again = prev & cur
        for x in prev:
            na[x] = na.get(x, 0) + 1
        for x in again:
            ha[x] = ha.get(x, 0) + 1
        for x in cur - prev:
            hb[x] = hb.get(x, 0) + 1
        kept, chances = self.kept.get(layer, (0, 0))
        self.kept[layer] = (kept + len(again), chances + len(prev))
        if self.experts is not None:
            used, fresh_chances = self.fresh.get(layer, (0, 0))
            self.fresh[layer] = (used + len(cur - prev), fresh_chances + self.experts - len(prev))
            self.chained[layer] = self._states_differ(layer)

    def access(self, key: ExpertKey) -> None:
        """A lookup of ``key`` (not hot) in the current call."""
        if key in self._counted:
            return
        self._counted.add(key)
        self.in_call.add(key)
        self._waits.pop(key, None)
        f, s = self._averages(key)
        self._avg[key] = (f + self.FAST * (1.0 - f), s + self.SLOW * (1.0 - s), self.calls.get(key.layer, 0))

    def touch(self, slot: int) -> None:
        """``slot`` was used (a hit, or just written)."""
        self._order.move_to_end(slot)

    # -- the forecast ----------------------------------------------------------------------------
    def _averages(self, key: ExpertKey) -> tuple[float, float]:
        f, s, at = self._avg.get(key, (0.0, 0.0, self.calls.get(key.layer, 0)))
        gap = self.calls.get(key.layer, 0) - at
        return f * (1.0 - self.FAST) ** gap, s * (1.0 - self.SLOW) ** gap

    def _states_differ(self, layer: int) -> bool:
        """Whether the layer's pooled reuse rate and fresh-use rate differ by ``SIGNIFICANCE``
        standard errors (two binomial proportions)."""
        kept, chances = self.kept.get(layer, (0, 0))
        used, fresh_chances = self.fresh.get(layer, (0, 0))
        if chances == 0 or fresh_chances == 0:
            return False
        pooled = (kept + used) / (chances + fresh_chances)
        se = math.sqrt(max(pooled * (1.0 - pooled), 1e-12) * (1.0 / chances + 1.0 / fresh_chances))
        return abs(kept / chances - used / fresh_chances) > self.SIGNIFICANCE * se

    def chance(self, key: ExpertKey) -> float:
        """``key``'s chance of use at its layer's next call (see the module docstring)."""
        layer, x = key
        fast, popularity = self._averages(key)
        if self.experts is not None and not self.chained.get(layer, False):
            return max(fast, popularity)
        na = self._na.get(layer, {}).get(x, 0)
        if x in self.last.get(layer, ()):
            kept, chances = self.kept.get(layer, (0, 0))
            reuse = (kept + 1) / (chances + 2)
            prior = reuse + (1.0 - reuse) * popularity
            return (self._ha.get(layer, {}).get(x, 0) + self.PRIOR * prior) / (na + self.PRIOR)
        return (self._hb.get(layer, {}).get(x, 0) + self.PRIOR * popularity) / (self.steps.get(layer, 0) - na + self.PRIOR)

    def wait(self, key: ExpertKey) -> float:
        """Expected layer calls until ``key`` is next used (-1: the current call uses it)."""
        if key in self.in_call:
            return -1.0
        w = self._waits.get(key)
        if w is None:
            n = max(len(self.position), 1)
            here, there = self.position.get(self.current), self.position.get(key.layer)
            d = n if here is None or there is None else ((there - here) % n or n)
            w = self._waits[key] = d + n * (1.0 / max(self.chance(key), 1e-6) - 1.0)
        return w

    def victim(self) -> int | None:
        """An empty staging slot nobody holds or reserved, else the occupied one whose expert's
        wait is longest (the least recently used of equal waits); None when every one is taken."""
        table, pool = self.table, self.pool
        readers = table.readers(pool)
        best, best_wait = None, None
        for s in self._order:
            if readers[s] or table.reserved(pool, s):
                continue
            key = table.occupant(pool, s)
            if key is None:
                return s
            w = self.wait(key)
            if best_wait is None or w > best_wait:
                best, best_wait = s, w
        return best


def replay(trace: Sequence[ExpertKey], capacity: int, hot: set[ExpertKey]) -> int:
    """Hits the cache gets on ``trace`` (lookups in call order) with ``capacity`` staging slots,
    hot keys always hitting and not counted; for measuring the policy against ``belady_hits``."""
    keys = set(trace)
    layers = sorted({k.layer for k in keys})
    table = Table({k: Residency(Home.NVME) for k in keys}, [capacity], {L: 0 for L in layers})
    experts = max(k.expert for k in keys) + 1 if keys else None
    cache = SlotCache(table, 0, range(capacity), layers, experts)
    hits = 0
    for i, key in enumerate(trace):
        if i == 0 or key.layer != trace[i - 1].layer:  # a change of layer is a new call
            end = i
            while end < len(trace) and trace[end].layer == key.layer:
                end += 1
            cache.visit(key.layer, trace[i:end])
        if key in hot:
            continue
        cache.access(key)
        slot = table[key].slot
        if slot is not None:
            hits += 1
            cache.touch(slot)
            continue
        slot = cache.victim()
        if slot is None:
            continue
        table.stage(key, 0, slot)
        cache.touch(slot)
    return hits


def belady_hits(trace: Sequence[ExpertKey], capacity: int, hot: set[ExpertKey]) -> int:
    """Belady's MIN: on a miss with a full cache, evict the key whose next use is farthest away."""
    seq = [k for k in trace if k not in hot]
    never = len(seq)
    nxt = [never] * len(seq)
    last: dict[ExpertKey, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        nxt[i] = last.get(seq[i], never)
        last[seq[i]] = i
    cached: dict[ExpertKey, int] = {}  # key -> its next use
    heap: list[tuple[int, ExpertKey]] = []  # (-next use, key), stale entries skipped
    hits = 0
    for i, key in enumerate(seq):
        if key in cached:
            hits += 1
        elif len(cached) >= capacity:
            while True:
                neg, k = heapq.heappop(heap)
                if cached.get(k) == -neg:
                    del cached[k]
                    break
        if capacity == 0:
            continue
        cached[key] = nxt[i]
        heapq.heappush(heap, (-nxt[i], key))
    return hits
