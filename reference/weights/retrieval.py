"""Planted retrieval circuits: synthetic weights that make the model use its context like a trained one.

On random weights nothing a model outputs depends on an earlier turn, so a patch that loses context changes no
outcome. The calibrated profile plants an induction circuit — the mechanism trained LLMs use to continue a
sequence they have seen before — built only from the spec's own ops, in four CSA layers:

    residual (D dims):  [0] a constant outlier channel (a bias term)  [1 … b] the token's code  [b+1 … 2b] the answer

1. Token codes. Every token id t has a code c(t) ∈ {±1}^b (b = 24 bits, from a hash of t). The embedding
   carries c(t) in dims 1…b, so every position knows its own token through every layer (the residual stream).
2. Keys and values from the compressor (spec §5.1). A CSA row w pools the 8 tokens 4w−4 … 4w+3 with one softmax
   per channel over those slots; the gate is z = wgate·x + ape[slot]. With wgate = 0 and ape = ±A on chosen
   channels, the softmax is one-hot: channels K (0…b−1) carry the code of token s = 4w+i−1 and channels V
   (b…2b−1) the code of token s+1, for the layer's offset i. The four retrieval layers take i = 0, 1, 2, 3, so
   every adjacent pair (x_s, x_{s+1}) of the context is one compressed row of exactly one of them.
3. Query (spec §4.1). Head 0's q reads the current token's code into channels K only (wq_a, wq_b), so its
   logit against row w is ∝ c(x_t)·c(x_s): EXACT_SCORE for a matching token, (1 − 2h/b)·EXACT_SCORE at h
   differing bits. The compressor norm gain sets the scale. Window rows carry no code (wkv rows zero), so the
   head never matches the current position itself.
4. The sink as threshold (spec §4.5). Head 0's sink logit sits halfway between an exact match and a one-bit
   near miss: with a match in the selection, the row takes ~92% of the mass; without one, the sink takes it
   and the head outputs ≈ 0 — a learned sink that takes most of the mass, as in trained models.
5. The indexer picks the row (spec §5.3). Indexer head 0 reads the same codes (indexer wq_b, indexer compressor
   with the same one-hot gates) and its weight reads the constant channel (weights_proj), so a matching row
   outscores the others and is among the top-k; rows ranked by code similarity make ReLU plateaus and exact
   ties at the k-th pick.
6. Output (spec §4.6). wo_a/wo_b write head 0's V channels — the code of x_{s+1} — into residual dims b+1…2b.
   HC_post adds it to every stream; later layers' updates are small (1/√(2·n_layers) output scaling), so it
   survives mHC, MoE and the remaining layers.
7. The answer (spec §2). head.weight's answer columns hold β·c(t) for every token t, so the logit of t gains
   β·c(t)·answer: the token whose code was retrieved ranks first.

So at a decode step whose token also occurs in a needle planted turns earlier, the reference attends to that
needle's compressed row, the indexer selects it, and the logits rank the token that followed it in the needle
first. Remove the needle's turn and there is nothing to match: the sink takes the mass and the answer is gone.
Hide the row from the indexer and the same happens — that is the outcome `ctx.needle_answer` measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from reference.config import ModelConfig
from reference.weights.hashing import hash_u32

CODE_BITS = 24
"""Bits of a token code: 2^24 codes for 129,280 ids leave a given token's code shared with another token's with
probability 129280/2^24 = 0.8% (the answer ties then), and a one-bit neighbour expected 24·0.8% = 0.18 times."""

EXACT_SCORE = 60.0
"""Head 0's attention logit for an exact code match. A one-bit near miss scores (1 − 2/24)·60 = 55; FP8 KV
(e4m3, 2^-4 relative per entry) moves a 24-term logit by ~60·2^-4/√24·… ≈ 0.5, far inside that gap."""

SINK_SCORE = EXACT_SCORE * (1 - 1 / CODE_BITS)
"""Halfway between an exact match (60) and a one-bit miss (55): a match takes e^2.5/(1 + e^2.5) = 92% of the
mass, a one-bit miss alone 8%, anything further from the query less than 0.7%."""

GATE_SELECT = 30.0
"""ape on the selected slot (+30) and on every other slot (−30): the other 7 slots' softmax weight is e^-60."""

KEY_PROJECTION = 4.0
"""Compressor wkv gain on the code dims: K/V channels ≈ 4.3 against ~1 for a random channel, so the row's RMS
is set by the code (normalised K/V entries ≈ √(hd/2b))."""

QUERY_PROJECTION = 2.0
"""wq_a gain on the code dims: q_lat code dims ≈ 2.2 against ~1 elsewhere before q_norm."""

