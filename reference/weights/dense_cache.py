"""Exactly dequantized fp32 copies of a layer's stored weights, made once and shared by every stack (issue #14).

The reference, the yardstick and every optimized variant compute with the same fp32 master values (the exact
dequantization of the stored FP8/FP4 bits; the kernels read those bits, the emulation multiplies the dequantized
values, which is the same arithmetic). A layer-major run can dequantize each tensor once per layer and hand the
same copy to all of them, instead of once per stack, prefill chunk and decode step: a Flash layer's 768 expert
matrices were dequantized ~10,000 times per layer through the runner (measured on an H200 at 30K tokens).
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable, Sequence

import torch

from reference.config import ModelConfig
from reference.quant import STACKABLE_FORMATS, QuantizedTensor, dequantize_stack
from reference.weights.schema import TensorSpec, layer_specs

Stored = torch.Tensor | QuantizedTensor

CPU_BUDGET_BYTES = 4 << 30
"""On the CPU: a Flash layer's attention, indexer and shared-expert weights (< 1 GB in fp32) with room for the
experts used most; the small presets' layers fit whole (flash-mini's experts: 1.5 MB)."""

DEVICE_BUDGET_FRACTION = 0.35
"""On a GPU: this share of the device's memory (52.5 GB of an H200, which torch reports as 150.1 GB; 29.9 GB of an
H100 80GB). A Flash layer's tensors are 26.4 GB in fp32, 25.8 GB of them experts (256·3·2048·4096·4 B), so both
GPUs hold a layer whole. The NVFP4 forms (nvfp4-experts) are derived from these copies (optimized.base_ops.
prepare_nvfp4_forms: two numbers per matrix) and kept on use while there is room; a 25.8 GB second copy of every
expert is never needed, and a checkpoint's own NVFP4 form is its fp32 copy. harness.run.host_lanes runs a second
host thread while a layer's copies fit whole (both GPUs), whatever room the forms find."""


