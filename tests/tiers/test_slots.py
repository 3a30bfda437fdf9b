"""The slot rule through ``tiers.slots.Slots`` handle by handle: a slot is never rewritten while a reader may still use it.

It runs a CPU ``Manager`` over a packed tiny Mixtral with all three tiers in bf16 (so every served
expert must be bit-exact) on recording streams (``slots_helpers.build``), whose waits, records,
syncs and stream switches go into one ordered list, and every disk read too.

It drives ``Slots`` handle by handle (``acquire``, ``wait_all``, ``release_all``, ``drop``)
against a model of every slot (occupant, readers, pending write, last read, ring buffer) and
checks after each step the exact stream operations it queued, the table against the model, and
that every held slot still holds its own expert's weights. Layer calls are checked in
test_slots_layer_calls.py.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slots_helpers import Harness, World, assert_holds, build, fractions, load_world
from tier_fakes import index_of_record
from tiers.loader.layout import ExpertKey
from tiers.store.disk_store import DiskStore
from tiers.store.table import Home, IllegalTransition, SlotState


@pytest.fixture(scope="module")
def world(packed_factory, checkpoint_factory) -> World:
    """Every expert's bf16 weights, read through transformers from the source checkpoint (not the pack)."""
    return load_world(packed_factory, checkpoint_factory)


# =============================================================================================
# Slots handle by handle, against a model of every slot
# =============================================================================================
# op: ("acquire", layer, expert) | ("wait", i) | ("release", i) | ("drop", slot); i indexes the held handles
handle_ops = st.lists(
    st.one_of(
        st.tuples(st.just("acquire"), st.integers(0, 2), st.integers(0, 7)),
        st.tuples(st.just("wait"), st.integers(0, 15)),
        st.tuples(st.just("release"), st.integers(0, 15)),
        st.tuples(st.just("drop"), st.integers(0, 15)),
    ),
    max_size=50,
)


