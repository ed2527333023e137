"""transformers' ``DeepseekV4ForCausalLM`` as an independent fp32 oracle for the project's tests.

The reference implementation (``reference/``) is written from the spec, never from transformers'
code. To check it, tests build a tiny DeepSeek-V4 in transformers with non-trivial random weights,
export those exact weights under the official checkpoint names, run both models on the same ids and
compare logits and per-layer hyper-connection streams. This module only *drives* transformers; it
copies none of its code. Everything here is fp32 on whatever device the model sits on (CPU in CI).

Public API
----------
- :func:`tiny_hf_config`          tiny fp32 configs ("flash-like", "yarn", "distinct-eps",
                                  "swiglu-clamp", "stress") with Flash's layer schedule.
- :func:`build_hf_model`          seeded model in eval mode; every parameter and persistent buffer
                                  (including those HF zero-initialises) is filled with random values.
- :func:`stable_topk`             context manager: every top-k breaks exact ties by the LOWER index.
- :func:`hf_run`                  logits, per-layer output streams and (optionally) the indexer's
                                  and routers' selections, in one pass.
- :func:`hf_logits`               fp32 logits ``[n_tokens, vocab]`` for every position.
- :func:`hf_layer_outputs`        per-layer output streams ``[T, hc_mult, hidden]``.
- :func:`save_hf_checkpoint`      ``save_pretrained`` (safetensors, optionally sharded).
- :func:`hf_weights_state_dict`   the model's tensors under the OFFICIAL names (spec §8.3).
- :func:`official_name`           one transformers-saved key -> official key.

Why the traps handled here matter (spec §4.3, §5.3, §10.2, §11; DESIGN §10):
- transformers' config defaults to the V4-**Pro** layer schedule; we always pass ``layer_types``.
- transformers zero-initialises attention sinks, compressor position biases (``ape``), the router's
  ``e_score_correction_bias`` and ``tid2eid`` (so every hash layer would route every token to
  expert 0), and sets all norm weights to 1, HC ``base`` to 0 and HC ``scale`` to 1. With those
  values whole code paths are invisible to a comparison; :func:`build_hf_model` randomises them.
- ``torch.topk`` orders exact ties by nothing stable, and the indexer's ReLU plateau makes exact ties
  common in tiny models: without :func:`stable_topk` HF's own logits change with the number of
  candidate rows (chunked vs one-shot disagree) and no reference can match it.
- ``use_cache=False`` silently drops every compressor's trailing incomplete window, so it cannot be
  continued; :func:`hf_logits` always runs through a ``DynamicCache`` (prefill chunks of any size,
  then teacher-forced one-token decode steps).
- A hand-written YaRN config that is already nested (``rope_parameters={"main":..., "compress":...}``)
  without ``attention_factor`` makes HF scale cos/sin by 0.1·ln(s)+1 (not official semantics);
  :func:`tiny_hf_config` passes the flat form, lets HF inject ``attention_factor=1.0`` and asserts it.
- ``save_pretrained`` writes official-looking names except in four places (spec §8.3/§11.16);
  :func:`hf_weights_state_dict` fixes exactly those.

Import it from a test as ``from hf_oracle import ...`` (pytest puts ``tests/`` on ``sys.path``
because ``tests/`` has no ``__init__.py``).
"""

from __future__ import annotations

import contextlib
import re
import tempfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import transformers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.cache_utils import DynamicCache

__all__ = [
    "TINY_KINDS",
    "flash_layer_types",
    "tiny_hf_config",
    "build_hf_model",
    "stable_topk",
    "HFRun",
    "hf_run",
    "hf_logits",
    "hf_layer_outputs",
    "save_hf_checkpoint",
    "official_name",
    "hf_weights_state_dict",
]

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

TINY_KINDS = ("flash-like", "yarn", "distinct-eps", "swiglu-clamp", "stress")
"""Names accepted by :func:`tiny_hf_config`."""

# YaRN of the "yarn"/"stress" kinds: small enough that it bends most of the r/2 = 8 frequencies
# (low = 0, high = 3 for r = 16, theta = 160000), so dropping YaRN or adding mscale is visible.
_TINY_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 512,
    "beta_fast": 32,
    "beta_slow": 1,
}


# ------------------------------------------------------------------------------------------------
# 1. Configs
# ------------------------------------------------------------------------------------------------

