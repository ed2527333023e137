"""From a scenario's prompt section to token ids, turns and needles: `resolve_prompt(scenario) -> PromptPlan`.

The plan is what the runner feeds every stack and what the context-loss lens (DESIGN §3) reads:
prompt ids, the teacher-forced decode ids, the turn of every prompt position (-1 = preamble: BOS and
the system prompt), the turn spans and the needle spans. Everything is deterministic: the same
scenario gives the same plan on every machine.

Decode ids for `decode.tokens: continuation`:
- generator: `harness.scenario.agent_session.continuation_ids` — the agent's plausible next message, which
  opens by recalling the needles;
- messages: the final assistant message's tokens (the prompt then ends with the generation prompt
  `<｜Assistant｜><think>`, exactly where that message's own tokens would follow it);
- token_file: the first `decode.steps` ids of `prompt.decode_token_file`.
`greedy` leaves `decode_ids` None: the runner takes the reference's argmax step by step.

Small vocabularies: the `tiny` preset has 512 embedding rows while every tokenizer speaks the
129,280-id DeepSeek-V4 vocabulary. For synthetic weights whose preset vocabulary is smaller than the
tokenizer's, ids are *folded* (`fold_token_id`): ids already inside the vocabulary that are special
(BOS 0, EOS 1) stay, the other special tokens take the top ids in spec §9 order, and ordinary ids
wrap into the rest. Distinct special tokens stay distinct, so turn markers remain recognisable to
the model; text and offsets keep the tokenizer's view. A checkpoint's vocabulary is never folded:
an id outside it is an error, and so is one in a token file (those are model ids already).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import NamedTuple

from harness.scenario.chat_encoding import PREAMBLE_TURN, EncodedChat, MessageSpan, TurnSpan, encode_chat
from harness.errors import UsageError
from harness.scenario.token_files import read_token_file
from harness.scenario.schema import Scenario
from harness.scenario.tokenizer import SPECIAL_TOKEN_IDS, FallbackTokenizer, Tokenizer
from reference.config import ModelConfig


class NeedleLocation(NamedTuple):
    """Token range [start, end) of a needle in the prompt and the turn it sits in."""

    start: int
    end: int
    turn: int


@dataclass(frozen=True)
class PromptPlan:
    """The resolved prompt of a scenario. Positions are absolute: prompt 0..n_prompt-1, then decode steps."""

    scenario_name: str
    source: str  # "generator" | "messages" | "token_file"
    prompt_ids: list[int]  # model ids (folded into the model vocabulary when `vocab_folded`)
    decode_ids: list[int] | None  # teacher-forced decode ids; None for greedy (the runner computes them)
    decode_steps: int
    decode_source: str  # "continuation" | "greedy" | "ids"
    turn_of_position: list[int]  # turn of every prompt position; -1 = preamble (BOS, system prompt)
    turn_spans: list[TurnSpan]  # consecutive [start, end) per turn, preamble first when there is one
    needles: dict[str, NeedleLocation]
    needle_texts: dict[str, str]  # the planted text of each needle
    text: str  # the prompt text (token_file prompts: the tokenizer's decode, approximate for the fallback)
    decode_text: str | None  # the text of the decode ids (None for greedy)
    token_offsets: list[tuple[int, int]] | None  # each prompt token's [start, end) characters in `text`
    message_spans: list[MessageSpan]  # per message (empty for token_file prompts)
    tokenizer: Tokenizer
    tokenizer_label: str  # "fallback" or the tokenizer.json path
    vocab_size: int  # the model's
    vocab_folded: bool
    chunk_size: int  # the optimized stacks' prefill chunk
    reference_chunk_size: int | None  # None: the reference prefills the whole prompt at once
    tokenizer_prompt_ids: list[int] = field(default_factory=list, repr=False)  # before folding

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def n_total(self) -> int:
        """Prompt plus decode positions."""
        return len(self.prompt_ids) + self.decode_steps

    @property
    def num_turns(self) -> int:
        return sum(1 for turn in self.turn_spans if turn.turn != PREAMBLE_TURN)

    @property
    def decode_turn(self) -> int:
        """Decode steps continue the last turn."""
        return self.turn_of_position[-1] if self.turn_of_position else 0

    @property
    def turn_of_every_position(self) -> list[int]:
        """turn_of_position extended over the decode steps (which continue the last turn)."""
        return self.turn_of_position + [self.decode_turn] * self.decode_steps

    @property
    def needle_ranges(self) -> list[tuple[int, int]]:
        """The needles' [start, end) token ranges, in the order they were named."""
        return [(loc.start, loc.end) for loc in self.needles.values()]

    @property
    def turn_token_counts(self) -> dict[int, int]:
        return {turn.turn: turn.end - turn.start for turn in self.turn_spans}

    @property
    def prefill_chunks(self) -> list[tuple[int, int]]:
        """The optimized stacks' prefill chunks as [start, end) positions."""
        return [(start, min(start + self.chunk_size, self.n_prompt)) for start in range(0, self.n_prompt,
                                                                                          self.chunk_size)]

    def chunk_of_position(self, position: int) -> int:
        """Prefill chunk index of a prompt position (decode positions: -1)."""
        return position // self.chunk_size if position < self.n_prompt else -1

    def token_text(self, start: int, end: int) -> str:
        """The prompt text under tokens [start, end): exact from offsets when known, else the tokenizer's decode."""
        if start >= end:
            return ""
        if self.token_offsets is not None:
            return self.text[self.token_offsets[start][0]: self.token_offsets[end - 1][1]]
        return self.tokenizer.decode(self.tokenizer_prompt_ids[start:end] or self.prompt_ids[start:end])

    def summary(self) -> str:
        """One paragraph: sizes per turn, needles, decode and chunking."""
        turns = ", ".join(("preamble" if turn == PREAMBLE_TURN else f"turn {turn}") + f" {count:,}"
                          for turn, count in self.turn_token_counts.items())
        needles = ", ".join(f"{name} {span_text(loc.start, loc.end)} (turn {loc.turn})"
                            for name, loc in self.needles.items())
        folded = f", ids folded into the {self.vocab_size}-id vocabulary" if self.vocab_folded else ""
        reference = ("whole prompt" if self.reference_chunk_size is None
                     else f"chunks of {self.reference_chunk_size:,}")
        return (f"{self.scenario_name}: {self.n_prompt:,} prompt tokens from {self.source} "
                f"(tokenizer {self.tokenizer_label}{folded}); {self.num_turns} turns [{turns}]; "
                f"needles: {needles or 'none'}; decode: {self.decode_steps} steps ({self.decode_source}); "
                f"prefill: {len(self.prefill_chunks)} chunks of {self.chunk_size:,} (reference: {reference})")


