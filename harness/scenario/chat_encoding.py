"""DeepSeek-V4 chat encoding (spec §9) with the token span of every message, turn and needle.

The context-loss lens (DESIGN §3) asks "how much attention do later queries put on turn 1, or on
the needle?", so besides the prompt ids the harness needs to know which ids each message, turn and
planted fact occupies. The whole prompt is tokenized in one piece (tokenizing messages separately
would change merges at the seams) and character offsets map tokens back to what produced them.

Rendering, from spec §9 (our restatement of DeepSeek's `encoding_dsv4`):

    BOS + system [+ "\n\n" + tools section]
    + "<｜User｜>" + user text | "<tool_result>" + result + "</tool_result>"  (one block; parts joined by "\n\n")
    + "<｜Assistant｜>" + ("<think>" | "</think>")
    + [reasoning + "</think>"] + content + ["\n\n" + DSML tool calls] + EOS
    + ... + "<｜Assistant｜>" + ("<think>" | "</think>")   (generation prompt after a final user block)

- Thinking mode opens each assistant turn with `<think>`, chat mode with `</think>` and never shows
  reasoning. In thinking mode the reasoning of assistant messages before the last user block is
  dropped, and their opener becomes `</think>`, unless a tool is defined or
  `keep_earlier_reasoning` is set: agent sessions keep their reasoning.
- Tool results have no role of their own: consecutive user/tool messages merge into one
  `<｜User｜>` block, as DeepSeek's encoder does. They render in message order (callers pass them
  in call order).
- Where the spec is silent we chose (an approximation of the official encoder):
  * tool calls: `<｜DSML｜tool_calls>` holding one `<｜DSML｜invoke name="…">` per call, each argument
    a `<｜DSML｜parameter name="…" string="true|false">` element: strings raw, anything else JSON;
  * the tools section: our own short instructions plus one JSON schema per line;
  * an *interrupted* assistant message (the user cut generation off) renders only what was
    generated: if it stopped inside visible reasoning (no content, no tool calls) it is the
    reasoning with no `</think>`; otherwise the usual rendering without EOS. The next
    `<｜User｜>` follows directly.

Span attribution: a message's span starts at its own marker — `<｜User｜>` (or the "\n\n" joining
it to the block), `<｜Assistant｜>` + thinking opener for assistants — so the tokens of an
assistant span are exactly what the model emitted or was prompted with for that message. A
generation prompt with no assistant message after it is its own span (role "generation_prompt").
A *turn* is one user request and everything up to the next user request; BOS and the system
prompt are turn -1.
"""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from harness.scenario.tokenizer import ASSISTANT, BOS, DSML, EOS, THINK_END, THINK_START, USER, Tokenizer

ROLES = ("system", "user", "assistant", "tool")
PREAMBLE_TURN = -1


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, object]


@dataclass(frozen=True)
class Message:
    """One chat message.

    `needles` maps a needle name to a substring of this message's rendered text whose token range
    is reported (first occurrence). `tools` (system only) are JSON-schema-like tool definitions.
    """

    role: str
    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tools: tuple[Mapping[str, object], ...] = ()
    interrupted: bool = False
    needles: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class MessageSpan:
    """Token range [start, end) of one message; message_index is None for BOS and a trailing generation prompt."""

    start: int
    end: int
    role: str
    turn: int
    message_index: int | None


@dataclass(frozen=True)
class TurnSpan:
    turn: int
    start: int
    end: int


@dataclass(frozen=True)
class NeedleSpan:
    """Token range [start, end) of the tokens overlapping a needle's characters."""

    name: str
    text: str
    start: int
    end: int
    message_index: int
    turn: int