def flash_layer_types(n_layers: int) -> list[str]:
    """Flash's attention schedule cut to ``n_layers``: SWA, SWA, then CSA/HCA alternating from CSA.

    (Flash's ``compress_ratios = [0, 0] + [4, 128]*20 + [4]``, spec §1.2.) Passed explicitly because
    transformers falls back to the V4-Pro pattern (HCA, HCA, ...) when ``layer_types`` is missing.
    """
    return [SWA if i < 2 else (CSA if i % 2 == 0 else HCA) for i in range(n_layers)]


def tiny_hf_config(kind: str = "flash-like", **overrides) -> DeepseekV4Config:
    """A tiny fp32 ``DeepseekV4Config`` that still exercises every DeepSeek-V4 code path.

    Kinds (see :data:`TINY_KINDS`):

    - ``"flash-like"``: 7 layers [SWA, SWA, CSA, HCA, CSA, HCA, CSA], hash MoE on layers 0-2 and
      learned top-k on 3-6; hidden 64, 4 heads x head_dim 128, partial_rotary_factor 1/8 -> r = 16;
      q_lora_rank 32, o_groups 2, o_lora_rank 32; indexer 4 heads x 64 dims (RoPE on its last
      r = 16 dims, not d_I/2), index_topk 24 so that at ~1000 tokens there are ~250 candidate
      compressed rows, ten times more than the top-k keeps; sliding_window 128, compress rates 4/128;
      10 routed experts, top-4, moe_intermediate 32, 1 shared expert; hc_mult 4, 20 Sinkhorn
      iterations; vocab 512 (random ids are valid); no YaRN (compressed layers: plain RoPE,
      theta = 160000; SWA layers: theta = 10000).
    - ``"yarn"``: flash-like plus YaRN (factor 4, original_max_position_embeddings 512, beta_fast
      32, beta_slow 1) on the compressed layers only, with ``attention_factor`` 1.0 (asserted).
    - ``"distinct-eps"``: flash-like with rms_norm_eps = 5e-3 != hc_eps = 2e-2, large enough that
      using the wrong epsilon anywhere (RMS factors vs HC offsets, spec §3.1) moves logits far above
      fp32 noise (swapping the two changes logits by ~23% relative L2).
    - ``"swiglu-clamp"``: flash-like with swiglu_limit = 0.3, so the one-sided gate clamp and the
      two-sided up clamp of routed and shared experts bite (measured with :func:`build_hf_model`
      weights: ~40% of gate and ~80% of up pre-activations are clamped; with 10.0 a tiny model never
      reaches the clamp).
    - ``"stress"``: yarn + distinct-eps + swiglu-clamp together.

    ``overrides`` are passed straight to ``DeepseekV4Config`` (unknown keys raise). Overriding
    ``num_hidden_layers`` alone regenerates ``layer_types`` (:func:`flash_layer_types`) and
    ``mlp_layer_types`` (hash on the first 3 layers) for the new depth. A ``rope_parameters`` /
    ``rope_scaling`` override must be the flat (un-nested) form so HF injects attention_factor 1.0.
    """
    if kind not in TINY_KINDS:
        raise ValueError(f"unknown tiny config kind {kind!r}; choose one of {TINY_KINDS}")
    n_layers = int(overrides.get("num_hidden_layers", 7))
    kw: dict = dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=128,
        partial_rotary_factor=16 / 128,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=32,
        sliding_window=128,
        layer_types=flash_layer_types(n_layers),
        compress_rates={CSA: 4, HCA: 128},
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        index_n_heads=4,
        index_head_dim=64,
        index_topk=24,
        n_routed_experts=10,
        n_shared_experts=1,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        mlp_layer_types=["hash_moe" if i < 3 else "moe" for i in range(n_layers)],
        scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5,
        norm_topk_prob=True,
        swiglu_limit=10.0,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        rms_norm_eps=1e-6,
        max_position_embeddings=65536,
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
        bos_token_id=0,
        eos_token_id=1,
    )
    if kind in ("yarn", "stress"):
        kw["rope_parameters"] = dict(_TINY_YARN)
        # HF warns unless max_position_embeddings == factor * original_max_position_embeddings; the
        # value has no other effect on these rope types.
        kw["max_position_embeddings"] = int(_TINY_YARN["factor"] * _TINY_YARN["original_max_position_embeddings"])
    if kind in ("distinct-eps", "stress"):
        kw["rms_norm_eps"] = 5e-3
        kw["hc_eps"] = 2e-2
    if kind in ("swiglu-clamp", "stress"):
        kw["swiglu_limit"] = 0.3
    kw.update(overrides)
    if "rope_scaling" in overrides:  # legacy spelling: let HF fold it, do not pass both
        kw.pop("rope_parameters", None)
    kw.setdefault("dtype", "float32")

    config = DeepseekV4Config(**kw)
    config._attn_implementation = "eager"  # the only backend V4 supports; sinks need it

    compress = config.rope_parameters["compress"]
    if compress.get("rope_type") == "yarn" and float(compress.get("attention_factor", -1.0)) != 1.0:
        raise AssertionError(
            f"YaRN config would get mscale on cos/sin (attention_factor={compress.get('attention_factor')}); "
            "pass the flat rope_parameters form so HF injects attention_factor=1.0 (spec §4.3)"
        )
    if config.rope_parameters["main"].get("rope_type", "default") != "default":
        raise AssertionError("SWA layers must never get YaRN (spec §4.3)")
    return config


