"""Model configuration: every hyper-parameter of spec §1 in one dataclass, plus presets.

One `ModelConfig` drives the reference, the optimized stack and the harness. It reads a real
`config.json` in both key styles seen in the wild (the released legacy keys `compress_ratios`,
`num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`, and transformers' `layer_types`,
`mlp_layer_types`, `compress_rates`, `partial_rotary_factor`, `rope_parameters`), and writes the
transformers form back so a synthetic checkpoint loads in `transformers` too.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAYER_KINDS = ("swa", "csa", "hca")
"""swa: sliding window only; csa: overlapping compressor (m=4) + lightning indexer; hca: m=128 compressor."""

_HF_LAYER_TYPE = {
    "swa": "sliding_attention",
    "csa": "compressed_sparse_attention",
    "hca": "heavily_compressed_attention",
}
_KIND_OF_HF_LAYER_TYPE = {v: k for k, v in _HF_LAYER_TYPE.items()}


class ConfigError(ValueError):
    """An invalid or unreadable configuration; the message names the field (and file)."""


@dataclass(frozen=True)
class YarnConfig:
    """YaRN frequency interpolation for compressed layers only (spec §4.3). No magnitude scaling."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Every DeepSeek-V4 hyper-parameter the math needs (spec §1.1); field names follow transformers."""

    name: str = "custom"
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    layer_kinds: tuple[str, ...] = ()
    compress_rate_csa: int = 4
    compress_rate_hca: int = 128
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnConfig | None = None
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    hash_layers: tuple[bool, ...] = ()
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-6
    bos_token_id: int = 0
    eos_token_id: int = 1
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 1
    tie_word_embeddings: bool = False
    quantization_config: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    # --- derived quantities -------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        """Dims of each head that carry no rotation: d − r (448 for Flash)."""
        return self.head_dim - self.qk_rope_head_dim

    def layer_kind(self, layer: int) -> str:
        return self.layer_kinds[layer]

    def compress_ratio(self, layer: int) -> int:
        """m of spec §5.1: 0 for sliding-window layers, 4 for CSA, 128 for HCA (Flash)."""
        kind = self.layer_kinds[layer]
        return {"swa": 0, "csa": self.compress_rate_csa, "hca": self.compress_rate_hca}[kind]

    def is_hash_layer(self, layer: int) -> bool:
        return self.hash_layers[layer]

    def uses_yarn(self, layer: int) -> bool:
        """YaRN applies only to layers with a compressor, and only when the config carries it (§4.3)."""
        return self.yarn is not None and self.layer_kinds[layer] != "swa"

    # --- validation ----------------------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, fieldname: str, why: str) -> None:
            if not cond:
                raise ConfigError(f"config field '{fieldname}': {why} (config '{self.name}')")

        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in ("int",) and not (isinstance(v, int) and not isinstance(v, bool)):
                raise ConfigError(f"config field '{f.name}': expected an integer, got {v!r} (config '{self.name}')")
        positive = [
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
            "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
            "hc_mult", "hc_sinkhorn_iters", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
            "compress_rate_csa", "compress_rate_hca",
        ]
        for name in positive:
            need(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        need(self.n_shared_experts in (0, 1), "n_shared_experts", f"0 or 1 supported, got {self.n_shared_experts}")
        need(self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
             f"must be positive and even (interleaved pairs), got {self.qk_rope_head_dim}")
        need(self.qk_rope_head_dim <= self.head_dim, "qk_rope_head_dim",
             f"{self.qk_rope_head_dim} exceeds head_dim {self.head_dim}")
        need(self.qk_rope_head_dim <= self.index_head_dim, "index_head_dim",
             f"{self.index_head_dim} must be >= qk_rope_head_dim {self.qk_rope_head_dim} (indexer rotates its last r dims)")
        need(self.num_attention_heads % self.o_groups == 0, "o_groups",
             f"num_attention_heads {self.num_attention_heads} is not divisible by o_groups {self.o_groups}")
        need(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
             f"{self.num_experts_per_tok} > n_routed_experts {self.n_routed_experts}")
        need(self.compress_rate_csa > 1 and self.compress_rate_hca > 1, "compress_rates", "must be > 1")
        need(len(self.layer_kinds) == self.num_hidden_layers, "layer_kinds",
             f"has {len(self.layer_kinds)} entries for num_hidden_layers {self.num_hidden_layers}")
        bad = [k for k in self.layer_kinds if k not in LAYER_KINDS]
        need(not bad, "layer_kinds", f"unknown kinds {bad}; expected one of {LAYER_KINDS}")
        need(len(self.hash_layers) == self.num_hidden_layers, "hash_layers",
             f"has {len(self.hash_layers)} entries for num_hidden_layers {self.num_hidden_layers}")
        need(self.scoring_func == "sqrtsoftplus", "scoring_func",
             f"only 'sqrtsoftplus' (DeepSeek-V4) is implemented, got {self.scoring_func!r}")
        need(self.norm_topk_prob, "norm_topk_prob", "DeepSeek-V4 renormalises the routed weights; false is not implemented")
        need(self.rms_norm_eps > 0 and self.hc_eps > 0, "rms_norm_eps/hc_eps", "must be positive")
        need(not self.tie_word_embeddings, "tie_word_embeddings", "DeepSeek-V4 has a separate head.weight")
        if self.yarn is not None:
            need(self.yarn.factor >= 1, "rope_scaling.factor", f"must be >= 1, got {self.yarn.factor}")

    # --- serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form used in run manifests and `forward` outputs (round-trips with from_dict)."""
        d = dataclasses.asdict(self)
        d["layer_kinds"] = list(self.layer_kinds)
        d["hash_layers"] = list(self.hash_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown config fields {unknown}")
        if d.get("yarn") is not None:
            d["yarn"] = YarnConfig(**d["yarn"])
        d["layer_kinds"] = tuple(d.get("layer_kinds", ()))
        d["hash_layers"] = tuple(bool(x) for x in d.get("hash_layers", ()))
        return cls(**d)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_hf_dict(self) -> dict[str, Any]:
        """transformers' DeepseekV4Config keys (what `save_pretrained` writes), spec §1.1."""
        prf = self.qk_rope_head_dim / self.head_dim
        compress: dict[str, Any] = {"rope_type": "default", "rope_theta": self.compress_rope_theta,
                                    "partial_rotary_factor": prf}
        if self.yarn is not None:
            compress.update(rope_type="yarn", factor=self.yarn.factor,
                            original_max_position_embeddings=self.yarn.original_max_position_embeddings,
                            beta_fast=self.yarn.beta_fast, beta_slow=self.yarn.beta_slow, attention_factor=1.0)
        d: dict[str, Any] = {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "partial_rotary_factor": prf,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window,
            "layer_types": [_HF_LAYER_TYPE[k] for k in self.layer_kinds],
            "compress_rates": {"compressed_sparse_attention": self.compress_rate_csa,
                               "heavily_compressed_attention": self.compress_rate_hca},
            "mlp_layer_types": ["hash_moe" if h else "moe" for h in self.hash_layers],
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_parameters": {"main": {"rope_type": "default", "rope_theta": self.rope_theta,
                                         "partial_rotary_factor": prf},
                                "compress": compress},
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "scoring_func": self.scoring_func,
            "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": self.norm_topk_prob,
            "swiglu_limit": self.swiglu_limit,
            "rms_norm_eps": self.rms_norm_eps,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.quantization_config:
            d["quantization_config"] = dict(self.quantization_config)
        return d


# --------------------------------------------------------------------------------------------
# Reading config.json
# --------------------------------------------------------------------------------------------

def _kinds_from_ratios(ratios: list[Any], n_layers: int, csa: int, hca: int, where: str) -> tuple[str, ...]:
    if not isinstance(ratios, list) or len(ratios) < n_layers:
        raise ConfigError(f"{where}: field 'compress_ratios' must be a list with at least num_hidden_layers "
                          f"({n_layers}) entries, got {ratios!r}")
    # The released list has one extra entry for the MTP block (44 for 43 layers): cut it, as transformers does.
    kinds = []
    for i, r in enumerate(ratios[:n_layers]):
        if r == 0:
            kinds.append("swa")
        elif r == csa:
            kinds.append("csa")
        elif r == hca:
            kinds.append("hca")
        else:
            raise ConfigError(f"{where}: field 'compress_ratios[{i}]' = {r!r}; expected 0, {csa} or {hca}")
    return tuple(kinds)


def _yarn_from(params: dict[str, Any] | None, where: str) -> YarnConfig | None:
    if not params:
        return None
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "yarn":
        raise ConfigError(f"{where}: field 'rope_type' = {rope_type!r}; only 'default' and 'yarn' are defined for V4")
    try:
        return YarnConfig(
            factor=float(params["factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            beta_fast=float(params.get("beta_fast", 32.0)),
            beta_slow=float(params.get("beta_slow", 1.0)),
        )
    except KeyError as e:
        raise ConfigError(f"{where}: yarn rope parameters lack field {e.args[0]!r}") from None


def config_from_hf_dict(raw: dict[str, Any], name: str = "checkpoint", where: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from a real `config.json` (released legacy keys or transformers keys)."""
    def get(key: str, default: Any = None, required: bool = False) -> Any:
        if key in raw:
            return raw[key]
        if required:
            raise ConfigError(f"{where}: required field '{key}' is missing")
        return default

    n_layers = int(get("num_hidden_layers", required=True))
    head_dim = int(get("head_dim", required=True))
    rates = get("compress_rates") or {}
    csa = int(rates.get("compressed_sparse_attention", get("compress_rate_csa", 4)))
    hca = int(rates.get("heavily_compressed_attention", get("compress_rate_hca", 128)))

    if get("layer_types") is not None:
        lt = get("layer_types")
        if not isinstance(lt, list) or len(lt) < n_layers:
            raise ConfigError(f"{where}: field 'layer_types' must list num_hidden_layers ({n_layers}) entries")
        bad = [t for t in lt[:n_layers] if t not in _KIND_OF_HF_LAYER_TYPE]
        if bad:
            raise ConfigError(f"{where}: field 'layer_types' has unknown entries {bad}")
        kinds = tuple(_KIND_OF_HF_LAYER_TYPE[t] for t in lt[:n_layers])
    elif get("compress_ratios") is not None:
        kinds = _kinds_from_ratios(get("compress_ratios"), n_layers, csa, hca, where)
    else:
        raise ConfigError(f"{where}: neither 'layer_types' nor 'compress_ratios' is present; refusing to guess the "
                          "layer schedule (transformers would silently fall back to the Pro pattern)")

    if get("mlp_layer_types") is not None:
        mlt = get("mlp_layer_types")
        if not isinstance(mlt, list) or len(mlt) < n_layers or any(t not in ("hash_moe", "moe") for t in mlt):
            raise ConfigError(f"{where}: field 'mlp_layer_types' must list 'hash_moe'/'moe' for every layer")
        hash_layers = tuple(t == "hash_moe" for t in mlt[:n_layers])
    else:
        n_hash = int(get("num_hash_layers", 3))
        hash_layers = tuple(i < n_hash for i in range(n_layers))

    if get("qk_rope_head_dim") is not None:
        rope_dim = int(get("qk_rope_head_dim"))
    else:
        prf = get("partial_rotary_factor")
        if prf is None:
            rp = get("rope_parameters") or {}
            prf = (rp.get("main") or rp).get("partial_rotary_factor", 64 / 512)
        rope_dim = int(head_dim * float(prf))  # transformers' own rule (spec §1.1)

    rp = get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
        yarn = _yarn_from(rp["compress"], where)
        rope_theta = float(rp.get("main", {}).get("rope_theta", get("rope_theta", 10000.0)))
        compress_theta = float(rp["compress"].get("rope_theta", get("compress_rope_theta", 160000.0)))
    else:
        yarn = _yarn_from(get("rope_scaling") or rp, where)
        rope_theta = float(get("rope_theta", 10000.0))
        compress_theta = float(get("compress_rope_theta", 160000.0))

    eos = get("eos_token_id", 1)
    if isinstance(eos, list):
        eos = eos[0]
    try:
        return ModelConfig(
            name=name,
            vocab_size=int(get("vocab_size", required=True)),
            hidden_size=int(get("hidden_size", required=True)),
            num_hidden_layers=n_layers,
            num_attention_heads=int(get("num_attention_heads", required=True)),
            head_dim=head_dim,
            qk_rope_head_dim=rope_dim,
            q_lora_rank=int(get("q_lora_rank", required=True)),
            o_groups=int(get("o_groups", required=True)),
            o_lora_rank=int(get("o_lora_rank", required=True)),
            sliding_window=int(get("sliding_window", 128)),
            layer_kinds=kinds,
            compress_rate_csa=csa,
            compress_rate_hca=hca,
            rope_theta=rope_theta,
            compress_rope_theta=compress_theta,
            yarn=yarn,
            index_n_heads=int(get("index_n_heads", required=True)),
            index_head_dim=int(get("index_head_dim", required=True)),
            index_topk=int(get("index_topk", required=True)),
            hc_mult=int(get("hc_mult", 4)),
            hc_sinkhorn_iters=int(get("hc_sinkhorn_iters", 20)),
            hc_eps=float(get("hc_eps", 1e-6)),
            n_routed_experts=int(get("n_routed_experts", required=True)),
            n_shared_experts=int(get("n_shared_experts", 1)),
            num_experts_per_tok=int(get("num_experts_per_tok", required=True)),
            hash_layers=hash_layers,
            moe_intermediate_size=int(get("moe_intermediate_size", required=True)),
            scoring_func=str(get("scoring_func", "sqrtsoftplus")),
            routed_scaling_factor=float(get("routed_scaling_factor", 1.5)),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            swiglu_limit=float(get("swiglu_limit", 10.0)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            bos_token_id=int(get("bos_token_id", 0)),
            eos_token_id=int(eos),
            max_position_embeddings=int(get("max_position_embeddings", 1048576)),
            num_nextn_predict_layers=int(get("num_nextn_predict_layers", 0)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            quantization_config=dict(get("quantization_config") or {}),
        )
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise ConfigError(f"{where}: {e}") from None
        raise ConfigError(f"{where}: {e}") from None


def load_config_json(path: str | Path) -> ModelConfig:
    """Read `config.json` (a file, or a checkpoint directory containing one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a JSON object at top level")
    return config_from_hf_dict(raw, name=p.parent.name or "checkpoint", where=str(p))


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------

def _flash_kinds(n_layers: int = 43) -> tuple[str, ...]:
    """Flash schedule (spec §1.2): `compress_ratios = [0, 0] + [4, 128]*20 + [4, 0]`, cut to 43 layers."""
    ratios = [0, 0] + [4, 128] * 20 + [4]
    return _kinds_from_ratios(ratios, n_layers, 4, 128, "flash preset")


def _hash_first(n_layers: int, n_hash: int = 3) -> tuple[bool, ...]:
    return tuple(i < n_hash for i in range(n_layers))


FLASH = ModelConfig(
    name="flash",
    layer_kinds=_flash_kinds(),
    hash_layers=_hash_first(43),
    yarn=YarnConfig(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0),
    quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
)
"""Exact DeepSeek-V4-Flash (spec §1.1)."""

FLASH_MINI = FLASH.replace(
    name="flash-mini",
    hidden_size=64,
    num_attention_heads=2,  # attention cost on 2 CPU cores scales with heads × keys
    head_dim=64,
    qk_rope_head_dim=8,  # r/d = 1/8 as in Flash (64/512)
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=32,
    index_n_heads=4,
    index_head_dim=32,  # d_I/d = 1/4 as in Flash (128/512)
    n_routed_experts=16,
    moe_intermediate_size=64,
)
"""Flash's 43-layer schedule (2 SWA, 21 CSA, 20 HCA, hash routing on 0-2), window 128, ratios 4/128,
index_topk 512, hc 4, 20 Sinkhorn iterations, top-6 routing, real vocabulary and special ids and YaRN,
with widths small enough for 2 CPU cores."""

TINY = FLASH.replace(
    name="tiny",
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=5,
    layer_kinds=("swa", "swa", "csa", "hca", "csa"),
    hash_layers=(True, True, True, False, False),
    num_attention_heads=4,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=32,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=16,
    n_routed_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=32,
    yarn=YarnConfig(factor=4.0, original_max_position_embeddings=512, beta_fast=32.0, beta_slow=1.0),
)
"""Five layers (SWA, SWA, CSA, HCA, CSA; hash routing on 0-2) for unit tests: every layer type, both
routings, more compressed rows than index_topk after ~70 tokens."""

PRESETS: dict[str, ModelConfig] = {c.name: c for c in (FLASH, FLASH_MINI, TINY)}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None