class SlotModel:
    """What every slot of the one pool should hold: occupant, readers, pending write, last read, ring buffer.

    Each op drives ``Slots`` once, checks the exact stream operations it queued and updates the
    model; ``step`` returns False where the op was skipped (no handle held, or no slot free), so
    there is nothing new to check against the table."""

    def __init__(self, h: Harness, truth: dict, n_hot: int):
        self.h, self.truth, self.n_hot = h, truth, n_hot
        mgr = h.mgr
        self.order, self.compute = h.rec.order, h.streams.compute
        self.table, self.slots, self.copy = mgr.table, mgr.slots, mgr.staging.copy_stream
        (self.pool,) = mgr.pools
        self.n, self.pi = self.pool.n_slots, self.pool.index
        self.base_ptr = {name: t.data_ptr() for name, t in self.pool.slabs.items()}
        self.owner = [self.table.occupant(self.pi, s) for s in range(self.n)]
        self.readers = [0] * self.n
        self.pending: list = [None] * self.n  # the ready event of a write no reader has waited on
        self.last: list = [None] * self.n  # what the next write into the slot waits on
        self.ring: list = [None] * self.n  # the ready event of the last disk write through the slot's ring buffer

    def step(self, op) -> bool:
        kind = op[0]
        if kind == "acquire":
            return self.acquire(ExpertKey(op[1], op[2]))
        if kind == "wait":
            return self.wait(op[1])
        if kind == "release":
            return self.release(op[1])
        return self.drop(op[1])

    def acquire(self, key: ExpertKey) -> bool:
        order, table, start = self.order, self.table, len(self.order)
        r = table[key]
        if r.slot is not None:  # a hit: hold it, nothing queued
            got = self.slots.acquire(key)
            assert got is not None and got.slot == r.slot and self.owner[r.slot] == key
            assert order[start:] == []
            self.readers[r.slot] += 1
            self.h.held.append(got)
            return True
        free = [s for s in self.pool.staging if self.readers[s] == 0]
        got = self.slots.acquire(key)
        if not free:
            assert got is None and order[start:] == [], "every staging slot held: no slot, nothing queued"
            assert table[key] == r
            return False
        s = got.slot
        assert s in free, f"{key} staged into slot {s}, held or hot"
        if any(self.owner[x] is None for x in free):
            assert self.owner[s] is None, "an empty slot is taken before an occupied one"
        self.staged(key, r.home, got, start)
        return True

    def staged(self, key: ExpertKey, home: Home, got, start: int) -> None:
        """A miss was given slot ``got.slot``: it queued exactly the expected writes, then its ready event."""
        s, order, copy = got.slot, self.order, self.copy
        expected = []
        if home is Home.NVME:  # read into the slot's ring buffer, once its last copy out ran
            if self.ring[s] is not None:
                expected.append(("sync", None, self.ring[s]))
            expected.append(("disk_read", None, key))
        if self.pending[s] is not None:  # a write nobody waited on: the next one waits on it instead
            self.last[s] = self.pending[s]
        if self.last[s] is not None:
            expected.append(("wait", copy, self.last[s]))  # before any byte lands: the old expert's last read
        expected.append(("use", copy, None))
        new = order[start:]
        assert len(new) == len(expected) + 1, f"{key} into slot {s}: {new}"
        for got_op, want in zip(new, expected):
            assert got_op[0] == want[0] and got_op[1] is want[1] and (got_op[2] is want[2] or got_op[2] == want[2]), (
                f"{key} into slot {s}: queued {new}, expected {expected} then the ready event")
        ready = new[-1]
        assert ready[0] == "record" and ready[1] is copy, "the ready event is recorded on the copy stream"
        assert self.table.ready_event(self.pi, s) is ready[2]
        if self.owner[s] is not None:
            assert self.table[self.owner[s]].slot is None, "the evicted expert left the GPU"
        self.owner[s], self.readers[s], self.pending[s] = key, 1, ready[2]
        if home is Home.NVME:
            self.ring[s] = ready[2]
        self.h.held.append(got)

    def wait(self, i: int) -> bool:
        held, order, start = self.h.held, self.order, len(self.order)
        if not held:
            return False
        got = held[i % len(held)]
        self.slots.wait_all([got])
        if self.pending[got.slot] is not None:
            assert order[start:] == [("wait", self.compute, self.pending[got.slot])]
            self.pending[got.slot] = None
        else:
            assert order[start:] == [], "nothing pending: no wait"
        assert self.table.ready_event(self.pi, got.slot) is None
        return True

    def release(self, i: int) -> bool:
        held, start = self.h.held, len(self.order)
        if not held:
            return False
        got = held.pop(i % len(held))
        self.slots.release_all([got])
        self.readers[got.slot] -= 1
        new = self.order[start:]
        if got.slot < self.n_hot:
            assert new == [] and self.table.last_read(self.pi, got.slot) is None, "a hot slot's reader records no last-read"
        else:
            assert len(new) == 1 and new[0][0] == "record" and new[0][1] is self.compute, new
            self.last[got.slot] = new[0][2]
        return True

    def drop(self, i: int) -> bool:
        table, pi, n, start = self.table, self.pi, self.n, len(self.order)
        s = i % n
        before = [table.slot(pi, x) for x in range(n)]
        if self.readers[s] or s < self.n_hot:
            why = "is held by" if self.readers[s] else "hot experts are never evicted"
            with pytest.raises(IllegalTransition, match=why):
                self.slots.drop(self.pool, s)
            assert [table.slot(pi, x) for x in range(n)] == before, "a refused drop changes nothing"
        else:
            self.slots.drop(self.pool, s)
            if self.owner[s] is not None:
                assert table[self.owner[s]].slot is None
            self.owner[s] = None
            if self.pending[s] is not None:
                self.last[s], self.pending[s] = self.pending[s], None
        assert self.order[start:] == [], "a drop queues nothing"
        return True

    def check(self) -> None:
        """After every op: the table agrees with the model, and every held slot still holds its owner's bytes."""
        table, pi, owner, readers, pending = self.table, self.pi, self.owner, self.readers, self.pending
        table.check()
        assert list(table.readers(pi)) == readers
        assert [table.occupant(pi, s) for s in range(self.n)] == owner
        assert [table.ready_event(pi, s) for s in range(self.n)] == pending
        for s in range(self.n):
            assert table.last_read(pi, s) is self.last[s]
            if owner[s] is not None:
                assert table[owner[s]].slot == s
                state = table.state(pi, s)
                assert state is (SlotState.IN_USE if readers[s] else SlotState.WRITING if pending[s] else SlotState.READY), state
            if readers[s]:
                assert_holds(self.pool.tensors(s), self.truth[owner[s]], f"held slot {s} ({owner[s]})")
        # static buffers: a slot's address never changes
        assert {name: t.data_ptr() for name, t in self.pool.slabs.items()} == self.base_ptr


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(staging=st.integers(1, 6), n_hot=st.integers(1, 4), n_warm=st.integers(1, 6), ops=handle_ops)
def test_slots_never_rewrite_a_held_slot(world, staging, n_hot, n_warm, ops):
    manifest, truth = world.manifest, world.truth
    h = build(manifest, staging, *fractions(manifest, staging, n_hot, n_warm))
    mgr, table = h.mgr, h.mgr.table
    try:
        (pool,) = mgr.pools  # every layer has the same signature: one pool
        assert (pool.n_slots, pool.hot) == (n_hot + staging, n_hot)
        assert pool.nbytes == pool.n_slots * manifest.layers[0].layout.nbytes()
        model = SlotModel(h, truth, n_hot)
        n = pool.n_slots
        assert [k is not None for k in model.owner] == [s < n_hot for s in range(n)], "hot experts fill the first slots, staging starts empty"
        for op in ops:
            if model.step(op):
                model.check()
        mgr.slots.release_all(h.held)
        assert all(r == 0 for r in table.readers(pool.index))
    finally:
        mgr.close()