# ------------------------------------------------------------------------------------------------
# 2. Model with non-trivial deterministic weights
# ------------------------------------------------------------------------------------------------

def _generator(seed: int, name: str) -> torch.Generator:
    """One CPU generator per (seed, tensor name): values do not depend on iteration order."""
    g = torch.Generator(device="cpu")
    g.manual_seed((int(seed) * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63 - 1))
    return g


def _randn(shape: Sequence[int], g: torch.Generator) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32)


def _norm_weight(n: int, g: torch.Generator, center: float = 1.0) -> torch.Tensor:
    """center * (1 + 0.1 N(0,1)) with ~3% outlier channels scaled by 2-4 (realistic RMSNorm weights)."""
    w = center * (1.0 + 0.1 * _randn([n], g))
    n_out = max(1, n // 32)
    idx = torch.randperm(n, generator=g)[:n_out]
    w[idx] *= 2.0 + 2.0 * torch.rand(n_out, generator=g)
    return w


def _random_value(name: str, t: torch.Tensor, config: DeepseekV4Config, seed: int, sharpness: float) -> torch.Tensor:
    """The value for one named tensor (transformers' module names)."""
    g = _generator(seed, name)
    shape = list(t.shape)
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("tid2eid"):
        # valid expert ids, distinct within each row (a real hash table never repeats an expert)
        e, k = config.n_routed_experts, shape[-1]
        return torch.rand(shape[0], e, generator=g).argsort(dim=1)[:, :k].to(torch.long)
    if name.endswith("e_score_correction_bias"):
        # same order as the spread of sqrt(softplus(logit)) scores (~0.1-0.3): changes selections
        return 0.15 * _randn(shape, g)
    if name.endswith("self_attn.sinks"):
        return 0.5 + _randn(shape, g)
    if name.endswith("position_bias"):  # compressor / indexer-compressor ape [m, c*d]
        return 0.7 * _randn(shape, g)
    if name.endswith(("attn_hc.fn", "ffn_hc.fn", "hc_head.hc_fn")):
        return _randn(shape, g) / shape[-1] ** 0.5  # mixes of the RMS-normalised streams ~ N(0, 1)
    if name.endswith(("attn_hc.base", "ffn_hc.base", "hc_head.hc_base")):
        return 0.5 * _randn(shape, g)
    if name.endswith(("attn_hc.scale", "ffn_hc.scale", "hc_head.hc_scale")):
        return 0.5 + torch.rand(shape, generator=g)
    if leaf == "weight" and len(shape) == 1:  # every RMSNorm weight
        # q and kv are RMS-normalised before the score, so scaling wq/wkv does nothing to the
        # softmax; the weights of the kv norms are the lever that makes attention peaky.
        if re.search(r"self_attn\.kv_norm\.weight$|self_attn\.compressor\.kv_norm\.weight$", name):
            return _norm_weight(shape[0], g, center=sharpness)
        return _norm_weight(shape[0], g)
    if name.endswith("embed_tokens.weight"):
        return _randn(shape, g)
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return _randn(shape, g) / shape[-1] ** 0.5
    if leaf == "weight" and len(shape) == 2:  # every nn.Linear (incl. lm_head, router, grouped wo_a)
        return _randn(shape, g) / shape[-1] ** 0.5
    raise KeyError(f"build_hf_model does not know how to randomise {name!r} {tuple(shape)}; "
                   "transformers' DeepseekV4 has a tensor this helper was not written for")


@torch.no_grad()
def build_hf_model(config: DeepseekV4Config, seed: int, sharpness: float = 2.5,
                   device: str | torch.device = "cpu") -> DeepseekV4ForCausalLM:
    """A ``DeepseekV4ForCausalLM`` in fp32 eval mode with deterministic, non-trivial weights.

    Every parameter and persistent buffer is overwritten from a CPU ``torch.Generator`` seeded by
    ``(seed, tensor name)`` (independent of iteration order, device and of transformers' own init).
    Tensors that transformers leaves at zero / identity and that are therefore randomised here:

    - ``self_attn.sinks`` (HF: 0)                                  -> 0.5 + N(0, 1)
    - ``compressor.position_bias`` (CSA & HCA ape, HF: 0),
      ``compressor.indexer.position_bias`` (HF: 0)                 -> 0.7 N(0, 1)
    - ``mlp.gate.e_score_correction_bias`` (buffer, HF: 0)         -> 0.15 N(0, 1)
    - ``mlp.gate.tid2eid`` (int64 buffer, HF: 0 = all to expert 0) -> random distinct expert ids per row
    - ``attn_hc.base``, ``ffn_hc.base``, ``hc_head.hc_base`` (HF: 0) -> 0.5 N(0, 1)
    - ``attn_hc.scale``, ``ffn_hc.scale``, ``hc_head.hc_scale`` (HF: 1) -> U(0.5, 1.5)
    - every RMSNorm weight (``input_layernorm``, ``post_attention_layernorm``, ``q_a_norm``,
      ``kv_norm``, ``compressor.kv_norm``, ``compressor.indexer.kv_norm``, ``model.norm``; HF: 1)
      -> 1 + 0.1 N(0, 1) with ~3% outlier channels x2..4; the attention ``kv_norm`` and the main
      compressor ``kv_norm`` are centred on ``sharpness`` instead of 1 (see below).

    Everything else (embeddings N(0,1); linears, grouped ``o_a_proj``, router, experts, indexer
    ``weights_proj``, ``lm_head``, HC ``fn``: N(0, 1/fan_in)) is re-drawn too, so no value comes
    from transformers' initialiser. Non-persistent RoPE ``inv_freq`` buffers are left as HF built
    them (they are derived from the config, not weights).

    Peakiness: q is RMS-normalised per head (unweighted) and kv by a weighted RMSNorm, so scaling
    ``q_b_proj``/``kv_proj`` would not change any attention score. Scores scale with the kv_norm
    weights instead: with ``sharpness`` 2.5 the per-head scores have a standard deviation of about
    2.5-3. Measured on the flash-like config at 1100 tokens: the most attended key gets ~0.3 of a
    query's mass on average (entropy ~2.6 nats over 128-400 keys), and changing only the tie order
    of the indexer top-k moves the logits by ~8% - selection matters. All activations stay O(1) and
    finite (checked on a short probe before returning).
    """
    config = config if isinstance(config, DeepseekV4Config) else DeepseekV4Config(**config)
    torch_default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float32)
        model = DeepseekV4ForCausalLM(config)
    finally:
        torch.set_default_dtype(torch_default)
    model.config._attn_implementation = "eager"
    model = model.to(torch.float32)

    persistent = {n for n, _ in model.named_buffers() if _is_persistent_buffer(model, n)}
    for name, t in list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n in persistent]:
        value = _random_value(name, t, config, seed, sharpness)
        if value.shape != t.shape:
            raise AssertionError(f"{name}: built {tuple(value.shape)}, model has {tuple(t.shape)}")
        t.copy_(value.to(t.dtype))

    if model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr():
        raise AssertionError("lm_head is tied to embed_tokens; DeepSeek-V4 keeps them separate (spec §11.12)")
    model = model.to(device).eval()
    model.requires_grad_(False)

    # sanity: no NaN/inf, and nothing left constant
    for name, t in model.state_dict().items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise AssertionError(f"{name} is not finite")
        if t.numel() > 1 and bool((t == t.reshape(-1)[0]).all()):
            raise AssertionError(f"{name} is constant after randomisation")
    probe = torch.arange(min(40, config.vocab_size), device=device)[None]
    with torch.no_grad():
        logits = model(input_ids=probe, use_cache=False).logits
    if not torch.isfinite(logits).all():
        raise AssertionError("non-finite logits from the randomised model")
    return model


