"""Small fixed-shape pure functions replayed as CUDA graphs (issue #14): the decode steps' launch overhead.

An execution helper, not math: it lives in `reference/` so that both sides may use it (DESIGN §2: the optimized
engine may import the reference, never the reverse). The reference replays one function, the Sinkhorn of its
mHC (~120 kernels, two calls per decode step, in the reference and twice more in the yardstick).

A decode step of the engine is host-bound on a GPU: ~1,500 small kernels per step, and half of them come from
a few pure functions called with the same shapes at every step — the mHC mix (20 Sinkhorn iterations, ~120
kernels, six calls a step with the site twins) and the FP8 activation quantizer (~17 kernels, ~15 calls a step).
Measured on an H200 (Flash, 30K-token CSA layer): 44 ms per base decode step with probes, 0.7 of its 2.8 s in
these two. `replay(fn, *tensors, **static)` captures `fn` once per (input shapes, strides, dtypes, static
arguments) and replays the graph afterwards: one launch instead of many.

Same numbers: a replay runs the kernels the eager call would launch, on inputs of the same shapes and strides
(the static inputs copy the caller's layout), so the results are the eager call's bit for bit — checked by
tests/test_gpu_engine.py. The CPU never replays (nothing changes there), and neither do large inputs (prefill
chunks: their kernels are long enough that launching them costs nothing, and a graph would pin their memory). What
is small is the inputs' total (MAX_ELEMENTS), or a cap a caller gives for its function (`max_elements`): the
Sinkhorn takes 16 elements per token and its kernels stay shorter than their launches, so it replays for prefill
chunks of up to 16,384 tokens (reference.ops.mhc.SINKHORN_GRAPH_ELEMENTS) — one graph per distinct length
(MAX_GRAPHS_PER_FUNCTION caps them). A function being made into a graph may call replay itself (the engine's mHC mix
calls it for its Sinkhorn): inside the making, that call runs eagerly and its kernels join the outer graph.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch

from reference.streams import private_stream

MAX_ELEMENTS = 1 << 16
"""Inputs larger than this (in total) run eagerly. Decode inputs are ≤ 16K elements at Flash width (streams
[1, 4, 4096]); a prefill chunk's are ≥ 8192 rows × 4 × 4096."""

ENABLED = True
"""Switch for tests that compare the replayed and the eager path."""

_graphs: dict[tuple, "_Graph | None"] = {}  # None: capture failed for this key, run it eagerly
_lock = threading.Lock()

MAX_GRAPHS_PER_FUNCTION = 64
"""Keys (shapes × static arguments) a function is captured for; calls with further keys run eagerly, and the first
keys keep their graphs (nothing is evicted). A static argument that takes many values (a checkpoint's per-expert
NVFP4 input scales) would otherwise hold a graph and its private memory pool for each; the decode steps' shapes are
a handful per function, and the Sinkhorn's prefill passes (up to 16,384 tokens) a few dozen lengths per run. A
graph's memory was not measured; the caching allocator reserves small blocks in 2 MiB segments, so 64 graphs of a
small function may hold ~128 MiB, and a Sinkhorn graph of a 16,384-token chunk holds its live intermediates (1 MiB
each) as well."""
_graphs_of: dict[Callable[..., Any], int] = {}

_making = threading.local()
"""`active` while this thread makes a graph (its warm-up call and its capture): a replay called from inside the
function being made runs eagerly — inside the capture its kernels become the outer graph's — instead of waiting for
_lock, which this thread holds (a plain lock: it would wait forever)."""


OUTPUT_ALIGN = 512
"""Byte alignment of each output in a replay's packed copy: the caching allocator's block size, so an output's
address is aligned as its own clone's was."""

Layout = list[tuple[int, int, torch.dtype, torch.Size]]
"""Where each tensor lies in a byte buffer: (index among the tensors, byte offset, dtype, shape)."""


