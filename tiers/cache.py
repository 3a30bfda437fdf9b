"""GPU expert cache over the staging slots: LRU, LFU with decay, a layer-aware forecast, or the
forecast with each expert's chances learned as a two-state chain; and Belady's MIN to judge them.

Owns: which staging slot a miss takes. Hot slots are pinned and never offered. Policies see
only slots, keys, layer visits and time counted in lookups (never a wall clock), so a replay of
a recorded routing trace is deterministic. Invariant: ``victim`` only returns a slot nobody holds
(``readers[slot] == 0``); an empty slot is always taken before an occupied one.
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from tiers.loader.layout import ExpertKey

POLICIES = ("markov", "forecast", "lru", "lfu")


class LruSlots:
    """Least recently used first."""

    def __init__(self, slots: Iterable[int]):
        self._order: OrderedDict[int, None] = OrderedDict.fromkeys(slots)
        self._owner: dict[int, ExpertKey] = {}

    def access(self, key: ExpertKey) -> None:  # LRU needs no per-key history
        pass

    def visit(self, layer: int, keys: Iterable[ExpertKey] = ()) -> None:
        """A call of ``layer`` begins and will look up ``keys``; only the forecast uses this."""

    def assign(self, slot: int, key: ExpertKey) -> None:
        self._owner[slot] = key
        self.touch(slot)

    def touch(self, slot: int) -> None:
        self._order.move_to_end(slot)

    def forget(self, slot: int) -> None:
        """The slot was emptied: it is offered first again."""
        self._owner.pop(slot, None)

    def victim(self, readers: Sequence[int]) -> int | None:
        """An empty slot nobody holds if any, else the policy's choice among the occupied slots
        nobody holds; None if all are held. (Runs on every miss: one pass, none when all are full.)"""
        if len(self._owner) < len(self._order):
            for s in self._order:
                if readers[s] == 0 and s not in self._owner:
                    return s
        return self._choose(readers)

    def _choose(self, readers: Sequence[int]) -> int | None:
        """LRU: the least recently used slot nobody holds."""
        for s in self._order:
            if readers[s] == 0:
                return s
        return None


class LfuSlots(LruSlots):
    """Least frequently used first, frequencies decaying by ``decay`` per lookup; LRU breaks ties.

    A key's score is the sum over its past lookups of ``decay ** age`` (age in lookups), kept as
    (score, time) and brought forward lazily, so each lookup costs O(1).
    """

    def __init__(self, slots: Iterable[int], decay: float = 0.99):
        super().__init__(slots)
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"tiers.gpu.lfu_decay: must be in (0, 1], got {decay!r}")
        self.decay = decay
        self.now = 0
        self._score: dict[ExpertKey, tuple[float, int]] = {}

    def score(self, key: ExpertKey) -> float:
        s, t = self._score.get(key, (0.0, self.now))
        return s * self.decay ** (self.now - t)

    def access(self, key: ExpertKey) -> None:
        self.now += 1
        self._score[key] = (self.score(key) + 1.0, self.now)

    def _choose(self, readers: Sequence[int]) -> int | None:
        # min by score over the slots nobody holds; LRU order breaks ties (min keeps the first minimum).
        free = [s for s in self._order if readers[s] == 0]
        return min(free, key=lambda s: self.score(self._owner[s])) if free else None


class ForecastSlots(LruSlots):
    """Evict the expert whose next use is forecast farthest away (an online estimate of Belady's MIN).

    Layers are called in a fixed cycle (``layers``), so an expert of layer ``l`` cannot be used
    before ``l``'s next call: ``d`` calls from now, 1 for the next layer and ``n`` for the layer
    just called. Each expert's chance ``p`` of being used at one call of its layer is the larger
    of two moving averages over its layer's calls: a fast one (``fast``: did the last calls use
    it, which catches tokens reusing experts) and a slow one (``slow``: long-run popularity). With
    ``p`` per call the expected wait is ``d + n * (1/p - 1)`` layer calls; the largest is evicted.
    LRU is exactly wrong on this cycle: the least recently used expert is the one needed next.
    Experts used by the current call are never chosen while another slot is free.
    """

    def __init__(self, slots: Iterable[int], layers: Sequence[int], *, fast: float = 0.9, slow: float = 0.02):
        super().__init__(slots)
        for name, rate in (("fast", fast), ("slow", slow)):
            if not 0.0 < rate < 1.0:
                raise ValueError(f"ForecastSlots: {name} must be in (0, 1), got {rate!r}")
        self.fast, self.slow = fast, slow
        self.position = {layer: i for i, layer in enumerate(layers)}  # layer -> place in the cycle
        self.calls: dict[int, int] = {}  # layer -> calls so far
        self.current: int | None = None
        self.in_call: set[ExpertKey] = set()  # experts the current call uses
        self._counted: set[ExpertKey] = set()  # ... and has looked up so far
        self._avg: dict[ExpertKey, tuple[float, float, int]] = {}  # key -> (fast, slow, at call)
        # slot -> its owner's wait, within the current call: a wait changes only when its owner
        # changes, or when the call uses it (then it is -1 through ``in_call``)
        self._waits: dict[int, float] = {}

    def visit(self, layer: int, keys: Iterable[ExpertKey] = ()) -> None:
        self.calls[layer] = self.calls.get(layer, 0) + 1
        self.current = layer
        self.in_call = set(keys)
        self._counted = set()
        self._waits.clear()

    def assign(self, slot: int, key: ExpertKey) -> None:
        self._waits.pop(slot, None)
        super().assign(slot, key)

    def forget(self, slot: int) -> None:
        self._waits.pop(slot, None)
        super().forget(slot)

    def _averages(self, key: ExpertKey) -> tuple[float, float]:
        f, s, at = self._avg.get(key, (0.0, 0.0, self.calls.get(key.layer, 0)))
        gap = self.calls.get(key.layer, 0) - at
        return f * (1.0 - self.fast) ** gap, s * (1.0 - self.slow) ** gap

    def access(self, key: ExpertKey) -> None:
        if key in self._counted:
            return
        self._counted.add(key)
        self.in_call.add(key)
        f, s = self._averages(key)
        self._avg[key] = (f + self.fast * (1.0 - f), s + self.slow * (1.0 - s), self.calls.get(key.layer, 0))

    def chance(self, key: ExpertKey) -> float:
        """``key``'s chance of use at one call of its layer: the larger moving average."""
        return max(*self._averages(key))

    def wait(self, key: ExpertKey) -> float:
        """Expected layer calls until ``key`` is next used (-1: the current call uses it)."""
        if key in self.in_call:
            return -1.0
        n = max(len(self.position), 1)
        here, there = self.position.get(self.current), self.position.get(key.layer)
        d = n if here is None or there is None else ((there - here) % n or n)
        return d + n * (1.0 / max(self.chance(key), 1e-6) - 1.0)

    def _choose(self, readers: Sequence[int]) -> int | None:
        # ``wait`` for each slot nobody holds, inlined: this runs on every miss, over every slot.
        n = max(len(self.position), 1)
        here = self.position.get(self.current)
        fast, slow, calls, avg, position, in_call = 1.0 - self.fast, 1.0 - self.slow, self.calls, self._avg, self.position, self.in_call
        waits = self._waits
        best, best_wait = None, None
        for s in self._order:  # in LRU order: the first of equal waits wins, as with max()
            if readers[s]:
                continue
            key = self._owner[s]
            if key in in_call:
                w = -1.0
            else:
                w = waits.get(s)
                if w is None:
                    there = position.get(key.layer)
                    d = n if here is None or there is None else ((there - here) % n or n)
                    now = calls.get(key.layer, 0)
                    f, sl, at = avg.get(key, (0.0, 0.0, now))
                    p = max(f * fast ** (now - at), sl * slow ** (now - at), 1e-6)
                    w = waits[s] = d + n * (1.0 / p - 1.0)
            if best_wait is None or w > best_wait:
                best, best_wait = s, w
        return best