# --------------------------------------------------------------------------- vocabulary folding


def fold_token_id(token_id: int, vocab_size: int) -> int:
    """A tokenizer id folded into a smaller synthetic vocabulary (module docstring); identity when it fits
    and is not a displaced special token."""
    high_specials = sorted(i for i in SPECIAL_TOKEN_IDS.values() if i >= vocab_size)
    low_reserved = max((i for i in SPECIAL_TOKEN_IDS.values() if i < vocab_size), default=-1) + 1
    ordinary_slots = vocab_size - len(high_specials) - low_reserved
    if ordinary_slots <= 0:
        raise ValueError(f"a vocabulary of {vocab_size} ids cannot hold the {len(SPECIAL_TOKEN_IDS)} special tokens")
    if token_id in high_specials:
        return vocab_size - len(high_specials) + high_specials.index(token_id)
    if token_id < low_reserved:
        return token_id
    return low_reserved + (token_id - low_reserved) % ordinary_slots


# --------------------------------------------------------------------------- resolution


def load_scenario_tokenizer(scenario: Scenario) -> tuple[Tokenizer, str]:
    """The scenario's tokenizer and a label for reports.

    auto: a checkpoint's tokenizer.json (or the fallback, with a warning, when it has none); the
    fallback for presets. fallback: always the fallback. A directory: its tokenizer.json.
    """
    from harness.scenario.tokenizer import HFTokenizer, TokenizerSpecError, load_tokenizer

    try:
        if scenario.tokenizer == "fallback" or (scenario.tokenizer == "auto" and scenario.model.checkpoint is None):
            return FallbackTokenizer(), "fallback"
        if scenario.tokenizer == "auto":
            tokenizer = load_tokenizer(scenario.model.checkpoint)  # warns when it falls back
        else:
            tokenizer = HFTokenizer(scenario.tokenizer)
    except ImportError:
        raise scenario.error("tokenizer", "reading tokenizer.json needs the `tokenizers` package "
                                          "(pip install tokenizers)") from None
    except (TokenizerSpecError, OSError, ValueError) as e:
        raise scenario.error("tokenizer", str(e)) from None
    return tokenizer, str(tokenizer.path) if isinstance(tokenizer, HFTokenizer) else "fallback"


