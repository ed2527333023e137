"""Context loss as an outcome: the decode steps that ask for a needle, and whether a stack answers them.

A *needle query* is a teacher-forced decode step whose next token can only come from a needle planted turns
earlier. At decode position p the stack reads token x = tokens[p] and should predict y = tokens[p+1]. The step
is a needle query when x occurs earlier in the context (prompt and earlier decode tokens), and *every* earlier
occurrence of x lies inside a needle span and is followed there by y. Then the one place the context says what
follows x is the needle: a model that answers y used the needle, and without the needle's turn nothing in the
context points to y. Steps whose token also occurs elsewhere (a common word, or a word the question repeats)
have several continuations in context and do not count: a one-token cue does not determine them.

`AnswerLens` measures, at the query positions, the logit lens of a stack's residual streams after every layer —
the stack's own final HC head, norm and LM head applied early — and, after the last layer, the logits
themselves. Per query and layer: does the top-1 equal the needle continuation, and by what margin
(logit of y − the best other logit). A stack *loses* an answer where the reference gives it with a margin beyond
FP8 noise and the stack does not: that is `ctx.needle_lost`, the outcome the gate holds at zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from harness.run.metrics import MetricValues

FP8_REL = 2.0**-4
"""u_e4m3: an answer whose reference margin is within 2^-4·|logit of y| of the runner-up could flip under the
stock engine's FP8 rounding of its inputs alone; such a near-tie is not counted as lost context (the same rule
as boundary-aware recall, DESIGN §4)."""


@dataclass(frozen=True)
class NeedleQuery:
    step: int  # decode step index (0-based)
    position: int  # absolute position of the token the stack reads
    token: int
    answer: int  # the needle continuation: the next teacher-forced token
    needle: str


def needle_queries(prompt_ids: Sequence[int], decode_ids: Sequence[int],
                   needle_spans: dict[str, tuple[int, int]]) -> list[NeedleQuery]:
    """The decode steps whose continuation only a needle determines (module docstring). The last decode step
    has no known continuation and is never a query."""
    tokens = list(prompt_ids) + list(decode_ids)
    n = len(prompt_ids)
    inside: dict[int, str] = {}  # position q → needle name, for q whose successor q+1 is in the same needle
    for name, (start, end) in needle_spans.items():
        for q in range(start, end - 1):
            inside.setdefault(q, name)
    occurrences: dict[int, list[int]] = {}
    for q in range(n):
        occurrences.setdefault(tokens[q], []).append(q)
    queries = []
    for step in range(len(decode_ids)):
        p = n + step
        x = tokens[p]
        earlier = occurrences.get(x, [])
        if step + 1 < len(decode_ids) and earlier:
            y = tokens[p + 1]
            if all(q in inside and tokens[q + 1] == y for q in earlier):
                queries.append(NeedleQuery(step, p, x, y, inside[earlier[0]]))
        occurrences.setdefault(x, []).append(p)
    return queries


class AnswerLens:
    """Top-1 and margin of the needle continuation at the query positions, per stack and layer."""

    def __init__(self, queries: list[NeedleQuery]) -> None:
        self.queries = queries
        self.positions = torch.tensor([q.position for q in queries], dtype=torch.int64)
        self.answers = torch.tensor([q.answer for q in queries], dtype=torch.int64)

    def __bool__(self) -> bool:
        return bool(self.queries)

    def read(self, logits_fn: Callable[[torch.Tensor], torch.Tensor], streams: torch.Tensor) -> dict[str, torch.Tensor]:
        """answered [Q] bool, margin [Q] and logit of the answer [Q] (fp64) from a stack's logits at the queries."""
        logits = logits_fn(streams[self.positions.to(streams.device)]).double()  # on the stack's device: exact ops
        answers = self.answers[:, None].to(logits.device)
        answer_logit = logits.gather(1, answers).squeeze(1)
        margin = answer_logit - logits.scatter(1, answers, float("-inf")).amax(1)
        margin, answer_logit = margin.cpu(), answer_logit.cpu()  # [Q] each, not the [Q, vocab] logits
        return {"answered": margin > 0, "margin": margin, "answer_logit": answer_logit}

    def compare(self, ref: dict[str, torch.Tensor], var: dict[str, torch.Tensor]) -> list[MetricValues]:
        """Per query: the variant's answer and margin, the reference's, and `ctx.needle_lost` — the reference
        answers beyond FP8 noise (margin > FP8_REL·|its logit of y|) and the variant does not."""
        pos = self.positions
        confident = ref["answered"] & (ref["margin"] > FP8_REL * ref["answer_logit"].abs())
        lost = confident & ~var["answered"]
        return [
            MetricValues("ctx.needle_answer", pos, var["answered"].double()),
            MetricValues("ctx.needle_answer_ref", pos, ref["answered"].double()),
            MetricValues("ctx.needle_margin", pos, var["margin"]),
            MetricValues("ctx.needle_margin_ref", pos, ref["margin"]),
            MetricValues("ctx.needle_lost", pos, lost.double()),
        ]
