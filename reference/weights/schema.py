"""What tensors a DeepSeek-V4 checkpoint holds: official names, shapes and storage formats (spec §8.3).

One table serves the synthetic generator, every checkpoint reader, validation and `checkpoint
inspect`, so a name or shape is written down exactly once. Names are the official ones (no `model.`
prefix, `attn.kv_norm.weight`, `hc_head_fn`); readers of other layouts map onto them.
"""

from __future__ import annotations

from dataclasses import dataclass

from reference.config import ModelConfig

STORAGE_KINDS = ("fp8_block128", "fp4_mx32", "bf16", "f32", "i64")


@dataclass(frozen=True)
class TensorSpec:
    """One logical tensor: its official name, logical shape, and how the official checkpoint stores it."""

    name: str
    shape: tuple[int, ...]
    storage: str  # one of STORAGE_KINDS

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def hc_mix_width(cfg: ModelConfig) -> int:
    """(2 + n)·n rows of the mHC pre-linear: n pre + n post + n² comb (24 for n = 4, spec §3)."""
    return (2 + cfg.hc_mult) * cfg.hc_mult


def top_level_specs(cfg: ModelConfig) -> list[TensorSpec]:
    d, n, v = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size
    return [
        TensorSpec("embed.weight", (v, d), "bf16"),
        TensorSpec("head.weight", (v, d), "bf16"),
        TensorSpec("norm.weight", (d,), "bf16"),
        TensorSpec("hc_head_fn", (n, n * d), "f32"),
        TensorSpec("hc_head_base", (n,), "f32"),
        TensorSpec("hc_head_scale", (1,), "f32"),
    ]


def _compressor_specs(prefix: str, width: int, overlap: bool, ratio: int, d_model: int) -> list[TensorSpec]:
    c = 2 if overlap else 1
    return [
        TensorSpec(f"{prefix}.wkv.weight", (c * width, d_model), "bf16"),
        TensorSpec(f"{prefix}.wgate.weight", (c * width, d_model), "bf16"),
        TensorSpec(f"{prefix}.ape", (ratio, c * width), "f32"),
        TensorSpec(f"{prefix}.norm.weight", (width,), "bf16"),
    ]


def layer_specs(cfg: ModelConfig, layer: int) -> list[TensorSpec]:
    """Tensors of `layers.{layer}.` without that prefix, in spec §8.3 order."""
    D, n, H, hd = cfg.hidden_size, cfg.hc_mult, cfg.num_attention_heads, cfg.head_dim
    G, Ro, ql = cfg.o_groups, cfg.o_lora_rank, cfg.q_lora_rank
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    mix = hc_mix_width(cfg)
    specs = [
        TensorSpec("attn_norm.weight", (D,), "bf16"),
        TensorSpec("ffn_norm.weight", (D,), "bf16"),
    ]
    for site in ("attn", "ffn"):
        specs += [
            TensorSpec(f"hc_{site}_fn", (mix, n * D), "f32"),
            TensorSpec(f"hc_{site}_base", (mix,), "f32"),
            TensorSpec(f"hc_{site}_scale", (3,), "f32"),
        ]
    specs += [
        TensorSpec("attn.attn_sink", (H,), "f32"),
        TensorSpec("attn.wq_a.weight", (ql, D), "fp8_block128"),
        TensorSpec("attn.q_norm.weight", (ql,), "bf16"),
        TensorSpec("attn.wq_b.weight", (H * hd, ql), "fp8_block128"),
        TensorSpec("attn.wkv.weight", (hd, D), "fp8_block128"),
        TensorSpec("attn.kv_norm.weight", (hd,), "bf16"),
        TensorSpec("attn.wo_a.weight", (G * Ro, (H // G) * hd), "fp8_block128"),
        TensorSpec("attn.wo_b.weight", (D, G * Ro), "fp8_block128"),
    ]
    kind = cfg.layer_kind(layer)
    if kind != "swa":
        m = cfg.compress_ratio(layer)
        specs += _compressor_specs("attn.compressor", hd, kind == "csa", m, D)
    if kind == "csa":
        nI, dI = cfg.index_n_heads, cfg.index_head_dim
        specs += [
            TensorSpec("attn.indexer.wq_b.weight", (nI * dI, ql), "fp8_block128"),
            TensorSpec("attn.indexer.weights_proj.weight", (nI, D), "bf16"),
        ]
        specs += _compressor_specs("attn.indexer.compressor", dI, True, cfg.compress_ratio(layer), D)
    specs.append(TensorSpec("ffn.gate.weight", (E, D), "bf16"))
    if cfg.is_hash_layer(layer):
        specs.append(TensorSpec("ffn.gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), "i64"))
    else:
        specs.append(TensorSpec("ffn.gate.bias", (E,), "f32"))
    for e in range(E):
        specs += [
            TensorSpec(f"ffn.experts.{e}.w1.weight", (I, D), "fp4_mx32"),
            TensorSpec(f"ffn.experts.{e}.w3.weight", (I, D), "fp4_mx32"),
            TensorSpec(f"ffn.experts.{e}.w2.weight", (D, I), "fp4_mx32"),
        ]
    if cfg.n_shared_experts:
        specs += [
            TensorSpec("ffn.shared_experts.w1.weight", (I, D), "fp8_block128"),
            TensorSpec("ffn.shared_experts.w3.weight", (I, D), "fp8_block128"),
            TensorSpec("ffn.shared_experts.w2.weight", (D, I), "fp8_block128"),
        ]
    return specs


def layer_prefix(layer: int) -> str:
    return f"layers.{layer}."
