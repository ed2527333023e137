"""Decode tokens from the reference's own greedy choice (scenario `decode.tokens: greedy`).

Greedy decoding is token-major by nature — token t+1 depends on the logits at t through every layer —
so it runs as a separate pre-pass before the layer-major run: the prompt is prefilled layer by layer
with every layer's block and state kept resident, then each decode step runs through all layers.
This holds every layer's weights at once: fine for presets like flash-mini, far too much for the full
Flash model (~144 GB stored); there, give decode tokens in the scenario.
"""

from __future__ import annotations

from typing import Sequence

import torch

from reference.model import ReferenceModel


def greedy_decode_ids(model: ReferenceModel, prompt_ids: Sequence[int], steps: int, chunk_size: int | None = None
                      ) -> list[int]:
    ids = torch.tensor(list(prompt_ids), dtype=torch.int64, device=model.device)
    blocks = [model.layer(layer) for layer in range(model.cfg.num_hidden_layers)]
    states = [block.new_state() for block in blocks]
    step = chunk_size or len(prompt_ids)
    last = None
    for start in range(0, len(prompt_ids), step):
        x = model.embed(ids[start : start + step])
        for block, state in zip(blocks, states):
            x = block.forward(x, ids[start : start + step], state)
        last = x[-1:]
    out: list[int] = []
    for _ in range(steps):
        token = int(model.logits(last).argmax(-1))
        out.append(token)
        tok = torch.tensor([token], device=model.device)
        x = model.embed(tok)
        for block, state in zip(blocks, states):
            x = block.forward(x, tok, state)
        last = x
    return out