def span_text(start: int, end: int) -> str:
    """A token span as every output prints it: half-open, `[start, end)` (end is the first position after it)."""
    return f"[{start:,}, {end:,})"


def shortest_prompt(cfg: ModelConfig) -> int:
    """The fewest prompt tokens a run can measure: one compressed row at the last prompt position of every CSA
    layer (its compression ratio), whose indexer selection the metrics compare; 1 for a model without CSA."""
    return min((cfg.compress_ratio(layer) for layer in range(cfg.num_hidden_layers) if cfg.layer_kind(layer) == "csa"),
               default=1)


def resolve_prompt(scenario: Scenario, tokenizer: Tokenizer | None = None) -> PromptPlan:
    """Token ids, decode ids, turns and needles of a scenario's prompt (deterministic).

    Raises ScenarioError naming the field for problems only visible now: a generator target too
    small for its turns, a continuation shorter than decode.steps, ids outside the vocabulary, dump
    positions past the end.
    """
    from reference.config import ConfigError

    try:
        cfg = scenario.model.config()
    except ConfigError as e:
        raise scenario.error("model", str(e)) from None
    if tokenizer is None:
        tokenizer, label = load_scenario_tokenizer(scenario)
    else:
        label = type(tokenizer).__name__
    # token files hold model ids already (checked against the vocabulary); only tokenizer output is folded
    fold = (scenario.model.preset is not None and tokenizer.vocab_size > cfg.vocab_size
            and scenario.prompt.source != "token_file")

    prompt = scenario.prompt
    if prompt.source == "generator":
        parts = _from_generator(scenario, tokenizer)
    elif prompt.source == "messages":
        parts = _from_messages(scenario, tokenizer)
    else:
        parts = _from_token_file(scenario, tokenizer, cfg.vocab_size)
    tokenizer_ids, decode_ids = parts.prompt_ids, parts.decode_ids

    if scenario.decode.source == "ids":
        decode_ids = list(scenario.decode.ids)
        for index, token_id in enumerate(decode_ids):
            if token_id >= cfg.vocab_size:
                raise scenario.error(f"decode.tokens[{index}]", f"id {token_id} is outside the model's vocabulary "
                                                                f"({cfg.vocab_size} ids)")
        parts.decode_text = tokenizer.decode(decode_ids)
    elif scenario.decode.source == "greedy":
        decode_ids, parts.decode_text = None, None
    elif decode_ids is None:  # continuation with steps: 0 and nothing to continue from
        decode_ids, parts.decode_text = [], ""
    elif fold:
        decode_ids = [fold_token_id(t, cfg.vocab_size) for t in decode_ids]
    if decode_ids is not None and len(decode_ids) != scenario.decode.steps:
        raise scenario.error("decode.steps", f"{len(decode_ids)} decode ids for {scenario.decode.steps} steps")

    prompt_ids = [fold_token_id(t, cfg.vocab_size) for t in tokenizer_ids] if fold else list(tokenizer_ids)
    shortest = shortest_prompt(cfg)
    if len(prompt_ids) < shortest:
        raise scenario.error(f"prompt.{prompt.source}",
                             f"the prompt is {len(prompt_ids)} token(s); this model needs at least {shortest}, the "
                             "CSA compression ratio, so that the last prompt position has a compressed row for the "
                             "indexer to select")
    outside = next((i for i, t in enumerate(prompt_ids) if t >= cfg.vocab_size), None)
    if outside is not None:
        raise scenario.error("prompt", f"prompt position {outside} has id {prompt_ids[outside]}, outside the model's "
                                       f"vocabulary ({cfg.vocab_size} ids); is the tokenizer the checkpoint's?")
    if decode_ids is not None and fold is False and any(t >= cfg.vocab_size for t in decode_ids):
        raise scenario.error("decode.tokens", f"a decode id is outside the model's vocabulary ({cfg.vocab_size} ids)")

    total = len(prompt_ids) + scenario.decode.steps
    for index, position in enumerate(scenario.probes.dump.positions):
        if position >= total:
            raise scenario.error(f"probes.dump.positions[{index}]",
                                 f"position {position} is past the end: the prompt has {len(prompt_ids)} tokens and "
                                 f"decode {scenario.decode.steps} steps (last position {total - 1})")

    return PromptPlan(
        scenario_name=scenario.name,
        source=prompt.source,
        prompt_ids=prompt_ids,
        decode_ids=decode_ids,
        decode_steps=scenario.decode.steps,
        decode_source=scenario.decode.source,
        turn_of_position=parts.turn_of_position,
        turn_spans=parts.turn_spans,
        needles=parts.needles,
        needle_texts=parts.needle_texts,
        text=parts.text,
        decode_text=parts.decode_text,
        token_offsets=parts.offsets,
        message_spans=parts.message_spans,
        tokenizer=tokenizer,
        tokenizer_label=label,
        vocab_size=cfg.vocab_size,
        vocab_folded=fold,
        chunk_size=scenario.prefill.chunk_size,
        reference_chunk_size=scenario.prefill.reference_chunk_size,
        tokenizer_prompt_ids=list(tokenizer_ids),
    )


