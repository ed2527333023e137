"""The whole reference model, run layer-major (DESIGN §3, Execution).

For each layer in turn, its weights are produced once, the layer processes the sequence's segments
in order — prefill chunks, then one-token decode steps — carrying `LayerState` between them, and
the output streams become the next layer's input. Layer-major order is exactly equivalent to serving
order (token-major) because a segment of layer L depends only on layer L's own state from earlier
segments; it lets one layer's weights be resident at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from reference.config import ModelConfig
from reference.layer import LayerState, ParityOptions, ReferenceLayer
from reference.ops.mhc import hc_head
from reference.ops.norms import rms_norm
from reference.probes import NULL_SINK, ProbeSink
from reference.weights.source import TensorBundle, WeightSource


def ensure_no_tf32() -> None:
    """The reference is pure fp32: refuse to run when fp32 matmuls may use TF32 (DESIGN §10). (cuDNN's TF32 flag
    governs convolutions only, which DeepSeek-V4 has none of.)"""
    problems = []
    for backend in ("cuda", "mkldnn"):  # torch ≥ 2.9's per-backend setting; the legacy query raises once it is used
        setting = getattr(getattr(getattr(torch.backends, backend, None), "matmul", None), "fp32_precision", None)
        if setting in ("tf32", "bf16"):
            problems.append(f"torch.backends.{backend}.matmul.fp32_precision is {setting!r}")
    if problems:
        raise RuntimeError("the fp32 reference refuses to run with TF32 (or bf16) fp32 matmuls: "
                           + "; ".join(problems) + ". Set them back to 'ieee'.")
    if torch.get_float32_matmul_precision() != "highest":
        problems.append(f"torch.get_float32_matmul_precision() is {torch.get_float32_matmul_precision()!r}")
    if torch.backends.cuda.matmul.allow_tf32:
        problems.append("torch.backends.cuda.matmul.allow_tf32 is True")
    if problems:
        raise RuntimeError("the fp32 reference refuses to run with TF32 enabled: " + "; ".join(problems)
                           + ". Call torch.set_float32_matmul_precision('highest').")


def segment_lengths(n_prompt: int, n_decode: int, chunk_size: int | None, decode_together: bool = False
                    ) -> list[int]:
    """Prefill chunks of `chunk_size` tokens (None: the whole prompt at once), then one token per decode step — or,
    with `decode_together`, the decode tokens as one more segment. The reference graph gives the same result either
    way (its state makes any split equal to one pass, up to the rounding of differently shaped products:
    tests/test_reference_invariants.py); one segment costs one pass instead of one per step. Only a serving-style
    engine must decode token by token: its decode kernels are what is tested."""
    if n_prompt <= 0:
        raise ValueError("the prompt must hold at least one token")
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk size must be positive, got {chunk_size}")
    step = chunk_size or n_prompt
    chunks = [min(step, n_prompt - s) for s in range(0, n_prompt, step)]
    if decode_together:
        return chunks + ([n_decode] if n_decode else [])
    return chunks + [1] * n_decode


@dataclass
class ForwardResult:
    logits: torch.Tensor | None  # [T, vocab] float32 (None when the caller computes them in blocks)
    layer_outputs: list[torch.Tensor] = field(default_factory=list)  # [T, n, D] per layer when requested
    final_streams: torch.Tensor | None = None  # [T, n, D] after the last layer


class ReferenceModel:
    """Embedding, the 43 (or any number of) blocks run layer-major, HC head, final norm and LM head."""

    def __init__(self, source: WeightSource, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 parity: ParityOptions = ParityOptions()) -> None:
        self.source, self.cfg = source, source.config
        self.dtype, self.device, self.parity = dtype, torch.device(device), parity
        self._top: TensorBundle | None = None
        self._top_dense: dict[str, torch.Tensor] = {}

    @property
    def top(self) -> TensorBundle:
        if self._top is None:
            self._top = self.source.top_level(self.device)
        return self._top

    def _dense_top(self, name: str) -> torch.Tensor:
        """A top-level tensor in the model's dtype, converted once (logits are read after every layer by the
        needle lens; the head is [vocab, D])."""
        if name not in self._top_dense:
            self._top_dense[name] = self.top.dense(name, self.dtype)
        return self._top_dense[name]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """X = stack of n identical copies of the embedding (spec §2): [T, n, D]."""
        e = self.source.embed_rows(token_ids, self.device).to(self.dtype)
        return e[:, None, :].expand(-1, self.cfg.hc_mult, -1).contiguous()

    def layer(self, layer: int) -> ReferenceLayer:
        return ReferenceLayer(self.cfg, layer, self.source.layer(layer, self.device), self.dtype, self.parity,
                              self.device)

    def run_layer(self, block: ReferenceLayer, streams: torch.Tensor, token_ids: torch.Tensor,
                  segments: Sequence[int], sink: ProbeSink = NULL_SINK,
                  state: LayerState | None = None) -> torch.Tensor:
        """One layer over consecutive segments (prefill chunks, then decode steps) from a fresh state."""
        state = state or block.new_state()
        outs, start = [], 0
        for n in segments:
            outs.append(block.forward(streams[start : start + n], token_ids[start : start + n], state, sink))
            start += n
        return torch.cat(outs, 0)

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """HCHead → final RMSNorm → LM head (spec §2, §3.3); fp32 logits [T, vocab]."""
        cfg, w = self.cfg, self._dense_top
        h = hc_head(streams, w("hc_head_fn"), w("hc_head_base"), w("hc_head_scale"), cfg.rms_norm_eps, cfg.hc_eps)
        h = rms_norm(h, w("norm.weight"), cfg.rms_norm_eps)
        return (h @ w("head.weight").T).float()

    def forward(self, prompt_ids: Sequence[int], decode_ids: Sequence[int] = (), chunk_size: int | None = None,
                keep_layer_outputs: bool = False, progress: Callable[[int, int], None] | None = None,
                compute_logits: bool = True) -> ForwardResult:
        """Logits for every prompt position and every teacher-forced decode token (or, with compute_logits
        False, the final streams to compute them from in blocks: [T, vocab] can be many GB)."""
        ensure_no_tf32()
        ids = torch.tensor(list(prompt_ids) + list(decode_ids), dtype=torch.int64, device=self.device)
        segments = segment_lengths(len(prompt_ids), len(decode_ids), chunk_size)
        streams = self.embed(ids)
        kept = []
        for layer in range(self.cfg.num_hidden_layers):
            streams = self.run_layer(self.layer(layer), streams, ids, segments)
            if keep_layer_outputs:  # in the computation's precision (fp64 stays fp64), bf16 widened to fp32
                kept.append((streams.float() if streams.dtype == torch.bfloat16 else streams).cpu())
            if progress:
                progress(layer + 1, self.cfg.num_hidden_layers)
        return ForwardResult(self.logits(streams) if compute_logits else None, kept, streams)
