"""Deterministic synthetic DeepSeek-V4 weights (DESIGN §3, Weights).

Every tensor is a pure function of (seed, layer, tensor name): no global RNG state, so layers can be
asked for in any order, on any device, and come out bit-identical. Randomness comes from a counter-based
integer hash (murmur3's 32-bit finaliser, evaluated in int64 tensor arithmetic, which wraps identically
on CPU and GPU), and normal variates from an Irwin–Hall sum of four 16-bit uniforms whose integer sum
is exact in fp32; the only float operation is one correctly-rounded multiply. No transcendental
functions are involved, so no device-specific libm can change a bit.

Statistics aim at a model where low precision has something to break: norm weights near 1 with a few
outlier channels, kv-norm gains that make attention peaky, non-zero sinks and ape biases, router biases,
near-identity mHC mixing, a random `tid2eid`. The profile (`reference.weights.profiles`) decides the rest:
`calibrated` (the default) sets sink masses, router margins, w1/w3 scale spreads, an outlier channel and a
channel per expert whose pre-activations pass the SwiGLU limit from public evidence, and plants retrieval circuits
(`reference.weights.retrieval`); `uncalibrated` is the generator as it was before, bit for bit. Storage is
**quantization-consistent**: FP8 tensors are generated, quantized to e4m3 with UE8M0 128x128 block scales, and kept in that form; experts likewise as
FP4 e2m1 with per-32 scales; BF16 tensors are rounded to bf16. The fp32 master value every stack sees is
the exact dequantization, as with the real checkpoint, so the weight format is never counted as drift.
"""

from __future__ import annotations

import functools
import hashlib
import math

import torch

from reference.config import FLASH_MINI, TINY, ModelConfig
from reference.quant import quantize_fp4_mx32, quantize_fp8_block128
from reference.weights import profiles, retrieval
from reference.weights.hashing import CHUNK, hash_u32, normal_of_hash, standard_normal, stream_key, uniform_int, uniforms
from reference.weights.schema import TensorSpec, layer_specs, top_level_specs
from reference.weights.source import Stored, TensorBundle, stored_bytes

RESIDUAL_OUTPUT_PROJECTIONS = ("attn.wo_b.weight", "ffn.shared_experts.w2.weight")
"""Projections whose output is added to the residual streams (with the routed experts' w2)."""


ATTENTION_INPUT_PROJECTIONS = ("attn.wq_a.weight", "attn.wkv.weight", "attn.compressor.wkv.weight",
                               "attn.compressor.wgate.weight", "attn.indexer.compressor.wkv.weight",
                               "attn.indexer.compressor.wgate.weight")
"""Projections of the attention input into queries, keys and compressed rows (calibrated profile)."""


@functools.lru_cache(maxsize=None)
def generator_fingerprint(profile: str) -> str:
    """What this code generates under `profile`, in 16 hex digits: sha256 of the stored bytes (codes and scales) of
    tiny's weights at seed 0 — its top level, its five layers (SWA, CSA and HCA, hash routing) and every embedding row
    — and of flash-mini's parts of a planted retrieval circuit, which tiny has none of (layer 4, its top level but the
    head, its first 4,096 embedding rows and token codes, and the head's answer read-out constant). A profile's name
    stays while its code may change (`calibrated` gained its SwiGLU clamp channels on 2026-12-05), and a run's
    manifest names the profile: the fingerprint beside it lets `--resume` refuse to continue a run on weights other
    than the ones it started on. Made once per process and profile (~1 s on one CPU core)."""
    digest = hashlib.sha256()

    def add(value: Stored) -> None:
        digest.update(stored_bytes(value))

    tiny, mini = SyntheticWeights(TINY, 0, profile), SyntheticWeights(FLASH_MINI, 0, profile)
    bundles = [tiny.top_level()] + [tiny.layer(layer) for layer in range(TINY.num_hidden_layers)] + [mini.layer(4)]
    for bundle in bundles:
        for name in sorted(bundle.names()):
            digest.update(name.encode())
            add(bundle.stored(name))
    add(tiny.embed_rows(torch.arange(TINY.vocab_size)))
    # flash-mini's head is 8M elements (~1 s to make): its answer columns are ANSWER_READ times the token codes
    for spec in (s for s in top_level_specs(FLASH_MINI) if s.name not in ("embed.weight", "head.weight")):
        digest.update(spec.name.encode())
        add(mini._make(spec, None, "cpu"))
    sample = torch.arange(4096)
    add(mini.embed_rows(sample))
    if mini.retrieval is not None:
        add(mini.token_codes(sample))
        digest.update(repr(retrieval.ANSWER_READ).encode())
    return digest.hexdigest()[:16]


