"""reference.streams: the CUDA graph capture and the weight prefetcher each have a stream no one else queues on.

torch's pool hands out 32 streams per device round-robin, so a stream drawn per layer by the prefetcher was at times
the stream a graph was being captured on: the layer's weights were recorded into the graph instead of computed (two
ranks sharing one GPU crashed from 7447e92 on). The pool's arithmetic is tested here on any machine; the GPU tests
build the collision the old code hit and check that the weights come out right."""

from __future__ import annotations

import itertools

import pytest
import torch

from reference.streams import POOL_SIZE, distinct_draw


class RoundRobinPool:
    """torch's stream pool as far as a drawer sees it: POOL_SIZE handles, handed out in turn."""

    def __init__(self) -> None:
        self.next = itertools.cycle(range(POOL_SIZE)).__next__


def test_a_draw_skips_the_streams_other_roles_hold():
    pool = RoundRobinPool()
    assert distinct_draw(pool.next, lambda s: s, taken=set()) == 0
    assert distinct_draw(pool.next, lambda s: s, taken={1, 2}) == 3  # 1 and 2 are drawn and passed over
    # the draw that 32 draws later returns a held stream again (what the old per-layer draw ran into) is passed over
    for _ in range(POOL_SIZE - 4):
        pool.next()
    assert distinct_draw(pool.next, lambda s: s, taken={0}) == 1


def test_a_pool_whose_every_stream_is_held_is_an_error_not_a_shared_stream():
    with pytest.raises(RuntimeError, match="no stream outside the 32 already taken"):
        distinct_draw(RoundRobinPool().next, lambda s: s, taken=set(range(POOL_SIZE)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_each_role_keeps_one_stream_and_a_role_drawn_onto_another_roles_stream_draws_again(monkeypatch):
    """The second role's first draw is set up to be the first role's stream (31 pool draws after it): it is passed
    over. And a role's stream is the same object at every call, "cuda" and "cuda:0" alike."""
    from reference import streams

    monkeypatch.setattr(streams, "_streams", {})  # no role drawn yet in this process
    capture = streams.private_stream("cuda", "capture")
    for _ in range(POOL_SIZE - 1):  # other code drawing pool streams: the next draw is the capture stream again
        torch.cuda.Stream()
    weights = streams.private_stream("cuda", "weights")
    assert weights.cuda_stream != capture.cuda_stream
    assert streams.private_stream("cuda", "capture") is capture
    assert streams.private_stream(torch.device("cuda", torch.cuda.current_device()), "capture") is capture


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_weights_prefetched_while_a_graph_is_captured_are_computed_not_captured():
    """The collision the old code ran into, built on purpose: the pool's next stream is the capture stream, and the
    prefetcher makes a layer while a graph is being captured on it. Its weights must equal the source's, bit for
    bit. The old prefetcher's kernels were recorded into the graph, and its host-to-device copy failed inside the
    capture (an error here, as in the crashed runs)."""
    from reference.config import TINY
    from reference.streams import private_stream
    from reference.weights.prefetch import PrefetchingSource
    from reference.weights.synthetic import SyntheticWeights

    capture = private_stream("cuda", "capture")
    for _ in range(POOL_SIZE):  # draw up to the capture stream: the draw after the next 31 is it again
        if torch.cuda.Stream().cuda_stream == capture.cuda_stream:
            break
    else:
        pytest.fail("the capture stream is not in torch's pool of 32")
    for _ in range(POOL_SIZE - 1):
        torch.cuda.Stream()
    source = SyntheticWeights(TINY, 0)
    prefetching = PrefetchingSource(source)
    graph, x = torch.cuda.CUDAGraph(), torch.ones(4, device="cuda")
    with torch.cuda.graph(graph, stream=capture, capture_error_mode="thread_local"):
        y = x * 2  # the graph's own work (an empty graph draws a warning)
        bundle, done = prefetching._pool.submit(prefetching._produce, 1, torch.device("cuda")).result()  # noqa: SLF001
    done.synchronize()
    expected = source.layer(1, "cuda")
    for name in expected.names():  # before any replay: a replay would run kernels the capture took from the worker
        got, want = bundle.stored(name), expected.stored(name)
        pairs = [(got, want)] if isinstance(want, torch.Tensor) else \
            [(got.codes.view(torch.uint8), want.codes.view(torch.uint8)), (got.scale, want.scale)]
        for a, b in pairs:
            assert torch.equal(a, b), f"{name}: the prefetched weights differ from the source's"
    graph.replay()
    assert torch.equal(y, x * 2)
