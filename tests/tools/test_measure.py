"""tools/measure.py: expert bytes, timing helpers, interleaved decode and thread usage."""
from __future__ import annotations

import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def test_expert_bytes_counts_the_3d_parameters_only():
    import torch

    from tiers.tools.measure import expert_bytes_of

    model = torch.nn.Module()
    model.experts = torch.nn.Parameter(torch.zeros(4, 3, 2, dtype=torch.bfloat16))
    model.norm = torch.nn.Parameter(torch.zeros(5))
    assert expert_bytes_of(model) == 4 * 3 * 2 * 2


class _Owner:
    def step(self, x, first=False):
        return x + 1


def test_steps_time_calls_and_restore_owners():
    from tiers.tools.measure import Steps

    steps = Steps()
    inst = _Owner()
    steps.wrap(inst, "step", "inst")  # an instance: the wrapper shadows the class's method
    steps.wrap(_Owner, "step", "cls")  # a class attribute: replaced, then put back
    assert inst.step(1) == 2 and _Owner().step(2) == 3
    assert set(steps.ms) == {"inst", "cls"} and all(v >= 0 for v in steps.ms.values())
    assert steps.calls == {"inst": 1, "cls": 1}
    steps.restore()
    assert "step" not in vars(inst), "the instance kept its wrapper"
    assert _Owner.step.__name__ == "step" and _Owner().step(5) == 6


def test_steps_label_each_call_by_split_and_clear_keeps_the_wrappers():
    from tiers.tools.measure import Steps

    obj = _Owner()
    steps = Steps()
    steps.wrap(obj, "step", "unused", split=lambda a, k: "first" if k.get("first") else "other")
    assert obj.step(1) == 2 and obj.step(2, first=True) == 3 and obj.step(3) == 4
    assert steps.calls == {"other": 2, "first": 1} and all(v >= 0 for v in steps.ms.values())
    steps.clear()
    assert not steps.calls and not steps.ms
    obj.step(4)
    assert steps.calls == {"other": 1}
    steps.restore()
    assert "step" not in vars(obj) and obj.step(5) == 6


def test_interleaved_decode_takes_turns_and_decodes_as_generate():
    """Two models step in turn, the order alternating step by step; each decodes greedily what its
    own generate would (the inputs of its decode steps are generate's tokens); ``on_start`` comes
    after the untimed steps; one time per timed step and model."""
    import torch

    from tiers.tools.measure import TINY, block_means, build, interleaved_decode

    a, b = build("qwen3_moe", TINY["qwen3_moe"], torch.device("cpu"), seed=0), build("qwen3_moe", TINY["qwen3_moe"], torch.device("cpu"), seed=1)
    prompt = torch.randint(0, 512, (1, 7), generator=torch.Generator().manual_seed(3))
    skip, steps = 2, 5
    calls: list[tuple[str, list[int]]] = []
    handles = [m.register_forward_pre_hook(lambda mod, args, kw, who=who: calls.append((who, kw["input_ids"][0].tolist())), with_kwargs=True)
               for who, m in (("a", a), ("b", b))]
    started: list[int] = []
    times = interleaved_decode([a, b], prompt, steps, torch.device("cpu"), skip=skip, on_start=lambda: started.append(len(calls)))
    for h in handles:
        h.remove()
    assert [who for who, _ in calls] == ["a", "b"] + ["a", "b", "b", "a"] * 3 + ["a", "b"]  # prefills, then alternating turns
    assert started == [2 + 2 * skip]
    assert [len(t) for t in times] == [steps, steps] and min(times[0] + times[1]) > 0
    for who, m in (("a", a), ("b", b)):
        fed = [ids for w, ids in calls if w == who]
        assert fed[0] == prompt[0].tolist() and all(len(ids) == 1 for ids in fed[1:])
        gen = m.generate(prompt, max_new_tokens=skip + steps, min_new_tokens=skip + steps, do_sample=False, pad_token_id=0)
        assert [ids[0] for ids in fed[1:]] == gen[0, prompt.shape[1]:].tolist(), who
    assert block_means([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [1.5, 3.5] and block_means([1.0], 2) == []
    usage: list[list[dict]] = [[], []]
    times = interleaved_decode([a, b], prompt, steps, torch.device("cpu"), skip=skip, usage=usage)
    for t, u in zip(times, usage):  # each timed step's host work, up to the forward's return
        assert len(u) == steps and all(set(x) == {"host_ms", "cpu_ms", "sys_ms", "faults", "preempted"} for x in u)
        assert all(0 < x["host_ms"] <= s * 1e3 and x["sys_ms"] >= 0 for x, s in zip(u, t))
        # one thread's CPU time within a step is at most the step's wall time (its two reads aside)
        assert all(0 < x["cpu_ms"] <= x["host_ms"] + 1.0 for x in u)


def test_thread_usage_counts_this_threads_work_not_its_waits():
    """Work is measured by the process's CPU clock, not the wall clock: on a loaded machine a thread
    spinning for 150 ms of wall time may get only part of it on a core."""
    import threading

    from tiers.tools.measure import thread_usage

    def spin(seconds: float) -> None:  # until the process has spent `seconds` of CPU time
        stop, give_up = time.process_time() + seconds, time.perf_counter() + 30
        while time.process_time() < stop and time.perf_counter() < give_up:
            pass

    c0 = thread_usage()[0]
    time.sleep(0.15)
    slept = thread_usage()[0] - c0
    c0 = thread_usage()[0]
    spin(0.15)
    spun = thread_usage()[0] - c0
    c0 = thread_usage()[0]
    t = threading.Thread(target=spin, args=(0.15,))
    t.start()
    t.join()
    other = thread_usage()[0] - c0
    assert slept < 0.05 and spun >= 0.1 and other < 0.05


def test_thread_usage_takes_cpu_time_from_the_threads_cpu_clock(monkeypatch):
    """The CPU seconds are the thread's CPU clock's, not rusage's, whose times some hosts count in
    4 ms ticks (a decode step's CPU time would read 0, 4 or 8 ms)."""
    from tiers.tools.measure import thread_usage

    monkeypatch.setattr(time, "thread_time", lambda: 1234.5)
    assert thread_usage()[0] == 1234.5
