"""The table's named transitions (tiers.store.table), example by example: a life cycle the runtime
goes through, every slot transition from every slot state, every home transition from every
home, each refusal with its ``IllegalTransition`` message and the table unchanged. Random
sequences of them are ``test_table_machine.py``'s."""
from __future__ import annotations

import pytest

from tiers.loader.layout import ExpertKey
from tiers.store.table import Home, IllegalTransition, Residency, SlotState, Table

EV, STREAM = object(), object()  # a ready event and the stream it was recorded on (the table only keeps them)


def snapshot(t: Table):
    return (dict(t.items()), [t.slot(p, s) for p, n in enumerate(t.pool_sizes()) for s in range(n)], t.homes_version,
            t.hot_mask.copy().tolist(), t.warm_mask.copy().tolist(), t.hot_slot.copy().tolist(), t.host_offset.copy().tolist())


def refused(t: Table, match: str, fn, *args, **kwargs) -> None:
    """``fn`` raises IllegalTransition matching ``match`` and leaves the table as it was."""
    before = snapshot(t)
    with pytest.raises(IllegalTransition, match=match):
        fn(*args, **kwargs)
    assert snapshot(t) == before, f"a refused {fn.__name__} changed the table"
    t.check()


def test_staging_cycle():
    """A warm expert staged, written, held, waited on, released and evicted, three times over; a hot
    one placed beside it; slot 0 is a slot like any other."""
    k, hot = ExpertKey(0, 0), ExpertKey(0, 1)
    t = Table({k: Residency(Home.CPU, 0), hot: Residency(Home.GPU)}, [3], {0: 0})
    t.place_hot(hot, 0, 2)
    assert t[hot] == Residency(Home.GPU, None, 2, True) and t.state(0, 2) is SlotState.READY and t.is_hot_slot(0, 2)
    for slot in (0, 1, 0):
        assert t.stage(k, 0, slot) is None
        assert t[k] == Residency(Home.CPU, 0, slot, False) and t.state(0, slot) is SlotState.WRITING
        refused(t, rf"^stage layer 0 expert 0: it is in slot {slot} already$", t.stage, k, 0, 1 - slot)
        refused(t, rf"^take_ready: slot {slot} of pool 0 \(layer 0 expert 0\) is not held$", t.take_ready, 0, slot)
        t.written(0, [slot], EV, STREAM)
        assert t.state(0, slot) is SlotState.WRITING and t.ready_event(0, slot) is EV and t.pending_slots(0) == {slot}
        t.hold(0, slot)
        assert t.state(0, slot) is SlotState.IN_USE
        pending = t.take_ready(0, slot)
        assert pending[:2] == (EV, STREAM) and t.take_ready(0, slot) is None, "a pending write is waited on once"
        refused(t, rf"^evict: slot {slot} of pool 0 \(layer 0 expert 0\) is held by 1 reader\(s\)$", t.evict, 0, slot)
        last = object()
        t.release(0, slot, last)
        assert t.state(0, slot) is SlotState.READY and t.last_read(0, slot) is last
        refused(t, rf"^release: slot {slot} of pool 0 is released more often than held$", t.release, 0, slot, None)
        refused(t, rf"^written: slot {slot} of pool 0 \(layer 0 expert 0\) has no write queued$", t.written, 0, [slot], EV, STREAM)
        assert t.evict(0, slot) == k
        assert t[k] == Residency(Home.CPU, 0) and t.state(0, slot) is SlotState.FREE and t.last_read(0, slot) is last
        assert t.evict(0, slot) is None, "an empty slot is emptied again: nothing leaves"
        t.check()
    assert t[hot] == Residency(Home.GPU, None, 2, True)


def test_a_write_nobody_waited_on_is_what_the_next_write_waits_on():
    """A slot emptied (or rewritten) while its write is pending: the next write into it must wait
    on that write's ready event, which takes the place of the last read."""
    a, b = ExpertKey(0, 0), ExpertKey(0, 1)
    t = Table({a: Residency(Home.NVME), b: Residency(Home.NVME)}, [1], {0: 0})
    t.stage(a, 0, 0)
    t.written(0, [0], EV, STREAM)
    assert t.stage(b, 0, 0) == a
    assert t.last_read(0, 0) is EV and t.ready_event(0, 0) is None and t.pending_slots(0) == set()
    t.check()


