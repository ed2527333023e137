"""Deterministic synthetic DeepSeek-V4 weights (DESIGN §3, Weights).

Every tensor is a pure function of (seed, layer, tensor name): no global RNG state, so layers can be
asked for in any order, on any device, and come out bit-identical. Randomness comes from a counter-based
integer hash (murmur3's 32-bit finaliser, evaluated in int64 tensor arithmetic, which wraps identically
on CPU and GPU), and normal variates from an Irwin–Hall sum of four 16-bit uniforms whose integer sum
is exact in fp32; the only float operation is one correctly-rounded multiply. No transcendental
functions are involved, so no device-specific libm can change a bit.

Statistics aim at a model where low precision has something to break: norm weights near 1 with a few
outlier channels, kv-norm gains that make attention peaky, non-zero sinks and ape biases, router biases,
near-identity mHC mixing, a random `tid2eid`. Storage is **quantization-consistent**: FP8 tensors are
generated, quantized to e4m3 with UE8M0 128x128 block scales, and kept in that form; experts likewise as
FP4 e2m1 with per-32 scales; BF16 tensors are rounded to bf16. The fp32 master value every stack sees is
the exact dequantization, as with the real checkpoint, so the weight format is never counted as drift.
"""

from __future__ import annotations

import hashlib
import math

import torch

from reference.config import ModelConfig
from reference.quant import quantize_fp4_mx32, quantize_fp8_block128
from reference.weights.schema import TensorSpec, layer_specs, top_level_specs
from reference.weights.source import Stored, TensorBundle

_MASK32 = 0xFFFFFFFF
_CHUNK = 1 << 24  # elements generated per step, bounds the int64 temporaries (~128 MB per step)
_INV_STD_IH4 = 1.0 / math.sqrt(4 * (256**2 - 1) / 12)  # 1/std of a sum of four uniform bytes


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3 finaliser on values in [0, 2^32) held in int64; exact wrap-around via masking."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def stream_key(seed: int, layer: int | None, name: str) -> int:
    """A 32-bit key from (seed, layer, name); blake2b so the mapping never depends on Python's hash()."""
    tag = f"dsv4-drift/{seed}/{'top' if layer is None else layer}/{name}".encode()
    return int.from_bytes(hashlib.blake2b(tag, digest_size=4).digest(), "little")


def hash_u32(key: int, index: torch.Tensor) -> torch.Tensor:
    """fmix32(index XOR key) for int64 indices < 2^32: a bijection of the index, so one tensor never
    repeats a value by construction, and two keys give two permutations of the same well-mixed sequence."""
    return _fmix32(index ^ key)


def standard_normal(key: int, numel: int, device: torch.device | str, offset: int = 0) -> torch.Tensor:
    """Elements [offset, offset+numel) of the key's stream of approximately N(0, 1) fp32 values.

    Irwin–Hall(4) of the hash's four bytes: S = b0+b1+b2+b3 is an integer in [0, 1020], exact in fp32,
    with mean 510 and variance 4·(256²−1)/12 = 21845; z = (S − 510)/sqrt(21845) has mean 0, variance 1,
    tails at ±3.45 and a resolution of 0.0068σ, far finer than the FP8/FP4/BF16 storage it feeds.
    The one float operation is a correctly-rounded multiply, so every device gives the same bits.
    """
    out = torch.empty(numel, dtype=torch.float32, device=device)
    for start in range(0, numel, _CHUNK):
        stop = min(numel, start + _CHUNK)
        h = hash_u32(key, torch.arange(offset + start, offset + stop, dtype=torch.int64, device=device))
        s = (h & 255) + ((h >> 8) & 255) + ((h >> 16) & 255) + (h >> 24)
        out[start:stop] = (s - 510).to(torch.float32) * _INV_STD_IH4
    return out


def uniform_int(key: int, numel: int, device: torch.device | str) -> torch.Tensor:
    """`numel` 32-bit random integers (int64), for discrete draws such as outlier channels."""
    return hash_u32(key, torch.arange(numel, dtype=torch.int64, device=device))


RESIDUAL_OUTPUT_PROJECTIONS = ("attn.wo_b.weight", "ffn.shared_experts.w2.weight")
"""Projections whose output is added to the residual streams (with the routed experts' w2)."""