def _is_persistent_buffer(model: torch.nn.Module, full_name: str) -> bool:
    mod_name, _, leaf = full_name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    return leaf not in getattr(mod, "_non_persistent_buffers_set", set())


# ------------------------------------------------------------------------------------------------
# 3. Stable top-k
# ------------------------------------------------------------------------------------------------

def _stable_topk_impl(input: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True,
                      *, out=None):
    """``torch.topk`` with a defined tie order: equal values keep ascending index order.

    Values come back sorted (descending for ``largest=True``, ascending otherwise) even for
    ``sorted=False`` - a valid answer to that call, whose order is unspecified anyway - and the
    result is the same ``torch.return_types.topk`` named tuple (``.values``, ``.indices``, tuple
    unpacking) that callers of ``torch.topk`` expect.
    """
    if out is not None:
        raise NotImplementedError("stable_topk does not support out=")
    values, indices = torch.sort(input, dim=dim, descending=largest, stable=True)
    n = input.shape[dim] if input.dim() else 1
    if not 0 <= k <= n:
        raise RuntimeError(f"selected index k out of range (k={k}, size={n})")
    if input.dim() == 0:
        return torch.return_types.topk((values, indices))
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


@contextlib.contextmanager
def stable_topk() -> Iterator[None]:
    """Make every top-k in the process break exact ties by the LOWER index while the block runs.

    Why: ``torch.topk`` leaves the order of equal values unspecified, and in practice it depends on
    the number of candidates and the device (DESIGN §10). DeepSeek-V4's Lightning Indexer score is
    a weighted sum of ReLUs, exactly 0 on every compressed row where all heads' q.k <= 0; with few
    indexer heads such plateaus are common and the top-k boundary often cuts through one (spec §5.3).
    With native ``torch.topk`` HF then selects different rows for the same query depending on how
    many rows exist - a prompt prefix and the whole prompt, or chunked and one-shot prefill,
    disagree (measured on the flash-like tiny model, 1100 tokens: chunks of 367 vs one shot differ by
    6.6% relative L2, max |delta logit| 2.3; 2.4e-6 under this patch) - and no reference could match it. The project's rule,
    implemented by the reference, is: among equal scores the lower row / expert index wins. The
    same patch covers expert routing (``torch.topk(..., sorted=False)`` in the router).

    How: transformers' DeepseekV4 calls top-k in two spellings - ``torch.topk(...)`` in the router
    and the tensor method ``index_scores.topk(...)`` in the indexer - so BOTH ``torch.topk`` and
    ``torch.Tensor.topk`` are replaced by a ``torch.sort(..., stable=True)``-based version and
    restored on exit. The patch is process-global (not thread-safe) for the duration of the block.
    Cost: a full sort instead of a selection, fine at oracle sizes.
    """
    saved_fn = torch.topk
    had_own_method = "topk" in torch.Tensor.__dict__  # normally inherited from torch._C.TensorBase
    saved_method = torch.Tensor.__dict__.get("topk")
    torch.topk = _stable_topk_impl
    torch.Tensor.topk = _stable_topk_impl
    try:
        yield
    finally:
        torch.topk = saved_fn
        if had_own_method:
            torch.Tensor.topk = saved_method
        else:
            del torch.Tensor.topk