@dataclass
class _Parts:
    prompt_ids: list[int]
    decode_ids: list[int] | None
    decode_text: str | None
    text: str
    offsets: list[tuple[int, int]] | None
    turn_of_position: list[int]
    turn_spans: list[TurnSpan]
    needles: dict[str, NeedleLocation]
    needle_texts: dict[str, str]
    message_spans: list[MessageSpan]


def _from_encoded(encoded: EncodedChat, decode_ids: list[int] | None, decode_text: str | None) -> _Parts:
    return _Parts(
        prompt_ids=list(encoded.ids),
        decode_ids=decode_ids,
        decode_text=decode_text,
        text=encoded.text,
        offsets=list(encoded.offsets),
        turn_of_position=encoded.token_turns(),
        turn_spans=encoded.turn_spans,
        needles={name: NeedleLocation(n.start, n.end, n.turn) for name, n in encoded.needles.items()},
        needle_texts={name: n.text for name, n in encoded.needles.items()},
        message_spans=list(encoded.spans),
    )


def _text_of_first(tokenizer: Tokenizer, text: str, count: int) -> tuple[list[int], str]:
    """The first `count` ids of `text` and the exact text under them."""
    ids, offsets = tokenizer.encode_with_offsets(text)
    if count == 0:
        return [], ""
    return ids[:count], text[: offsets[min(count, len(ids)) - 1][1]]


def _from_generator(scenario: Scenario, tokenizer: Tokenizer) -> _Parts:
    from harness.scenario.agent_session import continuation_text, generate_agent_session

    spec = scenario.prompt.generator
    try:
        session = generate_agent_session(spec.seed, spec.target_tokens, spec.turns, tokenizer, spec.needles,
                                         spec.thinking)
    except (ValueError, RuntimeError) as e:
        raise scenario.error("prompt.generator.target_tokens", str(e)) from None
    decode_ids = decode_text = None
    if scenario.decode.source == "continuation":
        steps = scenario.decode.steps
        decode_ids, decode_text = _text_of_first(tokenizer, continuation_text(session, tokenizer, steps), steps)
    return _from_encoded(session.encoded, decode_ids, decode_text)


