"""The residency transition function as a state machine, checked against an independent model.

The reference model below is written from the documented design (module docstring of
``tiers.residency`` and the comments on ``Op``), not from ``_EDGES``:

    absent  --place_hot(slot)-->  ready   (pinned; home gpu only)
    absent  --stage(slot)------>  loading (not pinned)
    loading --ready------------>  ready
    loading --evict------------>  absent  (slot freed)
    ready   --evict------------>  absent  (slot freed; never for a pinned expert)

and the rebalancer's ops, which change homes:

    absent, not pinned  --promote(slot)-->  loading, pinned, home gpu, no host offset
    loading|ready, pinned --demote------->  absent, not pinned, home nvme, no host offset
    home nvme, not pinned --warm(offset)->  home cpu at offset (slot state unchanged)
    home cpu, not pinned  --cool--------->  home nvme, no host offset (slot state unchanged)
    home cpu, not pinned  --move(offset)->  home cpu at offset (slot state unchanged)

Everything else raises ``IllegalTransition``; place_hot, stage and promote need a slot, warm and
move an offset.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiers.loader.layout import ExpertKey
from tiers.residency import Home, IllegalTransition, Op, Residency, ResidencyTable, SlotState, transition

L, R = SlotState.LOADING, SlotState.READY

# (state, op) -> new state; the model's own table of the allowed edges.
MODEL_EDGES = {
    ("absent", "place_hot"): "ready",
    ("absent", "stage"): "loading",
    ("loading", "ready"): "ready",
    ("loading", "evict"): "absent",
    ("ready", "evict"): "absent",
}
NEEDS_SLOT = {"place_hot", "stage"}
HOME_CHANGES = {"promote", "demote", "warm", "cool", "move"}


@dataclass(frozen=True)
class ModelEntry:
    home: str
    host_offset: int | None
    state: str
    slot: int | None
    pinned: bool


def model_of(r: Residency) -> ModelEntry:
    return ModelEntry(r.home.value, r.host_offset, r.state.value, r.slot, r.pinned)


def model_step(m: ModelEntry, op: str, slot: int | None, offset: int | None = None) -> ModelEntry | None:
    """The predicted next entry, or None when the model says the op is illegal."""
    if op == "promote":
        if m.state != "absent" or m.pinned or slot is None:
            return None
        return ModelEntry("gpu", None, "loading", slot, True)
    if op == "demote":
        if m.state == "absent" or not m.pinned:
            return None
        return ModelEntry("nvme", None, "absent", None, False)
    if op == "warm":
        if m.pinned or m.home != "nvme" or offset is None:
            return None
        return ModelEntry("cpu", offset, m.state, m.slot, m.pinned)
    if op == "cool":
        if m.pinned or m.home != "cpu":
            return None
        return ModelEntry("nvme", None, m.state, m.slot, m.pinned)
    if op == "move":
        if m.pinned or m.home != "cpu" or offset is None:
            return None
        return ModelEntry("cpu", offset, m.state, m.slot, m.pinned)
    nxt = MODEL_EDGES.get((m.state, op))
    if nxt is None:
        return None
    if op == "evict" and m.pinned:
        return None
    if op == "place_hot" and m.home != "gpu":
        return None
    if op in NEEDS_SLOT and slot is None:
        return None
    if op == "place_hot":
        return ModelEntry(m.home, m.host_offset, nxt, slot, True)
    if op == "stage":
        return ModelEntry(m.home, m.host_offset, nxt, slot, False)
    if op == "evict":
        return ModelEntry(m.home, m.host_offset, nxt, None, m.pinned)
    return ModelEntry(m.home, m.host_offset, nxt, m.slot, m.pinned)


# -- strategies -------------------------------------------------------------------------------
homes = st.sampled_from(list(Home))
ops = st.sampled_from(list(Op))
slots = st.none() | st.integers(min_value=0, max_value=11)
offsets = st.none() | st.integers(0, 64).map(lambda x: x * 4096)


@st.composite
def consistent_residency(draw) -> Residency:
    """A residency satisfying the table's invariants (what the engine can produce)."""
    home = draw(homes)
    state = draw(st.sampled_from(list(SlotState)))
    pinned = draw(st.booleans()) if state is not SlotState.ABSENT else False
    if pinned:
        home = Home.GPU
    off = draw(st.integers(0, 1 << 20).map(lambda x: x * 4096)) if home is Home.CPU else None
    if state is SlotState.ABSENT:
        return Residency(home=home, host_offset=off)
    slot = draw(st.integers(0, 11))
    return Residency(home=home, host_offset=off, slot=slot, state=state, pinned=pinned)