# ------------------------------------------------------------------------------------------------
# 4./5. Running the oracle: logits and per-layer streams
# ------------------------------------------------------------------------------------------------

@dataclass
class HFRun:
    """Result of :func:`hf_run` (all on CPU, fp32, batch dimension dropped)."""

    logits: torch.Tensor
    """``[n_tokens, vocab]`` - logits at every position (prompt and decode steps)."""
    layer_outputs: list[torch.Tensor] | None
    """per decoder layer, its output streams ``[n_tokens, hc_mult, hidden]`` (None if not asked)."""
    segments: list[tuple[str, int, int]]
    """how the ids were fed: ``("prefill"|"decode", start, stop)`` per forward call."""
    indexer_topk: dict[int, torch.Tensor] | None = None
    """per CSA layer, the compressed rows its Lightning Indexer selected ``[n_tokens, index_topk]``
    (int64, in score order under stable ties, ``-1`` = no row: fewer causal rows than index_topk).
    Only with ``record_selections=True``."""
    expert_ids: dict[int, torch.Tensor] | None = None
    """per MoE layer, the routed experts ``[n_tokens, num_experts_per_tok]`` (hash layers: tid2eid
    rows; learned layers: top-k of the biased scores). Only with ``record_selections=True``."""


def _chunk_plan(n_prompt: int, chunk_sizes: Sequence[int] | None) -> list[int]:
    """Chunk lengths covering ``n_prompt`` tokens; the last given size repeats, the tail is cut."""
    if n_prompt == 0:
        return []
    if not chunk_sizes:
        return [n_prompt]
    sizes = [int(c) for c in chunk_sizes]
    if any(c <= 0 for c in sizes):
        raise ValueError(f"chunk sizes must be positive, got {sizes}")
    plan, done, i = [], 0, 0
    while done < n_prompt:
        c = min(sizes[min(i, len(sizes) - 1)], n_prompt - done)
        plan.append(c)
        done += c
        i += 1
    return plan