def _from_messages(scenario: Scenario, tokenizer: Tokenizer) -> _Parts:
    prompt = scenario.prompt
    options = dict(thinking=prompt.thinking, keep_earlier_reasoning=prompt.keep_earlier_reasoning)
    try:
        encoded = encode_chat(prompt.prompt_messages, tokenizer, **options)
    except ValueError as e:
        raise scenario.error("prompt.messages", str(e)) from None
    decode_ids = decode_text = None
    if scenario.decode.source == "continuation" and prompt.continuation_message is not None:
        full = encode_chat(prompt.chat_messages, tokenizer, **options)
        n_prompt = len(encoded.ids)
        if full.ids[:n_prompt] != encoded.ids:
            raise scenario.error(f"prompt.messages[{len(prompt.messages) - 1}]",
                                 "the tokenizer merges the final assistant message into the prompt's last tokens, "
                                 "so it cannot be decoded as a continuation")
        continuation = full.ids[n_prompt:]
        steps = scenario.decode.steps
        if len(continuation) < steps:
            raise scenario.error("decode.steps", f"the final assistant message is {len(continuation)} tokens, fewer "
                                                 f"than decode.steps = {steps}; lengthen it or lower steps")
        decode_ids = continuation[:steps]
        decode_text = full.span_text(n_prompt, n_prompt + steps) if steps else ""
    return _from_encoded(encoded, decode_ids, decode_text)


def _from_token_file(scenario: Scenario, tokenizer: Tokenizer, vocab_size: int) -> _Parts:
    prompt = scenario.prompt
    try:
        ids = read_token_file(prompt.token_file, vocab_size)
    except UsageError as e:
        raise scenario.error("prompt.token_file", str(e)) from None
    n = len(ids)
    if not n:  # before the turn starts, which would otherwise report the empty file as a turn past its end
        raise scenario.error("prompt.token_file", f"token file {prompt.token_file} holds no token ids")
    starts = list(prompt.turn_starts) or [0]
    for index, start in enumerate(starts):
        if start >= n:
            raise scenario.error(f"prompt.turn_starts[{index}]", f"turn start {start} is past the prompt's {n} tokens")
    turn_of_position = [PREAMBLE_TURN] * starts[0]
    turn_spans = [TurnSpan(PREAMBLE_TURN, 0, starts[0])] if starts[0] > 0 else []
    for turn, (start, end) in enumerate(zip(starts, starts[1:] + [n])):
        turn_of_position += [turn] * (end - start)
        turn_spans.append(TurnSpan(turn, start, end))
    needles = {}
    for name, (start, end) in prompt.needle_spans.items():
        if end > n:
            raise scenario.error(f"prompt.needle_spans.{name}", f"[{start}, {end}) runs past the prompt's {n} tokens")
        needles[name] = NeedleLocation(start, end, turn_of_position[start])

    decode_ids = decode_text = None
    if scenario.decode.source == "continuation" and scenario.decode.steps > 0:
        try:
            decode_all = read_token_file(prompt.decode_token_file, vocab_size)
        except UsageError as e:
            raise scenario.error("prompt.decode_token_file", str(e)) from None
        if len(decode_all) < scenario.decode.steps:
            raise scenario.error("decode.steps", f"prompt.decode_token_file holds {len(decode_all)} ids, fewer than "
                                                 f"decode.steps = {scenario.decode.steps}")
        decode_ids = decode_all[: scenario.decode.steps]
        decode_text = tokenizer.decode(decode_ids)
    elif scenario.decode.source == "continuation":
        decode_ids, decode_text = [], ""
    text = tokenizer.decode(ids)
    return _Parts(ids, decode_ids, decode_text, text, None, turn_of_position, turn_spans, needles,
                  {name: tokenizer.decode(ids[s:e]) for name, (s, e, _) in needles.items()}, [])


def plan_to_json(plan: PromptPlan) -> str:
    """The plan's ids and spans as JSON (for run records)."""
    return json.dumps({
        "scenario": plan.scenario_name,
        "prompt_ids": plan.prompt_ids,
        "decode_ids": plan.decode_ids,
        "turn_spans": [[t.turn, t.start, t.end] for t in plan.turn_spans],
        "needles": {name: list(loc) for name, loc in plan.needles.items()},
        "tokenizer": plan.tokenizer_label,
        "vocab_folded": plan.vocab_folded,
    })