any_residency = st.builds(
    Residency,
    home=homes,
    host_offset=st.none() | st.integers(0, 1 << 30),
    slot=slots,
    state=st.sampled_from(list(SlotState)),
    pinned=st.booleans(),
)


# -- the pure function ------------------------------------------------------------------------
@settings(max_examples=400, deadline=None)
@given(r=any_residency, op=ops, slot=slots, offset=offsets)
def test_transition_matches_model_and_is_pure(r, op, slot, offset):
    before = copy.deepcopy(r)
    predicted = model_step(model_of(r), op.value, slot, offset)
    if predicted is None:
        with pytest.raises(IllegalTransition):
            transition(r, op, slot, offset)
    else:
        new = transition(r, op, slot, offset)
        assert isinstance(new, Residency)
        assert model_of(new) == predicted
        # deterministic: the same input gives the same output
        assert transition(r, op, slot, offset) == new
    # pure: the input value is unchanged, whether the op was legal or not
    assert r == before
    assert model_of(r) == model_of(before)


@pytest.mark.parametrize("op", [o for o in Op])
@pytest.mark.parametrize("state", [s for s in SlotState])
def test_every_edge_is_enumerated(state, op):
    """Exhaustive over (state, op) pairs with a slot and an offset given, from nvme, nothing pinned."""
    slot = None if state is SlotState.ABSENT else 3
    r = Residency(home=Home.NVME, slot=slot, state=state)
    predicted = model_step(model_of(r), op.value, 5, 4096)
    if predicted is not None:
        assert model_of(transition(r, op, 5, 4096)) == predicted
    else:
        with pytest.raises(IllegalTransition):
            transition(r, op, 5, 4096)


@pytest.mark.parametrize("op", [Op.PLACE_HOT, Op.STAGE])
def test_slot_is_required(op):
    with pytest.raises(IllegalTransition):
        transition(Residency(home=Home.GPU), op, None)
    # slot 0 is a slot, not "no slot"
    assert transition(Residency(home=Home.GPU), op, 0).slot == 0


def test_pinned_is_never_evicted():
    hot = transition(Residency(home=Home.GPU), Op.PLACE_HOT, 0)
    assert hot.pinned and hot.state is SlotState.READY and hot.slot == 0
    for op in Op:
        if op is Op.DEMOTE:
            continue  # the one way out of a hot slot
        with pytest.raises(IllegalTransition):
            transition(hot, op, 1, 4096)
    assert hot == Residency(home=Home.GPU, slot=0, state=SlotState.READY, pinned=True)


# -- the table as a state machine ---------------------------------------------------------------
KEYS = [ExpertKey(L_, e) for L_ in range(2) for e in range(3)]