def test_a_hot_slot_is_never_evicted_staged_or_reserved():
    """Hot experts never leave their slot but through the rebalancer's ``swap_hot``; every other
    transition that would empty, rewrite or take their slot, or change their home, is refused."""
    hot, other = ExpertKey(0, 1), ExpertKey(0, 2)
    t = Table({hot: Residency(Home.GPU), other: Residency(Home.CPU, 4096)}, [2], {0: 0})
    t.place_hot(hot, 0, 0)
    refused(t, r"^evict: slot 0 of pool 0 is hot \(layer 0 expert 1\); hot experts are never evicted$", t.evict, 0, 0)
    refused(t, r"^stage layer 0 expert 2: slot 0 of pool 0 is hot \(layer 0 expert 1\)$", t.stage, other, 0, 0)
    refused(t, r"^reserve by direct: slot 0 of pool 0 is hot$", t.reserve, 0, 0, "direct")
    refused(t, r"^place_hot layer 0 expert 1: needs home gpu and no slot, has home gpu, slot 0$", t.place_hot, hot, 0, 1)
    refused(t, r"^warm layer 0 expert 1: needs home nvme, not hot$", t.warm, hot, 8192)
    refused(t, r"^cool layer 0 expert 1: needs home cpu, not gpu$", t.cool, hot)
    refused(t, r"^move layer 0 expert 1: needs home cpu, not gpu$", t.move, hot, 8192)
    refused(t, r"^unreserve by direct: slot 0 of pool 0 is reserved by None$", t.unreserve, 0, 0, "direct", None, keep=False)
    t.hold(0, 0)  # readers are the one thing a hot slot takes
    t.release(0, 0, None)
    assert t[hot] == Residency(Home.GPU, None, 0, True) and t.is_hot_slot(0, 0) and t.state(0, 0) is SlotState.READY
    # the one way out: the rebalancer gives its place to another expert, and it lives on disk
    assert t.swap_hot(other, 0, 0) == hot
    assert t[hot] == Residency(Home.NVME) and t[other] == Residency(Home.GPU, None, 0, True)
    assert t.state(0, 0) is SlotState.WRITING and t.is_hot_slot(0, 0)
    t.check()


def test_a_move_changes_the_place_and_the_versions_copies_compare():
    """A warm expert moved within the host pool keeps its home and slot; the table's versions
    move on, so direct decode's device tables (which hold host places) are rebuilt."""
    k = ExpertKey(1, 0)
    t = Table({k: Residency(Home.CPU, 8192), ExpertKey(0, 0): Residency(Home.CPU, 0)}, [3], {0: 0, 1: 0})
    t.stage(k, 0, 2)
    version, layer = t.homes_version, t.layer_versions.get(1, 0)
    t.move(k, 4096 * 7)
    assert t[k] == Residency(Home.CPU, 4096 * 7, 2, False) and t.state(0, 2) is SlotState.WRITING
    assert t.homes_version == version + 1 and t.layer_versions[1] == layer + 1
    assert t.warm_mask[t.grid.index(k)] and t.host_offset[t.grid.index(k)] == 4096 * 7 and t.layer_versions.get(0, 0) == 0
    t.cool(k)
    refused(t, r"^move layer 1 expert 0: needs home cpu, not nvme$", t.move, k, 0)
    refused(t, r"^cool layer 1 expert 0: needs home cpu, not nvme$", t.cool, k)
    t.check()


def test_place_hot_stage_and_swap_hot_refuse_a_wrong_slot_or_pool():
    a, b = ExpertKey(0, 0), ExpertKey(1, 0)
    t = Table({a: Residency(Home.NVME), b: Residency(Home.NVME), ExpertKey(1, 1): Residency(Home.GPU)}, [2, 2], {0: 0, 1: 1})
    refused(t, r"^stage layer 0 expert 0: pool 1 is not its layer's$", t.stage, a, 1, 0)
    refused(t, r"^place_hot layer 1 expert 1: slot 0 of pool 0 is not a free slot of its pool$", t.place_hot, ExpertKey(1, 1), 0, 0)
    refused(t, r"^place_hot layer 0 expert 0: needs home gpu and no slot, has home nvme, slot None$", t.place_hot, a, 0, 0)
    t.stage(b, 1, 1)
    refused(t, r"^place_hot layer 1 expert 1: slot 1 of pool 1 is not a free slot of its pool$", t.place_hot, ExpertKey(1, 1), 1, 1)
    refused(t, r"^swap_hot layer 0 expert 0: slot 1 of pool 1 is not a hot slot$", t.swap_hot, a, 1, 1)