ANSWER_WRITE = 0.365
"""wo_a and wo_b gains on the answer path: head 0's V entries ≈ 1.14·g·0.92 ≈ 11 → 11·0.365² ≈ 1.5 per
residual answer dim, comparable to a code dim (±1)."""

ANSWER_READ = 4.0
"""head.weight gain β on the answer dims: the answer logit is β·Σ_b c·a ≈ 4·24·1.15 = 110 against ≤ ~99 for the
closest other code among 129,280 and a random part of std ~0.7, a margin of ≳ 10."""

INDEX_QUERY = 1.0
INDEX_KEY_GAIN = 2.0
INDEX_WEIGHT = 1.0
"""Indexer head 0: q = 1.0 × the q_lat code, keys normed to gain 2.0, weight 1.0 × the constant channel:
a match scores ~29 against ~1–3 for a random head's contribution."""

OUTLIER_DIM = 0


@dataclass(frozen=True)
class RetrievalPlan:
    """Where the circuit lives in a config: its layers (layer → offset i) and dimension budget."""

    bits: int
    index_bits: int
    layers: dict[int, int]

    @property
    def code_dims(self) -> slice:
        return slice(1, 1 + self.bits)

    @property
    def answer_dims(self) -> slice:
        return slice(1 + self.bits, 1 + 2 * self.bits)

    def key_norm_gain(self, cfg: ModelConfig) -> float:
        """Compressor norm gain g so that head 0's exact-match logit is EXACT_SCORE: q's b code entries are
        ±√(hd/b) after the per-head RMS norm, the row's K entries ±g·√(hd/2b) after its norm, so the logit
        b·√(hd/b)·g·√(hd/2b)/√hd = g·√(hd/2)."""
        return EXACT_SCORE / math.sqrt(cfg.head_dim / 2)


def retrieval_plan(cfg: ModelConfig) -> RetrievalPlan | None:
    """The circuit for this config, or None when it does not fit: it needs four CSA layers after the first and
    room for 2b nope dims per head, b index dims, b q_lat and o_lora dims and 2b + 1 residual dims."""
    csa = [layer for layer in range(cfg.num_hidden_layers) if cfg.layer_kind(layer) == "csa"]
    nope = cfg.head_dim - cfg.qk_rope_head_dim
    bits = CODE_BITS
    index_bits = min(bits, cfg.index_head_dim - cfg.qk_rope_head_dim)
    fits = (len(csa) >= 5 and nope >= 2 * bits and index_bits >= 16 and cfg.q_lora_rank >= bits
            and cfg.o_lora_rank >= bits and cfg.hidden_size >= 2 * bits + 1)
    if not fits:
        return None
    return RetrievalPlan(bits, index_bits, {layer: offset for offset, layer in enumerate(csa[1:5])})


def token_codes(key: int, token_ids: torch.Tensor, bits: int) -> torch.Tensor:
    """±1 codes [n, bits] (fp32) of token ids: bit j of token t is bit 0 of fmix32((t·bits + j) XOR key)."""
    ids = token_ids.to(torch.int64).flatten()
    index = ids[:, None] * bits + torch.arange(bits, device=ids.device)[None, :]
    return 1.0 - 2.0 * (hash_u32(key, index) & 1).to(torch.float32)


def _protect_channels(plan: RetrievalPlan, value: torch.Tensor) -> torch.Tensor:
    """No sub-layer but the circuit writes the constant channel, the code or the answer dims (rows of an output
    projection [D, ·]). Measured on flash-mini without this: by layer 10 the other layers' updates leave the code
    dims with noise of RMS 1.7 against a code of ±1, and no token matches its own earlier occurrence any more.
    A trained model keeps such a subspace clean by learning to; the synthetic one keeps it clean by construction.
    mHC's comb mixes the four streams with a doubly stochastic matrix, so dims equal in every stream stay equal."""
    value = value.clone()
    value[: 1 + 2 * plan.bits] = 0
    return value


def _one_hot_gates(ape: torch.Tensor, channels: slice, width: int, slot: int, half: int) -> None:
    """ape [m, 2·width]: on `channels`, −GATE_SELECT everywhere and +GATE_SELECT at (slot, half)."""
    cols = torch.arange(ape.shape[1], device=ape.device)
    for h in (0, 1):
        sel = cols[h * width + channels.start : h * width + channels.stop]
        ape[:, sel] = -GATE_SELECT
    ape[slot, half * width + channels.start : half * width + channels.stop] = GATE_SELECT