def _packable(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Indices of the tensors that can travel as bytes in one buffer: contiguous, of the first one's device."""
    return [i for i, t in enumerate(tensors) if t.is_contiguous() and t.device == tensors[0].device]


def packs_outputs(outputs: Any) -> bool:
    """Whether a replay copies these outputs out as one packed buffer (several, all contiguous on one device) rather
    than one by one. bench/launch_count.py counts a replay's copies by the same rule."""
    return not isinstance(outputs, torch.Tensor) and len(outputs) > 1 and len(_packable(outputs)) == len(outputs)


def _pack(tensors: Sequence[torch.Tensor], which: list[int], align: int = 1) -> tuple[torch.Tensor, Layout]:
    """One uint8 buffer holding the bytes of tensors[i] for i in `which` (one cat: one launch), widest element
    first so that every tensor starts at a multiple of its element size and can be viewed back in its dtype;
    `align` > 1 also starts each at a multiple of `align` bytes (unused bytes between them)."""
    order = sorted(which, key=lambda i: -tensors[i].element_size())
    layout, parts, offset = [], [], 0
    for i in order:
        t = tensors[i]
        pad = -offset % align
        if pad:
            parts.append(torch.empty(pad, dtype=torch.uint8, device=t.device))
            offset += pad
        parts.append(t.detach().reshape(-1).view(torch.uint8))
        layout.append((i, offset, t.dtype, t.shape))
        offset += parts[-1].numel()
    return torch.cat(parts), layout


def _unpack(buffer: torch.Tensor, layout: Layout, out: list[Any]) -> None:
    for i, offset, dtype, shape in layout:
        out[i] = buffer[offset:offset + shape.numel() * dtype.itemsize].view(dtype).view(shape)


def clone_together(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """clone() of each tensor (detached), made by one copy per dtype where it can be: the contiguous tensors of one
    dtype and device are joined by one cat and handed back as views of it (a copy: clone()'s bits); any other is
    cloned by itself. A probe keeps a decode step's tap fields this way (harness.run.probes).

    Why per dtype and not all as bytes in one buffer (_pack, which a graph replay's outputs still use): on an H100's
    host, six fields of a decode tap (an int64, four fp32, an int32) took 94 µs as bytes (two views to bytes and
    three back per tensor cost more than the launches they save), 49 µs per dtype and 61 µs one clone each (best of
    5 × 2,000 calls, inference mode, thirty-third session); a probe clones ~14 emissions per decode step and stack."""
    out: list[Any] = [None] * len(tensors)
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.is_contiguous():
            groups.setdefault((t.dtype, t.device), []).append(i)
    for members in groups.values():
        if len(members) > 1:
            parts = [tensors[i].detach() if tensors[i].requires_grad else tensors[i] for i in members]
            joined = torch.cat([p.reshape(-1) for p in parts])
            for i, part, piece in zip(members, parts, joined.split([p.numel() for p in parts])):
                out[i] = piece.view(part.shape)
    return [o if o is not None else t.detach().clone() for o, t in zip(out, tensors)]


class _Graph:
    """One captured call: its static inputs (written before each replay) and outputs (copied after it). Several
    contiguous outputs are also packed as bytes into one buffer inside the graph, so a replay copies them out with
    one launch instead of one per output (hc_mix: four)."""

    def __init__(self, fn: Callable[..., Any], tensors: tuple[torch.Tensor, ...], static: dict[str, Any]) -> None:
        self.lock = threading.Lock()
        with torch.inference_mode(False):  # written in place at every replay, inside inference mode or not
            self.inputs = [torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
                           for t in tensors]
        for dst, src in zip(self.inputs, tensors):
            dst.copy_(src)
        # the capture's own stream, on which no other thread of ours queues work (reference.streams: pool streams alias)
        side = private_stream(tensors[0].device, "capture")
        side.wait_stream(torch.cuda.current_stream(tensors[0].device))
        # warm-up off the capture (library handles, lazy init, this stream's cuBLAS workspace)
        with torch.cuda.stream(side):
            fn(*self.inputs, **static)
        torch.cuda.current_stream(tensors[0].device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the weight prefetcher's thread keeps working on its own stream during the capture
        self.packed: tuple[torch.Tensor, Layout] | None = None
        with torch.cuda.graph(self.graph, stream=side, capture_error_mode="thread_local"):
            self.outputs = fn(*self.inputs, **static)
            if packs_outputs(self.outputs):
                # each output where the caching allocator would have put its clone (512-byte blocks): a kernel that
                # picks its algorithm by its operands' alignment (cuBLAS, vectorised loads) picks the same one
                self.packed = _pack(self.outputs, list(range(len(self.outputs))), align=OUTPUT_ALIGN)

    def __call__(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        # one caller at a time from copying in to copying out: the buffers are shared, and two host threads
        # (harness.run.host_lanes) queue on one stream, which then runs each caller's three steps together
        with self.lock:
            for dst, src in zip(self.inputs, tensors):
                dst.copy_(src)
            self.graph.replay()
            if isinstance(self.outputs, torch.Tensor):
                return self.outputs.clone()
            if self.packed is not None:
                out: list[Any] = [None] * len(self.outputs)
                _unpack(self.packed[0].clone(), self.packed[1], out)
                return type(self.outputs)(out)
            return type(self.outputs)(o.clone() for o in self.outputs)


def clear() -> None:
    """Forget every captured graph (tests that count captures start from none)."""
    with _lock:
        _graphs.clear()
        _graphs_of.clear()


def small_enough(tensors: tuple[torch.Tensor, ...], max_elements: int = MAX_ELEMENTS) -> bool:
    """Inputs a graph replays: at most max_elements in total, the first not empty (an empty input launches nothing:
    no graph to make). bench/launch_count.py counts replays by the same rule."""
    return 0 < sum(t.numel() for t in tensors) <= max_elements and tensors[0].numel() > 0


def on_current_gpu(t: torch.Tensor) -> bool:
    """Whether `t` lies on the current CUDA device: a capture and its memory pool use the current device."""
    return t.device.type == "cuda" and t.device.index == torch.cuda.current_device()


def replay(fn: Callable[..., Any], *tensors: torch.Tensor, max_elements: int = MAX_ELEMENTS, **static: Any) -> Any:
    """fn(*tensors, **static), from a CUDA graph when the tensors are small and on a GPU. `fn` must be pure: its
    result a tensor or a tuple of tensors depending only on `tensors` and on `static` (hashable, fixed per graph),
    with no host synchronisation inside. `max_elements`: what is small for `fn` (MAX_ELEMENTS unless its kernels
    stay shorter than their launches at larger inputs: reference.ops.mhc.SINKHORN_GRAPH_ELEMENTS)."""
    if (not ENABLED or not on_current_gpu(tensors[0]) or not small_enough(tensors, max_elements)
            or getattr(_making, "active", False) or torch.cuda.is_current_stream_capturing()):
        return fn(*tensors, **static)
    key = (fn, tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors), tuple(sorted(static.items())))
    graph = _graphs.get(key, False)
    if graph is False:
        with _lock:
            graph = _graphs.get(key, False)  # another thread may have captured it meanwhile
            if graph is False:
                if _graphs_of.get(fn, 0) >= MAX_GRAPHS_PER_FUNCTION:
                    graph = None  # eager from now on: the key is remembered, the lock not taken again for it
                else:
                    _making.active = True
                    try:
                        graph = _Graph(fn, tensors, static)
                        _graphs_of[fn] = _graphs_of.get(fn, 0) + 1
                    except RuntimeError:  # not capturable after all: this key runs eagerly from now on
                        graph = None
                    finally:
                        _making.active = False
                _graphs[key] = graph
    return fn(*tensors, **static) if graph is None else graph(tensors)