def test_experts_start_in_no_slot_with_a_host_place_exactly_when_warm():
    with pytest.raises(IllegalTransition, match=r"^layer 0 expert 0: experts start in no slot \(place_hot puts them in\)$"):
        Table({ExpertKey(0, 0): Residency(Home.GPU, None, 0, True)}, [1], {0: 0})
    with pytest.raises(IllegalTransition, match=r"^layer 0 expert 0: home cpu with host offset None$"):
        Table({ExpertKey(0, 0): Residency(Home.CPU)}, [1], {0: 0})
    with pytest.raises(IllegalTransition, match=r"^layer 0 expert 0: home nvme with host offset 4096$"):
        Table({ExpertKey(0, 0): Residency(Home.NVME, 4096)}, [1], {0: 0})
    init = {ExpertKey(0, 0): Residency(Home.CPU, 0), ExpertKey(0, 1): Residency(Home.NVME)}
    copy = dict(init)
    t = Table(init, [1], {0: 0})
    t.stage(ExpertKey(0, 0), 0, 0)
    t.cool(ExpertKey(0, 0))
    assert init == copy, "the table copies its initial homes: its transitions never change the caller's dict"


# -- every slot transition from every slot state ----------------------------------------------------
A, B = ExpertKey(0, 1), ExpertKey(0, 2)  # A occupies slot 1 in the states that have an occupant; B is in no slot


def in_state(state: SlotState) -> Table:
    """Slot 1 of a pool of 3 (slot 0 hot) in ``state``; A (warm) its occupant where it has one."""
    t = Table({ExpertKey(0, 0): Residency(Home.GPU), A: Residency(Home.CPU, 0), B: Residency(Home.NVME)}, [3], {0: 0})
    t.place_hot(ExpertKey(0, 0), 0, 0)
    if state is SlotState.RESERVED:
        t.reserve(0, 1, "stream")
    elif state is not SlotState.FREE:
        t.stage(A, 0, 1)
        t.written(0, [1], EV, STREAM)
        if state is SlotState.READY:
            t.hold(0, 1)
            t.take_ready(0, 1)
            t.release(0, 1, None)
        elif state is SlotState.IN_USE:
            t.hold(0, 1)
    assert t.state(0, 1) is state
    t.check()
    return t


FREE, RESERVED, WRITING, READY, IN_USE = SlotState
HELD = r"slot 1 of pool 0 \(layer 0 expert 1\) is held by 1 reader\(s\)"
# (transition, state) -> the state slot 1 is in after it, or the message fragment it is refused with
EDGES = {
    "stage": {FREE: WRITING, RESERVED: "^stage layer 0 expert 2: slot 1 of pool 0 is reserved by stream$", WRITING: WRITING,
              READY: WRITING, IN_USE: f"^stage layer 0 expert 2: {HELD}$"},
    "written": {FREE: r"^written: slot 1 of pool 0 \(None\) has no write queued$",
                RESERVED: r"^written: slot 1 of pool 0 \(None\) has no write queued$", WRITING: WRITING,
                READY: r"^written: slot 1 of pool 0 \(layer 0 expert 1\) has no write queued$", IN_USE: IN_USE},
    "hold": {FREE: "^hold: slot 1 of pool 0 is free$", RESERVED: IN_USE, WRITING: IN_USE, READY: IN_USE, IN_USE: IN_USE},
    "take_ready": {FREE: r"^take_ready: slot 1 of pool 0 \(None\) is not held$", RESERVED: r"^take_ready: slot 1 of pool 0 \(None\) is not held$",
                   WRITING: r"^take_ready: slot 1 of pool 0 \(layer 0 expert 1\) is not held$",
                   READY: r"^take_ready: slot 1 of pool 0 \(layer 0 expert 1\) is not held$", IN_USE: IN_USE},
    "release": {FREE: "^release: slot 1 of pool 0 is released more often than held$",
                RESERVED: "^release: slot 1 of pool 0 is released more often than held$",
                WRITING: "^release: slot 1 of pool 0 is released more often than held$",
                READY: "^release: slot 1 of pool 0 is released more often than held$", IN_USE: WRITING},
    "evict": {FREE: FREE, RESERVED: "^evict: slot 1 of pool 0 is reserved by stream$", WRITING: FREE, READY: FREE, IN_USE: f"^evict: {HELD}$"},
    "reserve": {FREE: RESERVED, RESERVED: "^reserve by direct: slot 1 of pool 0 is reserved by stream$", WRITING: RESERVED,
                READY: RESERVED, IN_USE: f"^reserve by direct: {HELD}$"},
    "unreserve": {FREE: "^unreserve by stream: slot 1 of pool 0 is reserved by None$", RESERVED: FREE,
                  WRITING: "^unreserve by stream: slot 1 of pool 0 is reserved by None$",
                  READY: "^unreserve by stream: slot 1 of pool 0 is reserved by None$",
                  IN_USE: "^unreserve by stream: slot 1 of pool 0 is reserved by None$"},
}
CALLS = {
    "stage": lambda t: t.stage(B, 0, 1),
    "written": lambda t: t.written(0, [1], EV, STREAM),
    "hold": lambda t: t.hold(0, 1),
    "take_ready": lambda t: t.take_ready(0, 1),
    "release": lambda t: t.release(0, 1, None),
    "evict": lambda t: t.evict(0, 1),
    "reserve": lambda t: t.reserve(0, 1, "direct"),
    "unreserve": lambda t: t.unreserve(0, 1, "stream", None, keep=False),
}