class MarkovSlots(ForecastSlots):
    """The forecast's victim rule (evict the largest expected wait ``d + n * (1/p - 1)``) with each
    expert's chance ``p`` of use at its layer's next call learned apart for two states: its
    layer's last call used it, or did not. Routing is sticky (a token often keeps the experts the
    last one used) and skewed (a few experts take most fresh picks), so the two chances differ by
    far more than one moving average per expert can follow.

    Per expert, counted at each call of its layer after the first: the calls after one that used
    it (``na``) and how many of those used it again (``ha``); the calls after one that did not,
    and how many used it (``hb``). Early on an expert has few samples, so each chance is pulled
    towards a prior worth ``prior`` calls: for the unused state the forecast's slow moving average
    (its long-run popularity), for the used state the layer's pooled reuse rate ``r`` plus
    ``(1 - r)`` times that popularity (kept, or picked afresh).

    With ``experts`` (per layer) known, a layer uses the chain only while its two states differ
    (``_states_differ``), and the forecast's chance otherwise: under uniform routing the
    per-expert counts are noise against a small spread of true chances. On the synthetic traces
    (``bench/cache_bound.py``, ``bench/results/cache_policies/``) this keeps as many hits as the
    forecast or more, except with Mixtral's counts under mild skew and mild reuse.
    """

    SIGNIFICANCE = 4.0  # standard errors by which a layer's two states must differ for the chain to be used

    def __init__(self, slots: Iterable[int], layers: Sequence[int], *, prior: float = 8.0, experts: int | None = None, **rates: float):
        super().__init__(slots, layers, **rates)
        if not prior > 0:
            raise ValueError(f"MarkovSlots: prior must be > 0, got {prior!r}")
        self.prior = prior
        self.experts = experts  # per layer; None: the chain is always used
        self.fresh: dict[int, tuple[int, int]] = {}  # layer -> (experts used after a call that did not use them, chances to)
        self.chained: dict[int, bool] = {}  # layer -> whether its two states differ (set at each of its calls)
        self.last: dict[int, frozenset[int]] = {}  # layer -> experts its last call used
        self.steps: dict[int, int] = {}  # layer -> calls after its first (transitions counted)
        self.kept: dict[int, tuple[int, int]] = {}  # layer -> (experts kept from one call to the next, chances to)
        self._na: dict[int, dict[int, int]] = {}  # layer -> expert -> calls after one that used it
        self._ha: dict[int, dict[int, int]] = {}  # ... of which used it again
        self._hb: dict[int, dict[int, int]] = {}  # layer -> expert -> uses after a call that did not use it

    def visit(self, layer: int, keys: Iterable[ExpertKey] = ()) -> None:
        keys = list(keys)
        cur = frozenset(k.expert for k in keys)
        prev = self.last.get(layer)
        if prev is not None:
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
        self.last[layer] = cur
        super().visit(layer, keys)

    def _states_differ(self, layer: int) -> bool:
        """Whether the layer's pooled reuse rate and fresh-use rate differ by ``SIGNIFICANCE``
        standard errors (two binomial proportions). Under uniform routing they do not, and then the
        per-state chances are noise the forecast's averages do not have."""
        kept, chances = self.kept.get(layer, (0, 0))
        used, fresh_chances = self.fresh.get(layer, (0, 0))
        if chances == 0 or fresh_chances == 0:
            return False
        pooled = (kept + used) / (chances + fresh_chances)
        se = math.sqrt(max(pooled * (1.0 - pooled), 1e-12) * (1.0 / chances + 1.0 / fresh_chances))
        return abs(kept / chances - used / fresh_chances) > self.SIGNIFICANCE * se

    def chance(self, key: ExpertKey) -> float:
        """``key``'s chance of use at its layer's next call, given whether its last call used it
        (the forecast's, while the layer's two states do not differ)."""
        layer, x = key
        if self.experts is not None and not self.chained.get(layer, False):
            return super().chance(key)
        popularity = self._averages(key)[1]
        na = self._na.get(layer, {}).get(x, 0)
        if x in self.last.get(layer, ()):
            kept, chances = self.kept.get(layer, (0, 0))
            reuse = (kept + 1) / (chances + 2)
            prior = reuse + (1.0 - reuse) * popularity
            return (self._ha.get(layer, {}).get(x, 0) + self.prior * prior) / (na + self.prior)
        return (self._hb.get(layer, {}).get(x, 0) + self.prior * popularity) / (self.steps.get(layer, 0) - na + self.prior)

    def _choose(self, readers: Sequence[int]) -> int | None:
        # ``wait`` (through this class's ``chance``) for each slot nobody holds, kept within the call
        # as the forecast's: counts change only at a visit, and a key looked up joins ``in_call``
        waits, owner, in_call = self._waits, self._owner, self.in_call
        best, best_wait = None, None
        for s in self._order:  # in LRU order: the first of equal waits wins
            if readers[s]:
                continue
            key = owner[s]
            if key in in_call:
                w = -1.0
            else:
                w = waits.get(s)
                if w is None:
                    w = waits[s] = self.wait(key)
            if best_wait is None or w > best_wait:
                best, best_wait = s, w
        return best