def _check_no_tf32() -> None:
    if torch.get_float32_matmul_precision() != "highest":
        raise RuntimeError("fp32 matmuls would run as TF32/bf16 (torch.set_float32_matmul_precision is "
                           f"{torch.get_float32_matmul_precision()!r}); the oracle needs 'highest'")
    if torch.cuda.is_available() and (torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32):
        raise RuntimeError("TF32 is enabled (torch.backends.cuda.matmul/cudnn.allow_tf32); the oracle is fp32")


@torch.no_grad()
def hf_run(model: DeepseekV4ForCausalLM, input_ids: Sequence[int] | torch.Tensor,
           chunk_sizes: Sequence[int] | None = None, decode_steps: int = 0, *,
           decode_ids: Sequence[int] | None = None, layer_outputs: bool = False,
           record_selections: bool = False, stable_ties: bool = True) -> HFRun:
    """Run the oracle over one sequence through transformers' own cache; see :func:`hf_logits`.

    ``layer_outputs=True`` additionally records every decoder layer's output streams, and
    ``record_selections=True`` every CSA layer's indexer selection and every MoE layer's expert ids,
    with forward hooks (removed afterwards). Selections let a test tell a real disagreement from a
    near-tie flip: fp32 noise of ~1e-6 can swap two indexer rows whose scores differ by ~1e-5
    relative, which moves later logits by 1e-5..1e-3 (spec §11.13).
    """
    _check_no_tf32()
    ids = torch.as_tensor(list(input_ids) if not isinstance(input_ids, torch.Tensor) else input_ids,
                          dtype=torch.long).reshape(-1)
    if decode_ids is not None:
        if decode_steps not in (0, len(decode_ids)):
            raise ValueError("give either decode_steps (the last ids of input_ids are decoded) or decode_ids")
        ids = torch.cat([ids, torch.as_tensor(list(decode_ids), dtype=torch.long).reshape(-1)])
        decode_steps = len(decode_ids)
    n = ids.numel()
    if not 0 <= decode_steps <= n:
        raise ValueError(f"decode_steps={decode_steps} out of range for {n} ids")
    if n == 0:
        raise ValueError("no input ids")
    vocab = model.config.vocab_size
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"token ids must lie in [0, {vocab})")
    n_prompt = n - decode_steps
    segments = []
    start = 0
    for c in _chunk_plan(n_prompt, chunk_sizes):
        segments.append(("prefill", start, start + c))
        start += c
    for t in range(n_prompt, n):
        segments.append(("decode", t, t + 1))

    device = next(model.parameters()).device
    captured: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    hooks = []
    if layer_outputs:
        def make_hook(i: int):
            def hook(_module, _args, output):
                out = output[0] if isinstance(output, (tuple, list)) else output
                captured[i].append(out.detach()[0].to("cpu", torch.float32).clone())
            return hook
        hooks = [layer.register_forward_hook(make_hook(i)) for i, layer in enumerate(model.model.layers)]
    picked_rows: dict[int, list[torch.Tensor]] = {}
    picked_experts: dict[int, list[torch.Tensor]] = {}
    if record_selections:
        k_I = model.config.index_topk

        def rows_hook(i: int):
            def hook(_module, _args, output):
                rows = output[0].detach().to("cpu", torch.long)
                pad = rows.new_full((rows.shape[0], k_I - rows.shape[1]), -1)
                picked_rows[i].append(torch.cat([rows, pad], dim=1))
            return hook

        def experts_hook(i: int):
            def hook(_module, _args, output):
                picked_experts[i].append(output[2].detach().to("cpu", torch.long).clone())
            return hook

        for i, layer in enumerate(model.model.layers):
            compressor = layer.self_attn.compressor
            if compressor is not None and hasattr(compressor, "indexer"):
                picked_rows[i] = []
                hooks.append(compressor.indexer.register_forward_hook(rows_hook(i)))
            picked_experts[i] = []
            hooks.append(layer.mlp.gate.register_forward_hook(experts_hook(i)))

    was_training = model.training
    model.eval()
    logits_parts = []
    ctx = stable_topk() if stable_ties else contextlib.nullcontext()
    try:
        with ctx:
            cache = DynamicCache(config=model.config)
            for _phase, a, b in segments:
                out = model(
                    input_ids=ids[a:b][None].to(device),
                    position_ids=torch.arange(a, b, device=device)[None],
                    cache=cache,
                    use_cache=True,
                )
                cache = out.cache if getattr(out, "cache", None) is not None else cache
                logits_parts.append(out.logits[0].to("cpu", torch.float32))
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)

    logits = torch.cat(logits_parts, dim=0)
    layers = [torch.cat(parts, dim=0) for parts in captured] if layer_outputs else None
    run = HFRun(logits=logits, layer_outputs=layers, segments=segments)
    if record_selections:
        run.indexer_topk = {i: torch.cat(v, dim=0) for i, v in picked_rows.items()}
        run.expert_ids = {i: torch.cat(v, dim=0) for i, v in picked_experts.items()}
    return run