def _slot(offset: int, which: str) -> tuple[int, int]:
    """(slot j, half) whose token a K or V channel selects in row w: K takes token 4w+i−1, V token 4w+i.
    Half 1 (Cb) holds tokens 4w … 4w+3 at slots 0…3; half 0 (Ca) holds window w−1, so token 4w−1 is (3, 0)."""
    position = offset - 1 if which == "K" else offset  # relative to 4w
    return (position, 1) if position >= 0 else (3, 0)


RESIDUAL_WRITERS = ("attn.wo_b.weight", "ffn.shared_experts.w2.weight")
"""Output projections that add to the residual streams (with every routed expert's w2)."""


def plant(cfg: ModelConfig, plan: RetrievalPlan, layer: int, name: str, value: torch.Tensor) -> torch.Tensor:
    """The tensor `name` of `layer` with the circuit written into it (other tensors unchanged)."""
    if name in RESIDUAL_WRITERS or (name.startswith("ffn.experts.") and name.endswith(".w2.weight")):
        value = _protect_channels(plan, value)
    offset = plan.layers.get(layer)
    if offset is None:
        return value
    b, bI, hd = plan.bits, plan.index_bits, cfg.head_dim
    code = torch.arange(1, 1 + b, device=value.device)
    v = value.clone()
    k_slot, v_slot = _slot(offset, "K"), _slot(offset, "V")
    if name == "attn_norm.weight":  # unit gains along the code: an outlier gain would concentrate q's norm
        v[code] = 1.0                    # on one channel and shrink an exact match's logit (60 → 39 measured)
    elif name == "attn.q_norm.weight":
        v[:b] = 1.0
    elif name == "attn.wq_a.weight":  # q_lat dims 0…b−1 read the code
        v[:b] = 0
        v[torch.arange(b), code] = QUERY_PROJECTION
    elif name == "attn.wq_b.weight":  # head 0: channels K read q_lat dims 0…b−1, nothing else
        v[:hd] = 0
        v[torch.arange(b), torch.arange(b)] = 1.0
    elif name == "attn.wkv.weight":  # window rows carry no code: the head never matches its own position
        v[: 2 * b] = 0
    elif name == "attn.compressor.wkv.weight":
        for half in (0, 1):
            v[half * hd : half * hd + 2 * b] = 0
            v[half * hd + torch.arange(b), code] = KEY_PROJECTION
            v[half * hd + b + torch.arange(b), code] = KEY_PROJECTION
    elif name == "attn.compressor.wgate.weight":
        for half in (0, 1):
            v[half * hd : half * hd + 2 * b] = 0
    elif name == "attn.compressor.ape":
        _one_hot_gates(v, slice(0, b), hd, *k_slot)
        _one_hot_gates(v, slice(b, 2 * b), hd, *v_slot)
    elif name == "attn.compressor.norm.weight":
        v[: 2 * b] = plan.key_norm_gain(cfg)
    elif name == "attn.attn_sink":
        v[0] = SINK_SCORE
    elif name == "attn.wo_a.weight":  # group 0's rows 0…b−1 read head 0's V channels; head 0 writes nothing else
        rows = cfg.o_lora_rank
        v[:rows, :hd] = 0
        v[torch.arange(b), b + torch.arange(b)] = ANSWER_WRITE
    elif name == "attn.wo_b.weight":  # u dims 0…b−1 of group 0 write the answer dims, and only they do
        answer = torch.arange(1 + b, 1 + 2 * b)
        v[:, :b] = 0
        v[answer] = 0
        v[answer, torch.arange(b)] = ANSWER_WRITE
    elif name == "attn.indexer.wq_b.weight":
        v[: cfg.index_head_dim] = 0
        v[torch.arange(bI), torch.arange(bI)] = INDEX_QUERY
    elif name == "attn.indexer.weights_proj.weight":
        v[0] = 0
        v[0, OUTLIER_DIM] = INDEX_WEIGHT
    elif name == "attn.indexer.compressor.wkv.weight":
        dI = cfg.index_head_dim
        for half in (0, 1):
            v[half * dI : half * dI + bI] = 0
            v[half * dI + torch.arange(bI), code[:bI]] = KEY_PROJECTION
    elif name == "attn.indexer.compressor.wgate.weight":
        dI = cfg.index_head_dim
        for half in (0, 1):
            v[half * dI : half * dI + bI] = 0
    elif name == "attn.indexer.compressor.ape":
        _one_hot_gates(v, slice(0, bI), cfg.index_head_dim, *k_slot)
    elif name == "attn.indexer.compressor.norm.weight":
        v[:bI] = INDEX_KEY_GAIN
    return v