@pytest.mark.parametrize("op", list(EDGES))
@pytest.mark.parametrize("state", list(SlotState))
def test_every_slot_transition_from_every_slot_state(state, op):
    t = in_state(state)
    want = EDGES[op][state]
    if not isinstance(want, SlotState):  # (a SlotState is a str too)
        before = snapshot(t)
        with pytest.raises(IllegalTransition, match=want):
            CALLS[op](t)
        assert snapshot(t) == before, "a refused transition changes nothing"
    else:
        got = CALLS[op](t)
        assert t.state(0, 1) is want
        if op in ("stage", "evict", "reserve"):  # the occupant that left, returned; it is in no slot now
            assert got == (A if state in (WRITING, READY) else None)
            if got is not None:
                assert t[A] == Residency(Home.CPU, 0)
        if op == "stage":
            assert t.occupant(0, 1) == B and t[B].slot == 1
        if op == "take_ready":
            assert got is not None and got[:2] == (EV, STREAM)
    t.check()


def test_unreserve_keeps_what_its_reserver_staged_or_empties_the_slot():
    """A streamed call's slots go back to the cache with what it staged into them (``keep``);
    direct decode's go back empty (only the device knew their contents)."""
    for keep in (True, False):
        t = in_state(SlotState.FREE)
        t.reserve(0, 1, "stream")
        refused(t, "^stage layer 0 expert 2: slot 1 of pool 0 is reserved by stream$", t.stage, B, 0, 1)
        refused(t, "^stage layer 0 expert 2: slot 1 of pool 0 is reserved by stream$", t.stage, B, 0, 1, by="direct")
        t.stage(B, 0, 1, by="stream")
        t.written(0, [1], EV, STREAM)
        t.hold(0, 1)
        refused(t, "^unreserve by stream: slot 1 of pool 0 is still held$", t.unreserve, 0, 1, "stream", None, keep=keep)
        t.take_ready(0, 1)
        last = object()
        t.release(0, 1, None)
        t.unreserve(0, 1, "stream", last, keep=keep)
        assert t.reserved(0, 1) is None and t.last_read(0, 1) is last
        assert (t.occupant(0, 1), t[B].slot, t.state(0, 1)) == ((B, 1, SlotState.READY) if keep else (None, None, SlotState.FREE))
        t.check()


def test_reserve_keeping_its_occupant_serves_it_where_it_is():
    t = in_state(SlotState.READY)
    assert t.reserve(0, 1, "stream", keep=True) is None
    assert t.reserved(0, 1) == "stream" and t.occupant(0, 1) == A and t[A].slot == 1
    refused(t, "^evict: slot 1 of pool 0 is reserved by stream$", t.evict, 0, 1)
    assert t.evict(0, 1, by="stream") == A and t.state(0, 1) is SlotState.RESERVED
    t.check()


