"""The table as a state machine: random sequences of every transition against a shadow model.

Each rule draws a transition and its arguments at random (legal or not), computes from the shadow
model whether it is legal, applies it to the table, and checks that the table agreed (it raised
``IllegalTransition`` exactly when the model says illegal, and changed nothing then). After every
step the invariants hold: at most one owner per slot (``Table.check``); no slot was rewritten
while a reader held it (each reader's view of the slot's memory is unchanged until it releases);
the pools (a model of what bytes each slot holds) agree with the occupants; and the device-side
copies (uploads of the table's arrays, as direct decode keeps them) agree whenever they are as
new as the table's ``homes_version``.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiers.loader.layout import ExpertKey
from tiers.store.table import Home, IllegalTransition, Residency, SlotState, Table

BY = ("direct", "stream")


class TableMachine(RuleBasedStateMachine):
    @initialize(sizes=st.lists(st.tuples(st.integers(1, 3), st.integers(2, 5), st.integers(1, 4), st.integers(1, 4)), min_size=1, max_size=2),
                data=st.data())
    def build(self, sizes, data):
        """Pools of (layers, experts per layer, hot slots, staging slots); experts homed at random."""
        homes, pool_of, pool_sizes, layer = {}, {}, [], 0
        self.hot_slots: list[int] = []
        self.offsets = iter(range(0, 1 << 40, 4096))
        for p, (n_layers, n_experts, hot, staging) in enumerate(sizes):
            hot = min(hot, n_layers * n_experts)
            for _ in range(n_layers):
                pool_of[layer] = p
                for e in range(n_experts):
                    home = data.draw(st.sampled_from([Home.CPU, Home.NVME]))
                    homes[ExpertKey(layer, e)] = Residency(home, next(self.offsets) if home is Home.CPU else None)
                layer += 1
            pool_sizes.append(hot + staging)
            self.hot_slots.append(hot)
        keys = sorted(homes)
        for p, hot in enumerate(self.hot_slots):  # the first experts of each pool go hot, in a row, as at load
            mine = [k for k in keys if pool_of[k.layer] == p][:hot]
            for k in mine:
                homes[k] = Residency(Home.GPU)
            self.hot_slots[p] = len(mine)
        self.table = Table(homes, pool_sizes, pool_of)
        self.keys = keys
        self.pool_of = pool_of
        self.memory: dict[tuple[int, int], ExpertKey] = {}  # the bytes each slot holds (the pools' model)
        self.reads: list[tuple[int, int, ExpertKey | None]] = []  # each reader: the slot and what it saw there
        self.events = 0
        for p, hot in enumerate(self.hot_slots):
            for s, k in enumerate([k for k in keys if homes[k].home is Home.GPU and pool_of[k.layer] == p]):
                self.table.place_hot(k, p, s)
                self.memory[(p, s)] = k
        self.device = (self.table.homes_version, self.table.hot_slot.copy(), self.table.host_offset.copy())

    # -- helpers ---------------------------------------------------------------------------------
    def _slot(self, data) -> tuple[int, int]:
        p = data.draw(st.integers(0, len(self.hot_slots) - 1))
        return p, data.draw(st.integers(0, self.table.pool_sizes()[p] - 1))

    def _snapshot(self):
        return (dict(self.table.items()), [self.table.slot(p, s) for p, n in enumerate(self.table.pool_sizes()) for s in range(n)],
                self.table.homes_version)

    def _try(self, legal: bool, fn, *args, **kwargs):
        """Apply a transition; it must raise exactly when the model says it is illegal, and then change nothing."""
        before = self._snapshot()
        try:
            got = fn(*args, **kwargs)
        except IllegalTransition as e:
            assert not legal, f"{fn.__name__}{args}: the model says legal, the table refused: {e}"
            assert self._snapshot() == before, f"{fn.__name__}{args}: an illegal transition changed the table"
            return None
        assert legal, f"{fn.__name__}{args}: the model says illegal, the table allowed it"
        return got

    def _free_to_write(self, p: int, s: int, by: str | None = None) -> bool:
        v = self.table.slot(p, s)
        return v.readers == 0 and v.reserved == by

    # -- rules: every transition -------------------------------------------------------------------
    @rule(data=st.data(), by=st.sampled_from([None, *BY]))
    def stage(self, data, by):
        key = data.draw(st.sampled_from(self.keys))
        p, s = self._slot(data)
        r, v = self.table[key], self.table.slot(p, s)
        legal = r.slot is None and not r.hot and self.pool_of[key.layer] == p and self._free_to_write(p, s, by) and not v.hot
        old = self._try(legal, self.table.stage, key, p, s, by=by)
        if legal:
            assert old == v.occupant
            self.memory[(p, s)] = key

    @rule(data=st.data())
    def written(self, data):
        p, s = self._slot(data)
        self.events += 1
        self._try(self.table.slot(p, s).writing, self.table.written, p, [s], f"event{self.events}", "copy")

    @rule(data=st.data())
    def hold(self, data):
        p, s = self._slot(data)
        v = self.table.slot(p, s)
        legal = v.occupant is not None or v.reserved is not None
        self._try(legal, self.table.hold, p, s)
        if legal:
            self.reads.append((p, s, self.memory.get((p, s)) if v.occupant is not None else None))

    @rule(data=st.data())
    def take_ready(self, data):
        p, s = self._slot(data)
        v = self.table.slot(p, s)
        pending = self.table.ready_event(p, s)
        legal = v.readers > 0 and not (v.writing and pending is None)
        got = self._try(legal, self.table.take_ready, p, s)
        if legal:
            assert (got is None) == (pending is None) and (got is None or got[0] == pending)
            assert self.table.state(p, s) is SlotState.IN_USE and not self.table.slot(p, s).writing

    @rule(data=st.data(), record=st.booleans())
    def release(self, data, record):
        p, s = self._slot(data)
        v = self.table.slot(p, s)
        self.events += 1
        self._try(v.readers > 0, self.table.release, p, s, f"read{self.events}" if record else None)
        if v.readers > 0:
            i = next(i for i, (rp, rs, _) in enumerate(self.reads) if (rp, rs) == (p, s))
            _, _, seen = self.reads.pop(i)
            if seen is not None:  # the bytes this reader held were never rewritten under it
                assert self.memory.get((p, s)) == seen

    @rule(data=st.data(), by=st.sampled_from([None, *BY]))
    def evict(self, data, by):
        p, s = self._slot(data)
        v = self.table.slot(p, s)
        legal = self._free_to_write(p, s, by) and not v.hot
        old = self._try(legal, self.table.evict, p, s, by=by)
        if legal:
            assert old == v.occupant and self.table.occupant(p, s) is None
            self.memory.pop((p, s), None)

    @rule(data=st.data(), by=st.sampled_from(BY), keep=st.booleans())
    def reserve(self, data, by, keep):
        p, s = self._slot(data)
        v = self.table.slot(p, s)
        legal = self._free_to_write(p, s) and not v.hot
        self._try(legal, self.table.reserve, p, s, by, keep=keep)
        if legal and not keep:
            self.memory.pop((p, s), None)

    @rule(data=st.data(), by=st.sampled_from(BY), keep=st.booleans())
    def unreserve(self, data, by, keep):
        p, s = self._slot(data)
        v = self.table.slot(p, s)
        legal = v.reserved == by and v.readers == 0
        self.events += 1
        self._try(legal, self.table.unreserve, p, s, by, f"read{self.events}", keep=keep)
        if legal and not keep:
            self.memory.pop((p, s), None)

    @rule(data=st.data())
    def swap_hot(self, data):
        key = data.draw(st.sampled_from(self.keys))
        p, s = self._slot(data)
        v, r = self.table.slot(p, s), self.table[key]
        legal = v.hot and v.readers == 0 and v.reserved is None and r.slot is None and self.pool_of[key.layer] == p
        old = self._try(legal, self.table.swap_hot, key, p, s)
        if legal:
            assert old == v.occupant and self.table[old].home is Home.NVME and self.table[key].hot
            self.memory[(p, s)] = key

    @rule(data=st.data())
    def warm(self, data):
        key = data.draw(st.sampled_from(self.keys))
        r = self.table[key]
        self._try(not r.hot and r.home is Home.NVME, self.table.warm, key, next(self.offsets))

    @rule(data=st.data())
    def cool(self, data):
        key = data.draw(st.sampled_from(self.keys))
        self._try(self.table[key].home is Home.CPU, self.table.cool, key)

    @rule(data=st.data())
    def move(self, data):
        key = data.draw(st.sampled_from(self.keys))
        self._try(self.table[key].home is Home.CPU, self.table.move, key, next(self.offsets))

    @rule()
    def upload(self):
        """Direct decode's device-side copies: re-uploaded when the table's homes changed."""
        if self.device[0] != self.table.homes_version:
            self.device = (self.table.homes_version, self.table.hot_slot.copy(), self.table.host_offset.copy())

    # -- invariants ------------------------------------------------------------------------------
    @invariant()
    def one_owner_per_slot_and_records_agree(self):
        self.table.check()

    @invariant()
    def pools_hold_the_occupants(self):
        for p, n in enumerate(self.table.pool_sizes()):
            for s in range(n):
                occupant = self.table.occupant(p, s)
                if occupant is not None:
                    assert self.memory.get((p, s)) == occupant, f"slot {(p, s)} holds {self.memory.get((p, s))}, the table says {occupant}"

    @invariant()
    def readers_match(self):
        counts: dict[tuple[int, int], int] = {}
        for p, s, _ in self.reads:
            counts[(p, s)] = counts.get((p, s), 0) + 1
        for p, n in enumerate(self.table.pool_sizes()):
            assert list(self.table.readers(p)) == [counts.get((p, s), 0) for s in range(n)]

    @invariant()
    def hot_experts_stay_hot(self):
        for p, hot in enumerate(self.hot_slots):
            for s in range(hot):
                v = self.table.slot(p, s)
                assert v.hot and v.occupant is not None and self.table[v.occupant].hot

    @invariant()
    def device_copies_agree_when_current(self):
        version, hot_slot, host_offset = self.device
        if version == self.table.homes_version:
            assert np.array_equal(hot_slot, self.table.hot_slot) and np.array_equal(host_offset, self.table.host_offset)


TestTableMachine = TableMachine.TestCase
TestTableMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _ignores_readers(self, what, pool, slot, by=None, about=""):
    """A mutant slot rule: writes ignore readers."""
    p = self._pools[pool]
    if p.reserved[slot] != by:
        raise IllegalTransition(f"{what}: reserved")
    return p


def _keeps_old_record(self, p, slot):
    """A mutant emptying: the slot forgets its occupant, whose record still names the slot."""
    p.occupant[slot] = None
    p.writing[slot] = False
    p.ready[slot] = None
    p.pending.discard(slot)


@pytest.mark.parametrize("name, mutant, message", [
    ("_free_for_write", _ignores_readers, "the model says illegal, the table allowed it"),
    ("_empty", _keeps_old_record, "names|both in slot"),  # a record left behind shows as either
])
def test_the_machine_can_fail(monkeypatch, name, mutant, message):
    """The machine catches a table that lets a held slot be rewritten, and one whose records drift apart."""
    monkeypatch.setattr(Table, name, mutant)
    run = TableMachine.TestCase("runTest")
    run.settings = settings(max_examples=300, stateful_step_count=50, deadline=None, database=None, phases=[Phase.generate],
                            derandomize=True,  # the same sequences every run: the test is deterministic
                            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])  # no shrinking: finding it is the test
    with pytest.raises(AssertionError, match=message):
        run.runTest()