def make_cache(policy: str, slots: Iterable[int], *, decay: float = 0.99, layers: Sequence[int] = (), experts: int | None = None) -> LruSlots:
    if policy == "lru":
        return LruSlots(slots)
    if policy == "lfu":
        return LfuSlots(slots, decay)
    if policy == "forecast":
        return ForecastSlots(slots, layers)
    if policy == "markov":
        return MarkovSlots(slots, layers, experts=experts)
    raise ValueError(f"tiers.gpu.cache: unknown policy {policy!r}; allowed: {list(POLICIES)}")


def replay(trace: Sequence[ExpertKey], capacity: int, hot: set[ExpertKey], cache: Callable[[range], LruSlots]) -> int:
    """Hits a policy gets on ``trace`` with ``capacity`` staging slots (hot keys always hit, not counted)."""
    policy = cache(range(capacity))
    where: dict[ExpertKey, int] = {}
    owner: dict[int, ExpertKey] = {}
    readers = [0] * capacity
    hits = 0
    for i, key in enumerate(trace):
        if i == 0 or key.layer != trace[i - 1].layer:  # the trace is in call order: a change of layer is a new call
            end = i
            while end < len(trace) and trace[end].layer == key.layer:
                end += 1
            policy.visit(key.layer, trace[i:end])
        if key in hot:
            continue
        policy.access(key)
        slot = where.get(key)
        if slot is not None:
            hits += 1
            policy.touch(slot)
            continue
        slot = policy.victim(readers)
        if slot in owner:
            del where[owner[slot]]
        owner[slot] = key
        where[key] = slot
        policy.assign(slot, key)
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