class SyntheticWeights:
    """A `WeightSource` of deterministic synthetic weights for any `ModelConfig`."""

    def __init__(self, config: ModelConfig, seed: int = 0, profile: str = profiles.DEFAULT_PROFILE) -> None:
        self.config = config
        self.seed = int(seed)
        self.profile = profiles.get_profile(profile)
        self.retrieval = retrieval.retrieval_plan(config) if self.profile.calibrated else None

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {"kind": "synthetic", "seed": self.seed, "model": self.config.name,
                                  "profile": self.profile.name, "generator": generator_fingerprint(self.profile.name)}
        if self.retrieval is not None:
            out["retrieval_layers"] = {str(layer): offset for layer, offset in self.retrieval.layers.items()}
        return out

    def token_codes(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The ±1 retrieval codes of token ids (calibrated profile with a circuit only)."""
        if self.retrieval is None:
            raise ValueError(f"{self.config.name} ({self.profile.name} profile) has no retrieval circuit")
        return retrieval.token_codes(stream_key(self.seed, None, "retrieval/codes"), token_ids, self.retrieval.bits)

    # --- public API -------------------------------------------------------------------------------
    def top_level(self, device: torch.device | str = "cpu") -> TensorBundle:
        specs = [s for s in top_level_specs(self.config) if s.name != "embed.weight"]
        return TensorBundle("top level (synthetic)", {s.name: self._make(s, None, device) for s in specs})

    def _answer_head(self, value: torch.Tensor) -> torch.Tensor:
        """head.weight with β·c(t) in the answer columns (retrieval.py step 7), generated in row chunks."""
        plan, out = self.retrieval, value.clone()
        step = max(1, CHUNK // plan.bits)
        for start in range(0, out.shape[0], step):
            ids = torch.arange(start, min(out.shape[0], start + step), device=out.device)
            out[start : start + ids.numel(), plan.answer_dims] = retrieval.ANSWER_READ * self.token_codes(ids)
        return out

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
        for start in range(0, unique.numel(), max(1, CHUNK // D)):
            u = unique[start : start + max(1, CHUNK // D)].to(device)
            idx = (u[:, None] * D + cols[None, :]).flatten()
            rows.append(normal_of_hash(hash_u32(key, idx)).view(-1, D))
        table = torch.cat(rows, 0) if rows else torch.empty(0, D, device=device)
        if self.profile.calibrated:
            table = self._calibrated_embedding(unique.to(device), table)
        return table[inverse.to(device)].to(torch.bfloat16)

    def _calibrated_embedding(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The outlier channel (profiles.OUTLIER_CHANNEL_VALUE) in the last dim of every row; with a circuit, the
        token's code in the code dims and zeros in the answer dims (retrieval.py step 1)."""
        rows = rows.clone()
        rows[:, profiles.outlier_dim(self.config)] = profiles.OUTLIER_CHANNEL_VALUE
        if self.retrieval is not None and rows.shape[0]:
            rows[:, self.retrieval.code_dims] = self.token_codes(ids)
            rows[:, self.retrieval.answer_dims] = 0
        return rows

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
        if self.profile.calibrated:
            value = self._calibrate(spec, layer, value, device)
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

    def _calibrate(self, spec: TensorSpec, layer: int | None, value: torch.Tensor, device) -> torch.Tensor:
        """The calibrated profile's statistics (reference.weights.profiles), then the retrieval circuit."""
        name, cfg = spec.name, self.config
        if name == "head.weight" and self.retrieval is not None:
            return self._answer_head(value)
        if layer is None:
            return value
        if name == "attn.attn_sink":
            u = uniforms(stream_key(self.seed, layer, name + "#mass"), cfg.num_attention_heads)
            value = torch.tensor([profiles.sink_logit(cfg, layer, h, float(u[h])) for h in range(cfg.num_attention_heads)],
                                 dtype=torch.float32, device=device)
        elif name in ("ffn.gate.weight", "ffn.gate.bias"):
            # the uncalibrated logit std is 1 (bias 0.05·z): rescale both to the reference router's margins, so the
            # bias keeps its share of the logit spread
            value = value * profiles.router_logit_std(cfg)
        elif name.startswith("ffn.experts.") and name.endswith((".w1.weight", ".w3.weight")):
            expert = name.split(".")[2]
            u = uniforms(stream_key(self.seed, layer, f"ffn.experts.{expert}#w13"), 4)
            log_ratio = profiles.W13_LOG_RATIO_SCALE * profiles.student_t3(tuple(float(x) for x in u))
            if self.profile.clamp_channels:
                value = self._clamp_channel(layer, name, value)
            value = value * math.exp((0.5 if name.endswith(".w3.weight") else -0.5) * log_ratio)
        elif name in ("ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight") and self.profile.clamp_channels:
            value = self._clamp_channel(layer, name, value)
        if name in ATTENTION_INPUT_PROJECTIONS:
            # attention reads no bias from the outlier channel: a constant in every q and k would shift every
            # logit of a query by the same amount and move the sink (which gets no such shift) relative to the
            # keys, undoing the sink calibration; the sinks carry that role explicitly
            value = value.clone()
            value[:, profiles.outlier_dim(cfg)] = 0
        if self.retrieval is not None:
            value = retrieval.plant(cfg, self.retrieval, layer, name, value)
        return value

    def _clamp_channel(self, layer: int, name: str, value: torch.Tensor) -> torch.Tensor:
        """One intermediate channel of each expert (routed and shared; the same channel in w1 and w3) whose row is
        flat: random signs times the tensor's largest magnitude, on as many random columns as
        give it the norm profiles.CLAMP_ROW_NORM (every column at flash-mini's width, about half at Flash's), its
        outlier column zero. Its pre-activations then pass swiglu_limit at some tokens, so the clamp decides
        something; and the tensor's largest magnitude is what it was, so its NVFP4 global scale — and the w1/w3
        ratio calibrated from them (W13_LOG_RATIO_SCALE, applied after this) — too."""
        expert = name.rsplit(".", 2)[0]  # ffn.experts.<e> or ffn.shared_experts
        channel = int(uniform_int(stream_key(self.seed, layer, expert + "#clamp"), 1, value.device)[0]) % value.shape[0]
        width = value.shape[1]
        amax = float(value.abs().max())  # the row's new entries are this magnitude: the tensor's amax is unchanged
        columns = min(width, round((profiles.CLAMP_ROW_NORM / amax) ** 2))
        # the hash is a bijection of the column index, so the order has no ties (the same on every device)
        chosen = torch.argsort(uniform_int(stream_key(self.seed, layer, name + "#clamp-columns"), width,
                                           value.device))[:columns]
        signs = uniform_int(stream_key(self.seed, layer, name + "#clamp-signs"), width, value.device) % 2
        row = torch.zeros(width, device=value.device)
        row[chosen] = (1.0 - 2.0 * signs[chosen].to(row.dtype)) * amax
        row[profiles.outlier_dim(self.config)] = 0
        value = value.clone()
        value[channel] = row
        return value

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
        step = max(1, CHUNK // E)
        for start in range(0, V, step):
            stop = min(V, start + step)
            r = hash_u32(key, torch.arange(start * E, stop * E, dtype=torch.int64, device=device))
            # key*E + e is unique per row, so the order is total and device-independent
            keys = r.view(stop - start, E) * E + torch.arange(E, device=device)
            rows.append(torch.argsort(keys, dim=-1)[:, :k])
        return torch.cat(rows, 0).to(torch.int64)