def hf_logits(model: DeepseekV4ForCausalLM, input_ids: Sequence[int] | torch.Tensor,
              chunk_sizes: Sequence[int] | None = None, decode_steps: int = 0, *,
              decode_ids: Sequence[int] | None = None, stable_ties: bool = True) -> torch.Tensor:
    """fp32 logits ``[n_tokens, vocab]`` (CPU) at every position of one sequence.

    The sequence is ``input_ids`` (+ ``decode_ids`` if given). It is fed through ONE
    ``DynamicCache`` built from the model's config (transformers' own CSA/HCA cache layers):

    - prefill: the first ``n_tokens - decode_steps`` ids, in chunks of ``chunk_sizes`` (consumed in
      order, the last size repeats, the final chunk is whatever is left; ``None`` = one chunk);
    - decode: the remaining ``decode_steps`` ids one token per forward call, teacher-forced.

    Two equivalent ways to ask for decode steps: ``hf_logits(m, prompt + cont, decode_steps=len(cont))``
    or ``hf_logits(m, prompt, decode_ids=cont)``.

    The cached path is used even for a single chunk because ``use_cache=False`` drops every
    compressor's trailing incomplete window (spec §10.2); with the cache, any chunking gives the same
    result up to fp32 noise (measured <= ~2e-6 relative L2 with stable ties). Position ids are
    absolute. ``stable_ties`` (default) runs under :func:`stable_topk`; pass False only to observe
    transformers' native tie order.
    """
    return hf_run(model, input_ids, chunk_sizes, decode_steps, decode_ids=decode_ids,
                  stable_ties=stable_ties).logits


def hf_layer_outputs(model: DeepseekV4ForCausalLM, input_ids: Sequence[int] | torch.Tensor,
                     chunk_sizes: Sequence[int] | None = None, decode_steps: int = 0, *,
                     decode_ids: Sequence[int] | None = None, stable_ties: bool = True) -> list[torch.Tensor]:
    """Per decoder layer, its output hyper-connection streams ``[n_tokens, hc_mult, hidden]`` (fp32, CPU).

    Entry ``L`` is the residual-stream state after block ``L`` (after both its attention and MoE
    sub-layers, before the next block's HC_pre); layer ``L+1``'s input. Chunks and decode steps are
    handled exactly as in :func:`hf_logits` and concatenated along the token axis, so tests can
    compare a reference layer by layer at every position. Captured with forward hooks on
    ``model.model.layers[L]``; use :func:`hf_run` to get logits from the same pass.
    """
    return hf_run(model, input_ids, chunk_sizes, decode_steps, decode_ids=decode_ids,
                  layer_outputs=True, stable_ties=stable_ties).layer_outputs