class DenseCache:
    """fp32 values of stored tensors by name, kept up to `budget_bytes` (past it, a tensor is dequantized on every
    use instead: cheap next to the GEMM that uses it); beside them, within the same budget, what is derived from them
    once per layer: bf16 stacks of exact copies (bf16_stack), rounded weights and NVFP4 factors (optimized.base_ops)."""

    def __init__(self, budget_bytes: int = CPU_BUDGET_BYTES) -> None:
        self._cache: dict[str, torch.Tensor] = {}
        self._bf16_exact: dict[str, bool] = {}  # per name asked: whether every value of its cached tensor is a bf16
        self._bf16_stacks: dict[tuple[str, ...], torch.Tensor] = {}  # bf16_stack's, by their names
        self._bf16_rows: dict[str, torch.Tensor] = {}  # each kept stack's rows, by name
        self.budget_bytes, self.used_bytes = budget_bytes, 0
        # two host threads may ask for one name at once (harness.run.host_lanes): both must get the one cached
        # tensor, since bf16_exact lets only that one onto tensor cores
        self._lock = threading.RLock()

    @classmethod
    def for_device(cls, device: torch.device | str, sharing: int = 1) -> "DenseCache":
        """A cache sized for a run on `device`: CPU_BUDGET_BYTES, or DEVICE_BUDGET_FRACTION of a GPU's memory split
        between the `sharing` processes that run on it."""
        device = torch.device(device)
        if device.type == "cuda":
            return cls(int(torch.cuda.get_device_properties(device).total_memory * DEVICE_BUDGET_FRACTION / sharing))
        return cls()

    def get(self, name: str, stored: Stored | Callable[[], Stored], device: torch.device) -> torch.Tensor:
        """fp32 value of `stored` (or of what the callable returns, called only on a miss), cached by name."""
        t = self._cache.get(name)
        if t is not None:
            return t
        with self._lock:
            return self._get_locked(name, stored, device)

    def _get_locked(self, name: str, stored: Stored | Callable[[], Stored], device: torch.device) -> torch.Tensor:
        t = self._cache.get(name)  # another thread may have made it meanwhile
        if t is None:
            if callable(stored) and not isinstance(stored, torch.Tensor):
                stored = stored()
            t = stored.dequantize(torch.float32) if isinstance(stored, QuantizedTensor) else stored.float()
            t = t.to(device)
            if self.room_for(t.numel() * 4):
                self.put(name, t)
        return t

    def fill(self, names: Iterable[str], stored: Callable[[str], Stored], device: torch.device) -> bool:
        """Admit the fp32 copies of every one of `names` not cached yet, if they all fit the budget together; else
        admit none and return False (what does not fit whole is left to `get`, which admits by first use, so that
        the weights every token uses come first). Quantized tensors of one format and shape are dequantized
        STACK_BYTES at a time (quant.dequantize_stack: the same bits), each cached as a view of its stack; on a
        GPU, whether each is bf16-exact is noted with one host read for all of them (what `bf16_exact` would find
        when first asked). A layer-major run fills a layer's cache before its first stack: one tensor at a time at
        first use took ~13 launches per tensor and a host read per bf16_exact, ~10,000 launches and ~800 reads in a
        Flash layer."""
        with self._lock:
            admitted = [(n, stored(n)) for n in dict.fromkeys(names) if n not in self._cache]
            if not self.room_for(sum(_elements(v) * 4 for _, v in admitted)):
                return False
            stacks: dict[tuple, list[tuple[str, QuantizedTensor]]] = {}
            made: list[tuple[list[str], torch.Tensor]] = []
            for name, value in admitted:
                if isinstance(value, QuantizedTensor) and value.format in STACKABLE_FORMATS:
                    key = (value.format, value.shape, value.device)
                    stacks.setdefault(key, []).append((name, value))
                    if _elements(value) * 4 * len(stacks[key]) >= STACK_BYTES:
                        made.append(self._admit_stack(stacks.pop(key), device))
                else:
                    made.append(([name], self._get_locked(name, value, device)[None]))  # fits: admitted
            made += [self._admit_stack(members, device) for members in stacks.values()]
            flags = [(group, bf16_exact_flags(stack)) for group, stack in made if stack.is_cuda]
            if flags:
                exact = torch.cat([f for _, f in flags]).tolist()  # the one host read
                self._bf16_exact.update(zip([n for group, _ in flags for n in group], exact))
            return True

    def _admit_stack(self, members: list[tuple[str, QuantizedTensor]], device: torch.device
                     ) -> tuple[list[str], torch.Tensor]:
        stack = dequantize_stack([q for _, q in members]).to(device)
        for (name, _), value in zip(members, stack):
            self.put(name, value)
        return [name for name, _ in members], stack

    def __contains__(self, name: str) -> bool:
        return name in self._cache

    def room_for(self, n_bytes: int) -> bool:
        """Whether `n_bytes` more fit the budget."""
        return self.used_bytes + n_bytes <= self.budget_bytes

    def put(self, name: str, value: torch.Tensor) -> None:
        """Keep an fp32 value computed elsewhere (a batch of conversions) as `get` would have kept it; the caller checks
        `room_for` first."""
        with self._lock:
            if name not in self._cache:
                self._cache[name] = value
                self.used_bytes += value.numel() * 4

    def holds(self, name: str, value: torch.Tensor) -> bool:
        """Whether `value` is the very tensor cached under `name` (not one a patch made from it or instead of it)."""
        return self._cache.get(name) is value

    def bf16_stack(self, names: Sequence[str]) -> torch.Tensor | None:
        """A [len(names), *shape] bf16 copy of the cached fp32 tensors `names` (one shape, each bf16-exact, so the copy
        changes no value), made with one multi-tensor copy and kept, within the budget (2 bytes per element), for the
        rest of the layer; None when one of them is not cached or not bf16-exact, or when the copy does not fit.

        Why: the experts' grouped GEMMs read bf16 weights (optimized.numerics.grouped_bf16_products). Casting a
        group's fp32 copies for every prefill chunk and every stack costs each stack and mode ~0.06 s of device time
        per Flash layer (256 × 3 matrices × 6 bytes per element, per chunk, measured on an H100); kept, a layer's
        experts are cast once (12.9 GB at Flash width: an H200's cache has the room beside the fp32 copies, an
        H100's has not). The values are the same either way, so the GEMMs' bits do not follow admission."""
        key = tuple(names)
        stack = self._bf16_stacks.get(key)
        if stack is not None:
            return stack
        with self._lock:
            stack = self._bf16_stacks.get(key)
            if stack is not None or not key:
                return stack
            values = [self._cache.get(n) for n in key]
            if any(v is None or v.shape != values[0].shape or v.device != values[0].device for v in values):
                return None
            n_bytes = len(values) * values[0].numel() * 2
            if not self.room_for(n_bytes) or not all(self.bf16_exact(n, v) for n, v in zip(key, values)):
                return None
            stack = torch.empty(len(values), *values[0].shape, dtype=torch.bfloat16, device=values[0].device)
            torch._foreach_copy_(list(stack.unbind(0)), values)
            self._bf16_rows.update(zip(key, stack.unbind(0)))
            self.used_bytes += n_bytes
            self._bf16_stacks[key] = stack  # last: the unlocked read above finds only a stack whose rows are kept
            return stack

    def bf16_copy(self, name: str) -> torch.Tensor | None:
        """The bf16 copy of `name` in a stack bf16_stack keeps (a view of the stack's row), None when none holds it."""
        return self._bf16_rows.get(name)

    def bf16_exact(self, name: str, value: torch.Tensor) -> bool:
        """Whether `value` is the tensor cached under `name` and every value of it is a bf16: a product with it may
        then run on bf16 tensor cores (optimized.numerics.exact_product), and a bf16 GEMM may read it without
        rounding it (optimized.base_ops.rounded_weight). Checked when first asked and remembered — the cache's tensors
        are shared by every stack and never changed in place — so only the weights asked about are read (on a CPU,
        only a bf16 GEMM's weights: the products do not ask there). False for any tensor other than the cached one:
        one a patch made, one past the budget (dequantized on every use); their products stay fp32 GEMMs."""
        if not self.holds(name, value):
            return False
        exact = self._bf16_exact.get(name)
        if exact is None:
            exact = self._bf16_exact[name] = all_bf16_exact(value)
        return exact