class SyntheticWeights:
    """A `WeightSource` of deterministic synthetic weights for any `ModelConfig`."""

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        self.config = config
        self.seed = int(seed)

    def describe(self) -> dict[str, object]:
        return {"kind": "synthetic", "seed": self.seed, "model": self.config.name}

    # --- public API -------------------------------------------------------------------------------
    def top_level(self, device: torch.device | str = "cpu") -> TensorBundle:
        specs = [s for s in top_level_specs(self.config) if s.name != "embed.weight"]
        return TensorBundle("top level (synthetic)", {s.name: self._make(s, None, device) for s in specs})

    def embed_rows(self, token_ids: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
        """Rows of embed.weight (bf16, as stored) for the given ids, generated without the full table:
        element (row, col) is stream element row·D + col, so a row costs D hashes wherever it is asked for."""
        D, V = self.config.hidden_size, self.config.vocab_size
        ids = torch.as_tensor(token_ids, dtype=torch.int64).flatten().cpu()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
            raise ValueError(f"token id outside the vocabulary [0, {V}): min {int(ids.min())}, max {int(ids.max())}")
        unique, inverse = torch.unique(ids, return_inverse=True)
        key = stream_key(self.seed, None, "embed.weight")
        cols = torch.arange(D, dtype=torch.int64, device=device)
        rows = []
        for start in range(0, unique.numel(), max(1, _CHUNK // D)):
            u = unique[start : start + max(1, _CHUNK // D)].to(device)
            idx = (u[:, None] * D + cols[None, :]).flatten()
            h = hash_u32(key, idx)
            s = (h & 255) + ((h >> 8) & 255) + ((h >> 16) & 255) + (h >> 24)
            rows.append(((s - 510).to(torch.float32) * _INV_STD_IH4).view(-1, D))
        table = torch.cat(rows, 0) if rows else torch.empty(0, D, device=device)
        return table[inverse.to(device)].to(torch.bfloat16)

    def layer(self, layer: int, device: torch.device | str = "cpu") -> TensorBundle:
        if not 0 <= layer < self.config.num_hidden_layers:
            raise IndexError(f"layer {layer} outside 0..{self.config.num_hidden_layers - 1}")
        return TensorBundle(f"layer {layer} (synthetic)",
                            {s.name: self._make(s, layer, device) for s in layer_specs(self.config, layer)})

    # --- generation ---------------------------------------------------------------------------------
    def _normal(self, layer: int | None, name: str, shape: tuple[int, ...], device) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        return standard_normal(stream_key(self.seed, layer, name), n, device).view(shape)

    def _make(self, spec: TensorSpec, layer: int | None, device) -> Stored:
        value = self._value(spec, layer, device)
        if spec.storage == "fp8_block128":
            return quantize_fp8_block128(value)
        if spec.storage == "fp4_mx32":
            return quantize_fp4_mx32(value)
        if spec.storage == "bf16":
            return value.to(torch.bfloat16)
        return value

    def _value(self, spec: TensorSpec, layer: int | None, device) -> torch.Tensor:
        """The fp32 (or int64) value before storage rounding; statistics chosen per tensor role."""
        name, shape = spec.name, spec.shape
        z = lambda: self._normal(layer, name, shape, device)  # noqa: E731  (lazy: tid2eid needs none)

        if name.endswith("tid2eid"):
            return self._tid2eid(layer, device)
        if name.endswith("norm.weight"):
            gain = 2.5 if name == "attn.kv_norm.weight" else 1.0  # kv gain makes attention logits peaky
            return gain * self._norm_weight(layer, name, shape, device)
        if name == "embed.weight":
            return z()
        if name in RESIDUAL_OUTPUT_PROJECTIONS or (name.startswith("ffn.experts.") and name.endswith(".w2.weight")):
            # sub-layer outputs are small updates to the residual streams, as in trained models (and GPT-2's
            # 1/sqrt(2·n_layers) output init): a random block otherwise rewrites the stream every layer and any
            # perturbation, rounding included, compounds through 43 layers into decorrelation
            return z() / math.sqrt(shape[1] * 2 * self.config.num_hidden_layers)
        if name in ("head.weight",) or spec.storage in ("fp8_block128", "fp4_mx32") or name.endswith(
                ("wkv.weight", "wgate.weight", "weights_proj.weight", "gate.weight")):
            return z() / math.sqrt(shape[1])
        if name == "attn.attn_sink":
            return 1.0 + z()
        if name.endswith("ape"):
            return 0.75 * z()
        if name == "ffn.gate.bias":
            return 0.05 * z()
        if name.startswith(("hc_", "hc_head")) or "_hc_" in name:
            return self._hc_param(layer, name, shape, device)
        raise KeyError(f"synthetic generator has no rule for tensor '{name}'")

    def _norm_weight(self, layer: int | None, name: str, shape, device) -> torch.Tensor:
        """1 + 0.1·N(0,1), with ~1/64 of channels outliers scaled 3-6x (real checkpoints show such channels)."""
        w = 1.0 + 0.1 * self._normal(layer, name, shape, device)
        pick = uniform_int(stream_key(self.seed, layer, name + "#outliers"), w.numel(), device)
        outlier = (pick % 64) == 0
        factor = 3.0 + (pick >> 8).remainder(4).to(torch.float32)  # 3, 4, 5 or 6
        return torch.where(outlier.view(shape), w * factor.view(shape), w)

    def _hc_param(self, layer: int | None, name: str, shape, device) -> torch.Tensor:
        """mHC parameters (spec §3): small fn, scales of order 1, a comb base that favours the identity."""
        n = self.config.hc_mult
        z = self._normal(layer, name, shape, device)
        if name.endswith("_fn"):
            return z / math.sqrt(shape[1])
        if name.endswith("_scale"):
            return 0.5 + 0.1 * z
        # base: pre/post offsets near 0 (weights near 0.5 and 1.0), comb base = 2·I + noise
        base = 0.3 * z
        if name != "hc_head_base":
            base = base.clone()
            base[2 * n:] += 2.0 * torch.eye(n, device=device).flatten()
        return base

    def _tid2eid(self, layer: int | None, device) -> torch.Tensor:
        """Random distinct expert ids per token: the first k of a hashed ordering of all experts."""
        cfg = self.config
        V, E, k = cfg.vocab_size, cfg.n_routed_experts, cfg.num_experts_per_tok
        key = stream_key(self.seed, layer, "ffn.gate.tid2eid")
        rows = []
        step = max(1, _CHUNK // E)
        for start in range(0, V, step):
            stop = min(V, start + step)
            r = hash_u32(key, torch.arange(start * E, stop * E, dtype=torch.int64, device=device))
            # key*E + e is unique per row, so the order is total and device-independent
            keys = r.view(stop - start, E) * E + torch.arange(E, device=device)
            rows.append(torch.argsort(keys, dim=-1)[:, :k])
        return torch.cat(rows, 0).to(torch.int64)

