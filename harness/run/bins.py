"""Where each position's metrics land: phase, prefill chunk or decode step, turn and position bin.

Prefill positions are grouped into bins of `bin_size` tokens that never straddle a chunk or turn
boundary, so per-chunk and per-turn aggregates are exact sums of bins; every decode step is its own
bin. The plan is built once per run and maps a tensor of positions to bin ids in one gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Bin:
    phase: str  # "prefill" | "decode"
    chunk: int  # prefill chunk index, −1 in decode
    step: int  # decode step index, −1 in prefill
    turn: int  # scenario turn (−1: preamble before the first user turn)
    start: int  # first position
    end: int  # one past the last position


class BinPlan:
    def __init__(self, n_prompt: int, n_decode: int, chunk_size: int, turn_of_position: list[int], bin_size: int) -> None:
        if bin_size <= 0:
            raise ValueError(f"bin size must be positive, got {bin_size}")
        total = n_prompt + n_decode
        turns = list(turn_of_position) + [turn_of_position[-1] if turn_of_position else 0] * (total - len(turn_of_position))
        self.n_prompt, self.n_decode = n_prompt, n_decode
        self.bins: list[Bin] = []
        bin_of = []
        start = 0
        while start < n_prompt:
            chunk = start // chunk_size
            end = min(n_prompt, (chunk + 1) * chunk_size, start + bin_size)
            turn = turns[start]
            stop = start + 1
            while stop < end and turns[stop] == turn:
                stop += 1
            self.bins.append(Bin("prefill", chunk, -1, turn, start, stop))
            bin_of += [len(self.bins) - 1] * (stop - start)
            start = stop
        for step in range(n_decode):
            pos = n_prompt + step
            self.bins.append(Bin("decode", -1, step, turns[pos], pos, pos + 1))
            bin_of.append(len(self.bins) - 1)
        self.bin_of_position = torch.tensor(bin_of, dtype=torch.int64)
        self.turn_of_position = torch.tensor(turns, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.bins)

    def bin_ids(self, positions: torch.Tensor) -> torch.Tensor:
        return self.bin_of_position[positions.cpu()]