def test_a_slot_is_rewritten_only_after_its_readers_released_it(world):
    """Two readers of one staging slot: a drop is refused while either holds it, and the rewrite
    then waits on the last-read event of the last release."""
    manifest = world.manifest
    h = build(manifest, 1, *fractions(manifest, 1, 1, 4))
    mgr, order, copy = h.mgr, h.rec.order, h.mgr.staging.copy_stream
    slots, table = mgr.slots, mgr.table
    try:
        (pool,) = mgr.pools
        warm = [k for k in mgr.placement.warm if k.layer == 1]
        a, b = slots.acquire(warm[0]), slots.acquire(warm[0])
        assert a.slot == b.slot == pool.hot and table.readers(pool.index)[a.slot] == 2
        slots.wait_all([a, b])
        assert slots.acquire(warm[1]) is None, "the only staging slot is held"
        with pytest.raises(IllegalTransition, match=rf"evict: slot {a.slot} of pool 0 \({warm[0]}\) is held by 2 reader\(s\)"):
            slots.drop(pool, a.slot)
        slots.release_all([a])
        with pytest.raises(IllegalTransition, match="is held by 1 reader"):  # one reader left
            slots.drop(pool, a.slot)
        slots.release_all([b])
        last = table.last_read(pool.index, a.slot)
        assert order[index_of_record(order, last)][1] is h.streams.compute
        n = len(order)
        c = slots.acquire(warm[1])
        assert c.slot == a.slot and order[n] == ("wait", copy, last)
        slots.release_all([c])
        with pytest.raises(IllegalTransition, match=rf"release: slot {c.slot} of pool 0 is released more often than held"):
            table.release(pool.index, c.slot, None)
    finally:
        mgr.close()



def test_truth_matches_pack(world):
    """The oracle (transformers) and the packed bf16 blobs agree, so a mismatch above is the slots'."""
    manifest, truth = world.manifest, world.truth
    disk = DiskStore(manifest, ["bf16"])
    try:
        for k in manifest.keys:
            ref = manifest.ref(k, "bf16")
            buf = torch.empty(ref.nbytes, dtype=torch.uint8)
            disk.read(k, "bf16", buf)
            out = {n: torch.empty_like(t) for n, t in truth[k].items()}
            manifest.blob(k, "bf16").dequantize_into(buf, out)
            for n in out:
                assert torch.equal(out[n], truth[k][n]), f"{k} {n}"
    finally:
        disk.close()