@dataclass(frozen=True)
class EncodedChat:
    text: str
    ids: list[int]
    offsets: list[tuple[int, int]]  # each token's [start, end) characters in `text`
    spans: list[MessageSpan]  # in order, tiling [0, len(ids)) exactly
    needles: dict[str, NeedleSpan]

    def span_text(self, start: int, end: int) -> str:
        """The text under tokens [start, end), exact for any tokenizer (decode may not be: fallback hash collisions)."""
        if start >= end:
            return ""
        return self.text[self.offsets[start][0] : self.offsets[end - 1][1]]

    @property
    def turn_spans(self) -> list[TurnSpan]:
        """Consecutive message spans grouped by turn, the preamble (turn -1) first."""
        turns: list[TurnSpan] = []
        for span in self.spans:
            if turns and turns[-1].turn == span.turn:
                turns[-1] = TurnSpan(span.turn, turns[-1].start, span.end)
            else:
                turns.append(TurnSpan(span.turn, span.start, span.end))
        return turns

    @property
    def num_turns(self) -> int:
        return sum(1 for turn in self.turn_spans if turn.turn != PREAMBLE_TURN)

    def token_turns(self) -> list[int]:
        """The turn of every token, for building "earlier turn" masks."""
        return [span.turn for span in self.spans for _ in range(span.start, span.end)]


@dataclass(frozen=True)
class _Segment:
    """A rendered piece of text: character range [start, end) and who it belongs to."""

    start: int
    end: int
    role: str
    turn: int
    message_index: int | None


def render_tool_calls(tool_calls: Sequence[ToolCall]) -> str:
    invokes = []
    for call in tool_calls:
        parameters = []
        for key, value in call.arguments.items():
            is_string = isinstance(value, str)
            rendered = value if is_string else json.dumps(value, ensure_ascii=False)
            string_flag = "true" if is_string else "false"
            parameters.append(f'<{DSML}parameter name="{key}" string="{string_flag}">{rendered}</{DSML}parameter>')
        invokes.append(f'<{DSML}invoke name="{call.name}">\n' + "\n".join(parameters) + f"\n</{DSML}invoke>")
    return f"<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def render_tools_section(tools: Sequence[Mapping[str, object]]) -> str:
    example = render_tool_calls([ToolCall("TOOL_NAME", {"STRING_PARAMETER": "value", "OTHER_PARAMETER": 0})])
    schemas = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "## Tools\n\n"
        "You can call the tools below by writing a block like this one:\n\n"
        f"{example}\n\n"
        'Write string arguments as they are with string="true"; write numbers, booleans, arrays and '
        'objects as JSON with string="false". In thinking mode, end your reasoning with '
        f"{THINK_END} before calling tools or answering.\n\n"
        "### Tool schemas\n\n"
        f"{schemas}"
    )


def _validate(messages: Sequence[Message]) -> None:
    for index, message in enumerate(messages):
        where = f"message {index} ({message.role})"
        if message.role not in ROLES:
            raise ValueError(f"{where}: unknown role, expected one of {ROLES}")
        if message.role == "system" and index != 0:
            raise ValueError(f"{where}: a system message may only come first")
        if message.tools and message.role != "system":
            raise ValueError(f"{where}: tools are defined on the system message")
        if (message.reasoning is not None or message.tool_calls or message.interrupted) and message.role != "assistant":
            raise ValueError(f"{where}: reasoning, tool_calls and interrupted belong to assistant messages")
        previous_role = messages[index - 1].role if index else None
        if message.role == "assistant" and previous_role not in ("user", "tool"):
            raise ValueError(f"{where}: an assistant message must follow a user or tool message")
        if message.role == "tool" and not any(m.role == "user" for m in messages[:index]):
            raise ValueError(f"{where}: a tool result before the first user request belongs to no turn")


def _render_assistant(message: Message, shows_reasoning: bool) -> str:
    opener = ASSISTANT + (THINK_START if shows_reasoning else THINK_END)
    tool_calls = "\n\n" + render_tool_calls(message.tool_calls) if message.tool_calls else ""
    stopped_in_reasoning = shows_reasoning and not message.content and not message.tool_calls
    if message.interrupted and stopped_in_reasoning:
        return opener + (message.reasoning or "")
    reasoning = (message.reasoning or "") + THINK_END if shows_reasoning else ""
    return opener + reasoning + message.content + tool_calls + ("" if message.interrupted else EOS)