class ResidencyMachine(RuleBasedStateMachine):
    """Random ops on a ResidencyTable, each predicted by the model before it is applied."""

    @initialize(initial=st.lists(consistent_residency(), min_size=len(KEYS), max_size=len(KEYS)))
    def setup(self, initial):
        init = dict(zip(KEYS, initial))
        self.table = ResidencyTable(init)
        self.model = {k: model_of(r) for k, r in init.items()}
        self.ever_pinned: dict[ExpertKey, int] = {k: r.slot for k, r in init.items() if r.pinned}
        self.initial_snapshot = copy.deepcopy(init)
        self.init_dict = init
        self.homes = {k: r.home for k, r in init.items()}

    @rule(key=st.sampled_from(KEYS), op=ops, slot=slots, offset=offsets)
    def apply(self, key, op, slot, offset):
        old_obj = self.table[key]
        old_val = copy.deepcopy(old_obj)
        predicted = model_step(self.model[key], op.value, slot, offset)
        if predicted is None:
            with pytest.raises(IllegalTransition) as ei:
                self.table.apply(key, op, slot, offset)
            assert str(key) in str(ei.value), "the error names the expert"
            assert self.table[key] == old_val, "an illegal op leaves the table unchanged"
        else:
            new = self.table.apply(key, op, slot, offset)
            assert model_of(new) == predicted
            assert self.table[key] == new
            if op.value not in HOME_CHANGES:
                assert new.home is old_val.home, "only the rebalancer's ops change a home"
            self.model[key] = predicted
            self.homes[key] = new.home
            if predicted.pinned:
                self.ever_pinned.setdefault(key, predicted.slot)
            if op is Op.DEMOTE:
                self.ever_pinned.pop(key)
        # the previous value object was not mutated (transition is pure)
        assert old_obj == old_val

    @precondition(lambda self: bool(getattr(self, "ever_pinned", None)))
    @rule(data=st.data())
    def try_evict_hot(self, data):
        key = data.draw(st.sampled_from(sorted(self.ever_pinned)))
        with pytest.raises(IllegalTransition):
            self.table.apply(key, Op.EVICT)

    @invariant()
    def matches_model(self):
        if not hasattr(self, "table"):
            return
        assert len(self.table) == len(KEYS)
        for k in KEYS:
            assert model_of(self.table[k]) == self.model[k]

    @invariant()
    def slot_iff_in_gpu(self):
        if not hasattr(self, "table"):
            return
        for k, r in self.table.items():
            if r.state is SlotState.ABSENT:
                assert r.slot is None, f"{k} is absent but claims slot {r.slot}"
                assert not r.pinned
            else:  # loading (staged) or ready
                assert r.slot is not None, f"{k} is {r.state.value} without a slot"

    @invariant()
    def hot_stays_hot(self):
        if not hasattr(self, "table"):
            return
        for k, s in self.ever_pinned.items():
            r = self.table[k]
            assert r.pinned and r.state is not SlotState.ABSENT and r.slot == s, f"hot {k} moved: {r}"
            assert r.home is Home.GPU

    @invariant()
    def home_matches_offset(self):
        if not hasattr(self, "table"):
            return
        for k, r in self.table.items():
            assert r.home is self.homes[k]
            assert (r.home is Home.CPU) == (r.host_offset is not None), f"{k}: home {r.home.value}, offset {r.host_offset}"
        grid = self.table.grid  # the masks the rebalancer plans over say what the rows say
        assert (self.table.hot_mask == grid.mask(k for k, r in self.table.items() if r.pinned)).all()
        assert (self.table.warm_mask == grid.mask(k for k, r in self.table.items() if r.home is Home.CPU)).all()
        for k, r in self.table.items():
            i = grid.index(k)
            assert self.table.hot_slot[i] == (r.slot if r.pinned else -1)
            assert self.table.host_offset[i] == (r.host_offset if r.home is Home.CPU else -1)
        counts = self.table.counts()
        assert sum(counts.values()) == len(KEYS)
        for h in Home:
            assert counts[h.value] == sum(1 for x in self.homes.values() if x is h)

    @invariant()
    def initial_dict_not_aliased(self):
        if not hasattr(self, "table"):
            return
        # ResidencyTable copies its initial mapping: applying ops never changes the caller's dict.
        assert self.init_dict == self.initial_snapshot


ResidencyMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestResidencyMachine = ResidencyMachine.TestCase


# -- a life cycle the engine goes through ---------------------------------------------------------
def test_staging_cycle():
    t = ResidencyTable({ExpertKey(0, 0): Residency(home=Home.CPU, host_offset=0), ExpertKey(0, 1): Residency(home=Home.GPU)})
    hot = t.apply(ExpertKey(0, 1), Op.PLACE_HOT, 0)
    assert (hot.state, hot.slot, hot.pinned) == (R, 0, True)
    k = ExpertKey(0, 0)
    for _ in range(3):
        assert (t.apply(k, Op.STAGE, 1).state, t[k].slot) == (L, 1)
        with pytest.raises(IllegalTransition):
            t.apply(k, Op.STAGE, 2)  # already in a slot
        assert t.apply(k, Op.READY).state is R
        with pytest.raises(IllegalTransition):
            t.apply(k, Op.READY)
        assert t.apply(k, Op.EVICT) == Residency(home=Home.CPU, host_offset=0)
        with pytest.raises(IllegalTransition):
            t.apply(k, Op.EVICT)
    assert t[ExpertKey(0, 1)] == hot


def test_a_move_changes_the_place_and_the_versions_copies_compare():
    """A warm expert moved within the host pool keeps its home and slot; the table's versions
    move on, so direct decode's device tables (which hold host places) are rebuilt."""
    k = ExpertKey(1, 0)
    t = ResidencyTable({k: Residency(home=Home.CPU, host_offset=8192), ExpertKey(0, 0): Residency(home=Home.CPU, host_offset=0)})
    t.apply(k, Op.STAGE, 2)
    version, layer = t.homes_version, t.layer_versions.get(1, 0)
    moved = t.apply(k, Op.MOVE, offset=4096 * 7)
    assert (moved.home, moved.host_offset, moved.slot, moved.state) == (Home.CPU, 4096 * 7, 2, L)
    assert t.homes_version == version + 1 and t.layer_versions[1] == layer + 1
    assert t.warm_mask[t.grid.index(k)] and t.layer_versions.get(0, 0) == 0
    with pytest.raises(IllegalTransition):
        t.apply(k, Op.MOVE)  # no place given