CHECK_ELEMENTS = 1 << 24
"""Elements per step of all_bf16_exact: its temporaries (a bf16 copy, its fp32 value, the comparison) stay ~100 MB
whatever the tensor (a Flash attn.wq_b is 32 M elements: two steps)."""


STACK_BYTES = 256 << 20
"""fp32 bytes dequantized together by DenseCache.fill: 8 Flash expert matrices (2048 × 4096). Their temporaries
peak at ~3× that (the e2m1 decode's int32 indices and values, the expanded scales, the product), ~0.8 GB — less than
an NVFP4 conversion group (base_ops.NVFP4_GROUP) — and exist only before the layer's first stack, when no working
set does (harness.run.memory)."""


def _elements(value: Stored) -> int:
    """Elements of a stored tensor's fp32 copy (a QuantizedTensor's: its [out, in] shape)."""
    if isinstance(value, QuantizedTensor):
        rows, cols = value.shape
        return rows * cols
    return value.numel()


def all_bf16_exact(t: torch.Tensor) -> bool:
    """Whether every value of fp32 tensor `t` is exactly a bf16 (rounding to bf16 changes none: the exact
    dequantization of FP8 e4m3 or FP4 e2m1 elements times power-of-two block scales — the checkpoint's UE8M0 — is;
    an NVFP4 value with an fp32 global scale, in general, is not). One host read."""
    return bool(bf16_exact_flags(t[None])[0])


def bf16_exact_flags(stack: torch.Tensor) -> torch.Tensor:
    """[G] bools, on the stack's device: all_bf16_exact of each stack[i], without a host read; checked in steps of
    CHECK_ELEMENTS per tensor."""
    flat = stack.reshape(stack.shape[0], -1)
    exact = torch.ones(stack.shape[0], dtype=torch.bool, device=stack.device)
    step = max(1, CHECK_ELEMENTS // max(1, flat.shape[0]))
    for i in range(0, flat.shape[1], step):
        part = flat[:, i:i + step]
        exact &= torch.eq(part.bfloat16().float(), part).all(1)
    return exact


def dense_specs(cfg: ModelConfig, layer: int) -> list[TensorSpec]:
    """The tensors of layer `layer` that have fp32 copies: every floating one (integer tensors such as tid2eid are
    read as stored, never cached)."""
    return [t for t in layer_specs(cfg, layer) if t.storage != "i64"]


def layer_dense_bytes(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """(fp32 bytes of every tensor of dense_specs, of its routed experts): what the layer's fp32 copies take in a
    cache that holds them all (`get` counts numel·4)."""
    specs = dense_specs(cfg, layer)
    return (sum(t.numel * 4 for t in specs), sum(t.numel * 4 for t in specs if t.name.startswith("ffn.experts.")))