# ------------------------------------------------------------------------------------------------
# 6./7. Checkpoints and official names
# ------------------------------------------------------------------------------------------------

def save_hf_checkpoint(model: DeepseekV4ForCausalLM, out_dir: str | Path,
                       max_shard_size: int | str | None = None) -> Path:
    """``model.save_pretrained(out_dir)`` as safetensors (+ config.json); returns ``Path(out_dir)``.

    ``max_shard_size`` (e.g. ``"200KB"`` or a byte count) splits the tensors over several
    ``model-XXXXX-of-YYYYY.safetensors`` files with a ``model.safetensors.index.json``, so checkpoint
    readers can be tested on sharded layouts with a tiny model. The names on disk are the
    transformers 5.2x ``save_pretrained`` layout of spec §8.3 (official-like, not fully official).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    with _quiet_progress():
        model.save_pretrained(out, **kwargs)
    if not list(out.glob("*.safetensors")):
        raise AssertionError(f"save_pretrained wrote no safetensors into {out}")
    return out


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """No "Writing model shards" progress bars in test output (state restored afterwards)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


_ATTN_NORM = re.compile(r"^(layers\.\d+\.attn\.)norm\.weight$")
_HC_HEAD = re.compile(r"^hc_head\.hc_(fn|base|scale)$")


def official_name(saved_key: str) -> str:
    """Map one key written by ``save_pretrained`` to the official DeepSeek checkpoint name.

    Exactly the four differences of spec §8.3 / §11.16:
    ``model.`` prefix dropped; ``embed_tokens.weight`` -> ``embed.weight``;
    ``hc_head.hc_{fn,base,scale}`` -> ``hc_head_{fn,base,scale}``;
    ``layers.{L}.attn.norm.weight`` -> ``layers.{L}.attn.kv_norm.weight`` (HF's reverse rename turns
    ``.kv_norm.`` into ``.norm.``; the compressors' ``norm.weight`` keep their official name).
    """
    k = saved_key[len("model."):] if saved_key.startswith("model.") else saved_key
    if k == "embed_tokens.weight":
        return "embed.weight"
    m = _HC_HEAD.match(k)
    if m:
        return f"hc_head_{m.group(1)}"
    m = _ATTN_NORM.match(k)
    if m:
        return f"{m.group(1)}kv_norm.weight"
    return k


def _read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        part = load_file(str(f))
        dup = tensors.keys() & part.keys()
        if dup:
            raise AssertionError(f"duplicate tensors across shards: {sorted(dup)[:5]}")
        tensors.update(part)
    return tensors


def hf_weights_state_dict(model: DeepseekV4ForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under the OFFICIAL checkpoint names (spec §8.3), CPU tensors.

    Implemented by ``save_pretrained`` into a temporary directory (so transformers' own reverse
    name mapping and expert un-fusing decide the layout: per-expert ``ffn.experts.{e}.w1/w2/w3``,
    ``attn.wq_a``, ``attn.compressor.ape``, ``ffn.gate.bias`` / ``ffn.gate.tid2eid``, ...), reading the
    safetensors back, and fixing the four names listed in :func:`official_name`. Examples:
    ``embed.weight``, ``head.weight``, ``norm.weight``, ``hc_head_fn``, ``layers.0.attn.kv_norm.weight``,
    ``layers.2.attn.indexer.compressor.ape``, ``layers.0.ffn.gate.tid2eid``,
    ``layers.3.ffn.experts.7.w1.weight``. fp32 (tiny models) and no ``.scale`` tensors: a reference
    loads the identical values an official-format reader would after dequantisation.
    """
    with tempfile.TemporaryDirectory(prefix="dsv4_hf_oracle_") as tmp:
        raw = _read_safetensors_dir(save_hf_checkpoint(model, tmp))
    out: dict[str, torch.Tensor] = {}
    for k, v in raw.items():
        name = official_name(k)
        if name in out:
            raise AssertionError(f"two saved keys map to official name {name!r}")
        out[name] = v
    return out


if __name__ == "__main__":  # quick manual smoke run: python tests/hf_oracle.py
    cfg = tiny_hf_config()
    m = build_hf_model(cfg, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    print(transformers.__version__, hf_logits(m, ids, chunk_sizes=[100], decode_steps=5).shape)
