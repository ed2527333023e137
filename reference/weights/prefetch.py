"""Layer L+1's weights produced while layer L computes (issue #14).

A layer-major run asks for layers in order, and producing one — generating synthetic weights (~1.3 s per Flash
layer on an H200) or reading a checkpoint's shards — needs nothing from the layer before. `PrefetchingSource`
wraps any `WeightSource`: when layer L is asked for, it starts layer L+1 in a worker thread (on CUDA, on a side
stream, so its kernels fill the gaps the compute stream leaves) and hands it over when L+1 is asked for. Values are
those of the wrapped source, bit for bit: synthetic weights are a pure function of (seed, layer, name), and a
checkpoint's bytes are what they are. At most two layers are resident: the one in use and the next.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from reference.quant import QuantizedTensor
from reference.streams import private_stream
from reference.weights.source import TensorBundle, WeightSource


def _tensors(bundle: TensorBundle) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for t in bundle.tensors.values():
        if isinstance(t, QuantizedTensor):
            out += [x for x in (t.codes, t.scale, t.global_scale, t.input_scale) if x is not None]
        else:
            out.append(t)
    return out


class PrefetchingSource:
    """A `WeightSource` that produces layer L+1 in the background once layer L has been asked for."""

    def __init__(self, source: WeightSource) -> None:
        self.source, self.config = source, source.config
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-prefetch")
        self._pending: tuple[int, torch.device, Future] | None = None
        self._top: dict[torch.device, TensorBundle] = {}
        self.until = source.config.num_hidden_layers
        """Layers past this one are not prefetched (a partial pass that stops early makes no layer it won't use)."""

    def describe(self) -> dict[str, object]:
        return self.source.describe()

    def top_level(self, device: torch.device | str = "cpu") -> TensorBundle:
        """Made once per device and shared by every stack that asks (the LM head alone is 1 GB at Flash width)."""
        device = torch.device(device)
        if device not in self._top:
            self._top[device] = self.source.top_level(device)
        return self._top[device]

    def embed_rows(self, token_ids: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
        return self.source.embed_rows(token_ids, device)

    def __getattr__(self, name: str):  # what a particular source offers beyond the protocol (token_codes, …)
        return getattr(self.source, name)

    def layer(self, layer: int, device: torch.device | str = "cpu") -> TensorBundle:
        device = torch.device(device)
        pending, self._pending = self._pending, None
        if pending is not None and pending[:2] == (layer, device):
            bundle, done = pending[2].result()
        else:
            if pending is not None:  # asked out of order: the prefetched layer is not wanted
                pending[2].result()
            bundle, done = self._produce(layer, device)
        if done is not None:  # the compute stream waits for the side stream's kernels, and keeps the memory alive
            stream = torch.cuda.current_stream(device)
            stream.wait_event(done)
            for t in _tensors(bundle):
                t.record_stream(stream)
        if layer + 1 < self.until:
            self._pending = (layer + 1, device, self._pool.submit(self._produce, layer + 1, device))
        return bundle

    def _produce(self, layer: int, device: torch.device) -> tuple[TensorBundle, torch.cuda.Event | None]:
        """The layer's tensors, and on CUDA the event that marks them written (they are made on the prefetcher's own
        side stream: a pool stream drawn per layer was at times the one a CUDA graph was being captured on, which
        then recorded the weights' kernels instead of running them — reference.streams)."""
        if device.type != "cuda":
            return self.source.layer(layer, device), None
        side = private_stream(device, "weights")
        with torch.cuda.stream(side):
            bundle = self.source.layer(layer, device)
            done = torch.cuda.Event()
            done.record(side)
        return bundle, done
