"""Step graphs' length counters (``tiers.graphs.step_graphs.set_lengths``): every tensor counter
of the cache's layers set to the step's position, and in a captured graph to the position of each
replay."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tiers.graphs.step_graphs import set_lengths
from conftest import devices


def _cache(device: torch.device) -> SimpleNamespace:
    """Layers as transformers' caches have them: tensor counters of two shapes, an int counter, none."""
    return SimpleNamespace(layers=[SimpleNamespace(cumulative_length=torch.full((1,), 3, dtype=torch.int64, device=device)),
                                   SimpleNamespace(cumulative_length=5), SimpleNamespace(),
                                   SimpleNamespace(cumulative_length=torch.zeros((), dtype=torch.int64, device=device))])


@pytest.mark.parametrize("device", devices())
def test_every_tensor_counter_takes_the_position_and_nothing_else_changes(device):
    cache = _cache(torch.device(device))
    set_lengths(cache, torch.tensor([9], device=device))
    first, plain, bare, scalar = cache.layers
    assert first.cumulative_length.tolist() == [9] and scalar.cumulative_length.item() == 9
    assert plain.cumulative_length == 5 and not hasattr(bare, "cumulative_length")
    set_lengths(SimpleNamespace(layers=[SimpleNamespace()]), torch.tensor([1], device=device))  # no counter: nothing to do


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_captured_step_sets_the_counters_to_each_replays_position():
    cache, position = _cache(torch.device("cuda")), torch.tensor([4], device="cuda")
    set_lengths(cache, position)  # warm-up outside the capture
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin()
        set_lengths(cache, position)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    position.fill_(11)
    graph.replay()
    torch.cuda.synchronize()
    assert cache.layers[0].cumulative_length.tolist() == [11] and cache.layers[3].cumulative_length.item() == 11