# -- every home transition from every home --------------------------------------------------------
K = ExpertKey(0, 3)
HOMES = {"hot": Residency(Home.GPU), "cpu": Residency(Home.CPU, 4096), "nvme": Residency(Home.NVME)}
HOME_EDGES = {  # (transition, home) -> the residency after it, or the message fragment it is refused with
    "warm": {"hot": "^warm layer 0 expert 3: needs home nvme, not hot$", "cpu": "^warm layer 0 expert 3: needs home nvme, not cpu$",
             "nvme": Residency(Home.CPU, 8192)},
    "cool": {"hot": "^cool layer 0 expert 3: needs home cpu, not gpu$", "cpu": Residency(Home.NVME),
             "nvme": "^cool layer 0 expert 3: needs home cpu, not nvme$"},
    "move": {"hot": "^move layer 0 expert 3: needs home cpu, not gpu$", "cpu": Residency(Home.CPU, 8192),
             "nvme": "^move layer 0 expert 3: needs home cpu, not nvme$"},
}
HOME_CALLS = {"warm": lambda t: t.warm(K, 8192), "cool": lambda t: t.cool(K), "move": lambda t: t.move(K, 8192)}


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("home", list(HOMES))
@pytest.mark.parametrize("op", list(HOME_EDGES))
def test_every_home_transition_from_every_home(op, home, staged):
    """Only the rebalancer's transitions change a home; a staged expert keeps its slot through them."""
    t = Table({K: HOMES[home], ExpertKey(0, 0): Residency(Home.NVME)}, [3], {0: 0})
    if home == "hot":
        t.place_hot(K, 0, 0)
    elif staged:
        t.stage(K, 0, 2)
    want = HOME_EDGES[op][home]
    if isinstance(want, str):
        refused(t, want, HOME_CALLS[op], t)
        return
    version = t.homes_version
    HOME_CALLS[op](t)
    slot = 2 if staged else None
    assert t[K] == Residency(want.home, want.host_offset, slot, False)
    assert t.homes_version == version + 1 and t.warm_mask[t.grid.index(K)] == (want.home is Home.CPU)
    assert t.counts() == {"gpu": 0, "cpu": int(want.home is Home.CPU), "nvme": 2 - int(want.home is Home.CPU)}
    t.check()


def test_take_ready_refuses_a_write_whose_ready_event_is_not_issued_yet():
    """Inside the batch that queues a write, the slot has no ready event yet: a reader cannot be
    ordered after it, and is refused rather than handed nothing to wait on."""
    t = in_state(SlotState.FREE)
    t.stage(A, 0, 1)
    t.hold(0, 1)
    refused(t, r"^take_ready: slot 1 of pool 0 \(layer 0 expert 1\) has a write queued without its ready event yet", t.take_ready, 0, 1)
    t.written(0, [1], EV, STREAM)
    assert t.take_ready(0, 1)[:2] == (EV, STREAM)


def test_transitions_over_many_slots_equal_one_by_one_and_refuse_as_a_whole():
    """A streamed part's ``hold_many``, ``take_ready_many`` and ``release_many``: what ``hold``,
    ``take_ready`` and ``release`` do slot by slot, and, where one slot is refused, nothing at all."""
    C = ExpertKey(0, 3)
    t = Table({ExpertKey(0, 0): Residency(Home.GPU), A: Residency(Home.CPU, 0), B: Residency(Home.NVME), C: Residency(Home.NVME)},
              [4], {0: 0})
    t.place_hot(ExpertKey(0, 0), 0, 0)
    t.stage(A, 0, 1)
    t.stage(B, 0, 2)
    t.written(0, [1, 2], EV, STREAM)
    refused(t, "^hold: slot 3 of pool 0 is free$", t.hold_many, 0, [1, 2, 3])
    t.hold_many(0, [1, 2])
    assert list(t.readers(0)) == [0, 1, 1, 0]
    refused(t, "^release: slot 3 of pool 0 is released more often than held$", t.release_many, 0, [1, 2, 3], None)
    assert [w[:2] for w in t.take_ready_many(0, [1, 2])] == [(EV, STREAM)] * 2
    assert t.take_ready_many(0, [1, 2]) == [], "each pending write is taken once"
    last = object()
    t.release_many(0, [1, 2], last)
    assert list(t.readers(0)) == [0, 0, 0, 0] and t.last_read(0, 1) is t.last_read(0, 2) is last
    t.check()


def _part_of_two() -> Table:
    """Slot 1 holds A, written, unheld; slot 3 holds C, written and held (its write not yet waited on)."""
    C = ExpertKey(0, 3)
    t = Table({ExpertKey(0, 0): Residency(Home.GPU), A: Residency(Home.CPU, 0), C: Residency(Home.NVME)}, [4], {0: 0})
    t.place_hot(ExpertKey(0, 0), 0, 0)
    t.stage(A, 0, 1)
    t.stage(C, 0, 3)
    t.written(0, [1, 3], EV, STREAM)
    t.hold_many(0, [3])
    return t


def test_a_refused_take_ready_many_changes_nothing():
    t = _part_of_two()
    refused(t, r"^take_ready: slot 1 of pool 0 \(layer 0 expert 1\) is not held$", t.take_ready_many, 0, [3, 1])


def test_release_many_refuses_a_slot_released_more_often_than_held():
    t = _part_of_two()
    refused(t, "^release: slot 3 of pool 0 is released more often than held$", t.release_many, 0, [3, 3], None)
