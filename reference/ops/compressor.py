"""KV compressors (spec §5.1, §10.3): gated softmax pooling of m-token windows into one row.

HCA (m = 128): row w pools tokens 128w … 128w+127. CSA (m = 4, overlapping): row w pools the 8 slots
{Ca, za of window w−1} ∪ {Cb, zb of window w}, one softmax per channel over the slot axis; for w = 0 the
window −1 slots are absent. Windows are aligned to absolute positions (multiples of m from 0), so a
compressor carries its incomplete window — and for CSA the last complete window's Ca half — in
`CompressorState` across prefill chunks and decode steps; results do not depend on chunking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from reference.ops.norms import rms_norm
from reference.ops.rope import apply_rope, cos_sin


@dataclass
class CompressorWeights:
    wkv: torch.Tensor  # [c·d, D]
    wgate: torch.Tensor  # [c·d, D]
    ape: torch.Tensor  # [m, c·d] absolute in-window position bias, added to the gates
    norm: torch.Tensor  # [d]


@dataclass
class CompressorState:
    """What a compressor must remember between calls (spec §10.3 rule 2).

    pending_*: projections of the tokens of the current, incomplete window (gates include ape).
    prev_*:    the Ca / za half of the last complete window (CSA only; None before the first row).
    rows:      every emitted row so far, post-processed (norm, RoPE, optional QAT sim); row w covers
               the window starting at w·m, so the pending window starts at rows.shape[0]·m.
    """

    ratio: int
    overlap: bool
    pending_kv: torch.Tensor
    pending_gate: torch.Tensor
    prev_kv: torch.Tensor | None
    prev_gate: torch.Tensor | None
    rows: torch.Tensor

    @classmethod
    def empty(cls, ratio: int, overlap: bool, width: int, dtype: torch.dtype, device) -> "CompressorState":
        c = 2 if overlap else 1
        z = torch.zeros(0, c * width, dtype=dtype, device=device)
        return cls(ratio, overlap, z, z.clone(), None, None, torch.zeros(0, width, dtype=dtype, device=device))

    @property
    def n_rows(self) -> int:
        return self.rows.shape[0]


def compress(state: CompressorState, x: torch.Tensor, positions: torch.Tensor, w: CompressorWeights,
             rms_eps: float, inv_freq: torch.Tensor,
             postprocess: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Feed tokens x [S, D] at consecutive absolute `positions` [S]; append completed rows to state.rows.

    Returns the rows emitted by this call ([n_new, d]); their indices are the previous n_rows onward.
    """
    kv = x @ w.wkv.T  # v_i
    gate = x @ w.wgate.T + w.ape[positions % state.ratio]  # z_i + ape[i mod m]
    first_row = state.n_rows
    pooled = pool_new_windows(state, kv, gate, positions)
    rows = rms_norm(pooled, w.norm, rms_eps)
    row_ids = torch.arange(first_row, first_row + rows.shape[0], device=x.device)
    cos, sin = cos_sin(inv_freq, row_ids * state.ratio, rows.dtype)  # RoPE at p_w = w·m (§5.1 step 2)
    rows = apply_rope(rows, cos, sin)
    if postprocess is not None:
        rows = postprocess(rows)
    state.rows = torch.cat([state.rows, rows], 0)
    return rows


def pool_new_windows(state: CompressorState, kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor
                     ) -> torch.Tensor:
    """Add projected tokens (kv, gate incl. ape) to the pending window(s); pool every window that is now
    complete into one pre-norm row [n_new, d]; keep the rest (and CSA's last Ca half) in `state`."""
    m = state.ratio
    expected = state.n_rows * m + state.pending_kv.shape[0]
    if positions.numel() and int(positions[0]) != expected:
        raise ValueError(f"compressor fed position {int(positions[0])}, expected {expected} "
                         "(tokens must arrive in order)")
    width = kv.shape[-1] // (2 if state.overlap else 1)
    all_kv = torch.cat([state.pending_kv, kv], 0)
    all_gate = torch.cat([state.pending_gate, gate], 0)
    n_new = all_kv.shape[0] // m
    windows_kv = all_kv[: n_new * m].unflatten(0, (n_new, m))  # [n_new, m, c·d]
    windows_gate = all_gate[: n_new * m].unflatten(0, (n_new, m))
    pooled = (_pool_windows(state, windows_kv, windows_gate, width) if n_new
              else torch.zeros(0, width, dtype=kv.dtype, device=kv.device))
    if n_new and state.overlap:
        state.prev_kv = windows_kv[-1, :, :width]
        state.prev_gate = windows_gate[-1, :, :width]
    state.pending_kv = all_kv[n_new * m :]
    state.pending_gate = all_gate[n_new * m :]
    return pooled


def _pool_windows(state: CompressorState, windows_kv: torch.Tensor, windows_gate: torch.Tensor,
                  width: int) -> torch.Tensor:
    """Softmax-pool complete windows [n, m, c·d] into rows [n, d], one softmax per channel over the slots."""
    if state.overlap:
        # slots of row w: Ca/za of window w−1 (channels [0:d]) then Cb/zb of window w (channels [d:2d]);
        # before the first complete window, the w−1 slots are absent (value 0, gate −∞ ⇒ weight 0)
        m = state.ratio
        if state.prev_kv is None:
            prev_kv0 = torch.zeros(1, m, width, dtype=windows_kv.dtype, device=windows_kv.device)
            prev_gate0 = torch.full((1, m, width), float("-inf"), dtype=windows_kv.dtype, device=windows_kv.device)
        else:
            prev_kv0, prev_gate0 = state.prev_kv[None], state.prev_gate[None]
        prev_kv = torch.cat([prev_kv0, windows_kv[:-1, :, :width]], 0)
        prev_gate = torch.cat([prev_gate0, windows_gate[:-1, :, :width]], 0)
        slot_kv = torch.cat([prev_kv, windows_kv[:, :, width:]], 1)  # [n, 2m, d]
        slot_gate = torch.cat([prev_gate, windows_gate[:, :, width:]], 1)
    else:
        slot_kv, slot_gate = windows_kv, windows_gate
    return (torch.softmax(slot_gate, dim=1) * slot_kv).sum(1)


def visible_rows(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Number of compressed rows a query at position t may use: floor((t+1)/m) (spec §4.4, §5.1)."""
    return torch.div(positions + 1, ratio, rounding_mode="floor")