def _render(
    messages: Sequence[Message], thinking: bool, keep_earlier_reasoning: bool
) -> tuple[str, list[_Segment], dict[str, tuple[int, int, int]]]:
    """Render to text; return it with its segments and each needle's (char start, char end, message index)."""
    _validate(messages)
    drop_earlier_reasoning = thinking and not keep_earlier_reasoning and not any(m.tools for m in messages)
    last_user_block = max((i for i, m in enumerate(messages) if m.role in ("user", "tool")), default=-1)

    parts: list[str] = []
    segments: list[_Segment] = []
    needle_chars: dict[str, tuple[int, int, int]] = {}
    length = 0

    def emit(text: str, role: str, turn: int, message_index: int | None) -> None:
        nonlocal length
        parts.append(text)
        segments.append(_Segment(length, length + len(text), role, turn, message_index))
        length += len(text)

    emit(BOS, "bos", PREAMBLE_TURN, None)
    turn = PREAMBLE_TURN
    for index, message in enumerate(messages):
        in_user_block = index > 0 and messages[index - 1].role in ("user", "tool")
        if message.role == "system":
            text = message.content + ("\n\n" + render_tools_section(message.tools) if message.tools else "")
        elif message.role in ("user", "tool"):
            if message.role == "user":
                turn += 1
            body = message.content if message.role == "user" else f"<tool_result>{message.content}</tool_result>"
            text = ("\n\n" if in_user_block else USER) + body
        else:
            shows_reasoning = thinking and not (drop_earlier_reasoning and index < last_user_block)
            text = _render_assistant(message, shows_reasoning)

        for name, needle in message.needles.items():
            found_at = text.find(needle)
            if found_at < 0:
                raise ValueError(f"message {index}: needle {name!r} ({needle!r}) is not in its rendered text")
            if name in needle_chars:
                raise ValueError(f"message {index}: needle name {name!r} is used twice")
            needle_chars[name] = (length + found_at, length + found_at + len(needle), index)
        emit(text, message.role, turn, index)

    if messages and messages[-1].role in ("user", "tool"):
        emit(ASSISTANT + (THINK_START if thinking else THINK_END), "generation_prompt", turn, None)
    return "".join(parts), segments, needle_chars


def render_chat(messages: Sequence[Message], *, thinking: bool = True, keep_earlier_reasoning: bool = False) -> str:
    """The prompt text of spec §9 for these messages."""
    return _render(messages, thinking, keep_earlier_reasoning)[0]


def encode_chat(
    messages: Sequence[Message],
    tokenizer: Tokenizer,
    *,
    thinking: bool = True,
    keep_earlier_reasoning: bool = False,
) -> EncodedChat:
    """Render, tokenize once, and map every message, turn and needle to its token range."""
    text, segments, needle_chars = _render(messages, thinking, keep_earlier_reasoning)
    ids, offsets = tokenizer.encode_with_offsets(text)
    token_starts = [start for start, _ in offsets]
    token_ends = [end for _, end in offsets]
    if any(a > b for a, b in zip(token_starts, token_starts[1:])):
        raise ValueError("tokenizer offsets are not in text order; cannot attribute tokens to messages")

    # A token belongs to the segment holding its first character.
    spans = [
        MessageSpan(
            bisect_left(token_starts, segment.start),
            bisect_left(token_starts, segment.end),
            segment.role,
            segment.turn,
            segment.message_index,
        )
        for segment in segments
    ]
    turn_of_message = {span.message_index: span.turn for span in spans}
    needles = {
        name: NeedleSpan(
            name,
            text[char_start:char_end],
            bisect_right(token_ends, char_start),
            bisect_left(token_starts, char_end),
            message_index,
            turn_of_message[message_index],
        )
        for name, (char_start, char_end, message_index) in needle_chars.items()
    }
    return EncodedChat(text, ids, offsets, spans, needles)
