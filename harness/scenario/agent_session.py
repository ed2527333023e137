"""Deterministic multi-turn coding-agent sessions: the long prompts the symptom was seen on.

"The model forgets earlier turns on long chats" shows up in agent sessions: a system prompt with
tool schemas, user requests, assistant reasoning and tool calls, and long tool results (source
files, test logs) that make up most of the tokens. `generate_agent_session` builds one from a seed,
to a target token count and turn count, and plants *needles* — distinctive facts (a deploy key, a
constant in a file, a test seed, a commit id, ...) — in early turns, which the last user request
asks about, so a model must look back across the whole prompt to answer. Their token spans feed
the context-loss lens (DESIGN §3).

Everything is drawn from `random.Random` seeded per piece, so the same seed gives the same ids on
every machine. Tool results are *elastic*: each is a stream of generated lines cut to a token
budget, and the budgets are fitted so the whole rendered prompt lands within `_FIT_TOLERANCE` of
the target.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Iterator

from harness.scenario.chat_encoding import EncodedChat, Message, MessageSpan, NeedleSpan, ToolCall, TurnSpan, encode_chat
from harness.scenario.tokenizer import THINK_END, THINK_START, Tokenizer

_FIT_TOLERANCE = 0.005  # of the target token count
_FIT_ROUNDS = 6

TOOLS = (
    {
        "name": "read_file",
        "description": "Read a text file of the repository; lines are returned numbered.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string", "description": "Path relative to the repository root."}},
            "required": ["path"],
        },
    },
    {
        "name": "grep",
        "description": "Search the repository for a regular expression and list matching lines.",
        "parameters": {
            "type": "object",
            "properties": {
                "pattern": {"type": "string", "description": "Python regular expression."},
                "path": {"type": "string", "description": "Directory to search, default the root."},
            },
            "required": ["pattern"],
        },
    },
    {
        "name": "run_tests",
        "description": "Run pytest on a path and return its output.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "Test file or directory."},
                "verbose": {"type": "boolean", "description": "One line per test."},
            },
            "required": ["path"],
        },
    },
    {
        "name": "edit_file",
        "description": "Replace one exact occurrence of `old` with `new` in a file and show the diff.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "old": {"type": "string", "description": "Exact text to replace."},
                "new": {"type": "string", "description": "Replacement text."},
            },
            "required": ["path", "old", "new"],
        },
    },
)

_NOUNS = (
    "header", "session", "cache", "token", "buffer", "config", "request", "payload", "schema", "record",
    "batch", "shard", "queue", "index", "ledger", "invoice", "account", "route", "policy", "snapshot",
    "metric", "window", "retry", "socket", "frame", "chunk", "digest", "manifest", "artifact", "lease",
)
_VERBS = (
    "parse", "load", "build", "validate", "merge", "flush", "resolve", "encode", "decode", "render",
    "fetch", "apply", "compute", "normalize", "split", "collect", "emit", "register", "refresh", "drain",
)
_ADJECTIVES = ("pending", "stale", "cached", "raw", "default", "max", "local", "remote", "active", "partial")
_PACKAGES = ("core", "io", "api", "storage", "billing", "sync", "scheduler", "auth")
_TYPES = ("int", "str", "bytes", "float", "bool", "dict[str, int]", "list[str]", "Path", "Optional[str]")
_PEOPLE = ("Priya Raman", "Tomasz Nowak", "Aiko Tanaka", "Lucas Ferreira", "Maren Olsen", "Kwame Mensah")
_SERVICES = ("payments", "ledger", "search", "notifier", "gateway", "inventory")


# --------------------------------------------------------------------------- words and code


def _ident(rng: random.Random) -> str:
    if rng.random() < 0.3:
        return f"{rng.choice(_VERBS)}_{rng.choice(_ADJECTIVES)}_{rng.choice(_NOUNS)}"
    return f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"


def _class_name(rng: random.Random) -> str:
    return rng.choice(_NOUNS).capitalize() + rng.choice(_NOUNS).capitalize()


def _module_path(rng: random.Random) -> str:
    return f"src/{rng.choice(_PACKAGES)}/{rng.choice(_NOUNS)}_{rng.choice(_NOUNS)}.py"


def _test_path(rng: random.Random) -> str:
    return f"tests/test_{rng.choice(_NOUNS)}_{rng.choice(_VERBS)}.py"


def _sentence(rng: random.Random) -> str:
    noun, other = rng.choice(_NOUNS), rng.choice(_NOUNS)
    return rng.choice(
        (
            f"The {noun} is {rng.choice(_ADJECTIVES)} when `{_ident(rng)}` runs, so the {other} it returns is wrong.",
            f"`{_ident(rng)}` calls `{_ident(rng)}` before the {noun} lock is taken, which explains the race.",
            f"If the {noun} were {rng.choice(_ADJECTIVES)} here, `{_class_name(rng)}` would "
            f"{rng.choice(_VERBS)} it twice.",
            f"The failing assertion compares {rng.randint(2, 4096)} {noun}s with {rng.randint(2, 4096)}; "
            f"one path skips the {other}.",
            f"I should {rng.choice(_VERBS)} the {noun} in one place instead of in both `{_ident(rng)}` "
            f"and `{_ident(rng)}`.",
            f"Nothing else reads `{noun}_{other}`, so changing its default is safe.",
            f"The traceback ends in `{_ident(rng)}`, line {rng.randint(12, 900)}: the {noun} is None there.",
        )
    )


def _prose(rng: random.Random, low: int, high: int) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randint(low, high)))


def _statements(rng: random.Random, method: bool) -> list[str]:
    a, b, item = rng.choice(_NOUNS), rng.choice(_NOUNS), rng.choice(_NOUNS)[0]
    return rng.choice(
        (
            [f"{a} = {b}.{_ident(rng)}({rng.choice(_NOUNS)})"],
            [f"if not {a}:", f'    raise ValueError(f"{a} {{{b}!r}} is {rng.choice(_ADJECTIVES)}")'],
            [f"for {item} in {a}.{b}s:", f"    {b}s.append({_ident(rng)}({item}))"],
            [f"{a}_count += len({b})"],
            [f'logger.debug("{rng.choice(_VERBS)} %s {b} in %.3fs", {a}, elapsed)'],
            [f"self._{a} = {b}" if method else f"{a} = {b} or {rng.choice(('None', '0', '{}', '[]'))}"],
            [
                "with self._lock:" if method else "with _LOCK:",
                f"    {a} = {_ident(rng)}({b}, timeout={rng.randint(1, 90)})",
            ],
            [f"{a} = {{k: v for k, v in {b}.items() if v is not None}}"],
        )
    )


def _function(rng: random.Random, indent: str, method: bool) -> list[str]:
    params = [f"{rng.choice(_NOUNS)}: {rng.choice(_TYPES)}" for _ in range(rng.randint(1, 3))]
    arguments = ", ".join((["self"] if method else []) + params)
    signature = f"{indent}def {_ident(rng)}({arguments}) -> {rng.choice(_TYPES)}:"
    summary = f"{rng.choice(_VERBS).capitalize()} the {rng.choice(_NOUNS)} for a {rng.choice(_ADJECTIVES)} "
    summary += f"{rng.choice(_NOUNS)}."
    lines = [signature, f'{indent}    """{summary}"""']
    for _ in range(rng.randint(2, 7)):
        lines += [f"{indent}    {line}" for line in _statements(rng, method)]
    return lines + [f"{indent}    return {rng.choice(_NOUNS)}", ""]


def _python_source(rng: random.Random, planted: list[str]) -> tuple[list[str], Iterator[str]]:
    """(head, endless body) of a Python module; `planted` lines join the constants in the head."""
    constants = [
        f"{rng.choice(_ADJECTIVES).upper()}_{rng.choice(_NOUNS).upper()}_{rng.choice(('MS', 'BYTES', 'LIMIT'))}"
        f" = {rng.randint(2, 65536)}"
        for _ in range(rng.randint(2, 5))
    ]
    for line in planted:
        constants.insert(rng.randint(0, len(constants)), line)
    head = [
        f'"""{rng.choice(_NOUNS).capitalize()} helpers for the {rng.choice(_PACKAGES)} service.',
        "",
        _sentence(rng),
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "import logging",
        "import threading",
        "from pathlib import Path",
        "from typing import Optional",
        "",
        f"from {rng.choice(_PACKAGES)}.{rng.choice(_NOUNS)} import {_class_name(rng)}, {_ident(rng)}",
        "",
        "logger = logging.getLogger(__name__)",
        "_LOCK = threading.Lock()",
        *constants,
        "",
        "",
    ]

    def body() -> Iterator[str]:
        while True:
            if rng.random() < 0.35:
                yield from _function(rng, "", method=False)
            else:
                yield f"class {_class_name(rng)}:"
                yield f'    """{_sentence(rng)}"""'
                yield ""
                for _ in range(rng.randint(2, 5)):
                    yield from _function(rng, "    ", method=True)
            yield ""

    return head, body()


def _numbered(lines: Iterator[str]) -> Iterator[str]:
    for number, line in enumerate(lines, 1):
        yield f"{number:>5}\t{line}"


# --------------------------------------------------------------------------- elastic tool results


class _ElasticText:
    """A tool result cut to a token budget: the first `min_lines` lines always, then more while within budget."""

    def __init__(self, tokenizer: Tokenizer, lines: Iterator[str], min_lines: int, tail: str = ""):
        self._tokenizer = tokenizer
        self._lines = lines
        self._min_lines = min_lines
        self._tail = tail
        self._taken: list[str] = []
        self._cumulative_tokens: list[int] = []  # tokens of the first n+1 lines joined by "\n"

    def _take_one(self) -> None:
        line = next(self._lines)
        joined = line if not self._taken else "\n" + line  # "\n"-prefixed: counts add up exactly with the fallback
        previous = self._cumulative_tokens[-1] if self._cumulative_tokens else 0
        self._taken.append(line)
        self._cumulative_tokens.append(previous + len(self._tokenizer.encode(joined)))

    def text(self, budget_tokens: int) -> str:
        while len(self._taken) < self._min_lines or self._cumulative_tokens[-1] < budget_tokens:
            self._take_one()
        count = max(self._min_lines, sum(1 for tokens in self._cumulative_tokens if tokens <= budget_tokens))
        return "\n".join(self._taken[:count]) + self._tail


def _read_file_result(rng: random.Random, tokenizer: Tokenizer, planted: list[str]) -> _ElasticText:
    head, body = _python_source(rng, planted)
    lines = _numbered(line for part in (iter(head), body) for line in part)
    return _ElasticText(tokenizer, lines, min_lines=len(head))


def _run_tests_result(rng: random.Random, tokenizer: Tokenizer, planted: list[str]) -> _ElasticText:
    test_file = _test_path(rng)
    head = [
        "============================= test session starts ==============================",
        f"platform linux -- Python 3.11.{rng.randint(2, 9)}, pytest-8.{rng.randint(0, 3)}.{rng.randint(0, 4)}, "
        "pluggy-1.5.0",
        *planted,  # only the planted run prints its seed, so "the seed of that run" has one answer
        f"rootdir: /home/dev/{rng.choice(_SERVICES)}",
        f"collected {rng.randint(40, 900)} items",
        "",
    ]

    def results() -> Iterator[str]:
        yield from head
        current_file, done = test_file, 0
        while True:
            done += 1
            outcome = "FAILED" if rng.random() < 0.04 else "PASSED"
            yield f"{current_file}::test_{_ident(rng)} {outcome}{' ' * rng.randint(2, 20)}[{min(done, 99):>3}%]"
            if rng.random() < 0.05:
                current_file = _test_path(rng)

    failure = _ident(rng)
    tail = (
        "\n\n=================================== FAILURES ===================================\n"
        f"____________________________ test_{failure} ____________________________\n"
        f"E       AssertionError: expected {rng.randint(2, 999)} {rng.choice(_NOUNS)}s, got {rng.randint(2, 999)}\n"
        f"{test_file}:{rng.randint(20, 400)}: AssertionError\n"
        f"=========================== short test summary info ============================\n"
        f"FAILED {test_file}::test_{failure}\n"
        f"======== 1 failed, {rng.randint(40, 900)} passed in {rng.uniform(2, 90):.2f}s ========"
    )
    return _ElasticText(tokenizer, results(), min_lines=len(head), tail=tail)


def _grep_result(rng: random.Random, tokenizer: Tokenizer, planted: list[str]) -> _ElasticText:
    def matches() -> Iterator[str]:
        yield from planted
        while True:
            line = rng.choice(_statements(rng, method=rng.random() < 0.5))
            yield f"{_module_path(rng)}:{rng.randint(3, 1200)}:{' ' * 4 * rng.randint(1, 3)}{line}"

    return _ElasticText(tokenizer, matches(), min_lines=max(1, len(planted)))


def _edit_file_result(rng: random.Random, tokenizer: Tokenizer, planted: list[str]) -> _ElasticText:
    start = rng.randint(10, 600)

    def diff() -> Iterator[str]:
        yield f"Applied 1 edit to {_module_path(rng)}."
        yield f"@@ -{start},40 +{start},41 @@"
        while True:
            for line in _function(rng, "    ", method=True):
                yield rng.choices((" ", "-", "+"), weights=(8, 1, 1))[0] + line

    return _ElasticText(tokenizer, diff(), min_lines=3)


_RESULT_MAKERS: dict[str, Callable[[random.Random, Tokenizer, list[str]], _ElasticText]] = {
    "read_file": _read_file_result,
    "run_tests": _run_tests_result,
    "grep": _grep_result,
    "edit_file": _edit_file_result,
}
_RESULT_WEIGHTS = {"read_file": 3.0, "run_tests": 2.0, "grep": 1.0, "edit_file": 1.0}
_ROUND_CONTENT = {
    "read_file": ("Reading the module before touching it.", "Let me look at the implementation."),
    "run_tests": ("Running the tests.", "Checking what the suite says now."),
    "grep": ("Searching for the other call sites.", "Let me find every caller."),
    "edit_file": ("Applying the change.", "Making the edit."),
}


def _tool_call(rng: random.Random, tool: str, path: str | None) -> ToolCall:
    if tool == "read_file":
        return ToolCall(tool, {"path": path or _module_path(rng)})
    if tool == "grep":
        return ToolCall(tool, {"pattern": rf"def {_ident(rng)}\b", "path": "src/"})
    if tool == "run_tests":
        return ToolCall(tool, {"path": _test_path(rng), "verbose": True})
    call = f"{rng.choice(_NOUNS)}.{_ident(rng)}"
    return ToolCall(tool, {"path": _module_path(rng), "old": f"{call}()", "new": f"{call}(strict=True)"})


# --------------------------------------------------------------------------- needles


@dataclass(frozen=True)
class NeedleFact:
    """A fact planted in `planted_turn` whose exact `text` is a needle span; `asked_turns` ask about it."""

    name: str
    text: str
    planted_turn: int
    asked_turns: tuple[int, ...]
    question: str


@dataclass(frozen=True)
class _Plant:
    name: str
    carrier: str  # "user", "assistant" or a tool name
    text: str  # the needle: exact substring of the carrier message
    line: str  # what is inserted into the carrier (contains text)
    question: str
    path: str | None = None  # the file a read_file carrier reads


def _plant(rng: random.Random, kind: str, name: str) -> _Plant:
    letters = "ABCDEFGHJKLMNPQRSTUVWXYZ"
    if kind == "deploy_key":
        prefix, suffix = (rng.choice(letters) + rng.choice(letters) for _ in range(2))
        key = f"{prefix}-{rng.randint(1000, 9999)}-{suffix}"
        text = f"the staging deploy key is {key}"
        question = "What is the staging deploy key I gave you earlier? Put it in deploy/staging.env as DEPLOY_KEY."
        return _Plant(name, "user", text, f"For later: {text}.", question)
    if kind == "config_constant":
        constant = f"{rng.choice(_NOUNS).upper()}_{rng.choice(('TIMEOUT_MS', 'RETRY_BUDGET_MS', 'FLUSH_INTERVAL_MS'))}"
        path = _module_path(rng)
        text = f"{constant} = {rng.randint(1000, 99999)}"
        question = f"What value does `{constant}` have in `{path}`? The new code must use the same number."
        line = f"{text}  # tuned after incident INC-{rng.randint(100, 9999)}"
        return _Plant(name, "read_file", text, line, question, path)
    if kind == "test_seed":
        text = f"Using --randomly-seed={rng.randint(10_000, 9_999_999)}"
        question = "Which --randomly-seed value did the test run that printed one use?"
        return _Plant(name, "run_tests", text, text, question)
    if kind == "bad_commit":
        text = f"the regression came in with commit {rng.getrandbits(28):07x}"
        question = "Which commit did you say introduced the regression?"
        return _Plant(name, "assistant", text, f"Blame says {text}.", question)
    if kind == "oncall_contact":
        text = f"page {rng.choice(_PEOPLE)} at extension {rng.randint(2000, 7999)}"
        question = "Who did I say to page if payments break, and at which extension?"
        return _Plant(name, "user", text, f"If anything breaks in payments, {text}.", question)
    service = rng.choice(_SERVICES)
    text = f"{service}_grpc_port: {rng.randint(20000, 65000)}"
    line = f"config/services.yaml:{rng.randint(3, 90)}:  {text}"
    return _Plant(name, "grep", line=line, text=text, question=f"Which gRPC port is {service} configured with?")


_NEEDLE_KINDS = ("deploy_key", "config_constant", "test_seed", "bad_commit", "oncall_contact", "grpc_port")


def _plan_needles(
    child: Callable[[], random.Random], needles: int, turns: int
) -> tuple[list[NeedleFact], list[_Plant]]:
    """Needle i is of kind i mod 6, planted in the first half of the turns, asked about in the last turn."""
    plant_turns = max(1, (turns - 1) // 2)
    facts, plants = [], []
    for index in range(needles):
        kind = _NEEDLE_KINDS[index % len(_NEEDLE_KINDS)]
        repeat = index // len(_NEEDLE_KINDS)
        plant = _plant(child(), kind, f"{kind}_{repeat + 1}" if repeat else kind)
        turn = index % plant_turns
        asked = (turns - 1,) if turn < turns - 1 else ()
        facts.append(NeedleFact(plant.name, plant.text, turn, asked, plant.question))
        plants.append(plant)
    return facts, plants


# --------------------------------------------------------------------------- the session


@dataclass(frozen=True)
class AgentSession:
    seed: int
    messages: tuple[Message, ...]
    encoded: EncodedChat
    facts: tuple[NeedleFact, ...]

    @property
    def ids(self) -> list[int]:
        return self.encoded.ids

    @property
    def text(self) -> str:
        return self.encoded.text

    @property
    def spans(self) -> list[MessageSpan]:
        return self.encoded.spans

    @property
    def turn_spans(self) -> list[TurnSpan]:
        return self.encoded.turn_spans

    @property
    def needle_spans(self) -> dict[str, NeedleSpan]:
        return self.encoded.needles


@dataclass
class _Round:
    """One assistant tool call and its elastic result."""

    reasoning: str
    content: str
    call: ToolCall
    result: _ElasticText
    weight: float  # share of the free token budget
    content_needles: dict[str, str]
    result_needles: dict[str, str]
    budget_tokens: int = 0

    def messages(self) -> list[Message]:
        return [
            Message("assistant", self.content, self.reasoning, (self.call,), needles=self.content_needles),
            Message("tool", self.result.text(self.budget_tokens), needles=self.result_needles),
        ]


def _request(rng: random.Random) -> str:
    test, func, path = f"test_{_ident(rng)}", _ident(rng), _module_path(rng)
    return rng.choice(
        (
            f"`{test}` started failing after yesterday's merge. Find out why and fix it without changing the test.",
            f"Add a `{rng.choice(_NOUNS)}_limit` option to `{func}` in {path} and cover it with a test.",
            f"Run the {rng.choice(_PACKAGES)} tests and tell me what is broken; don't fix anything yet.",
            f"`{_class_name(rng)}` {rng.choice(_VERBS)}s the {rng.choice(_NOUNS)} twice per request. "
            f"Refactor it so `{func}` does it once.",
            f"Profile says `{func}` in {path} dominates latency. Find the hot path and propose a fix.",
        )
    )


def _system_prompt(rng: random.Random) -> str:
    service = rng.choice(_SERVICES)
    return (
        f"You are Forge, an autonomous coding agent working in the `{service}` repository (Python 3.11, pytest).\n\n"
        "Work in small verified steps: read the code before editing it, run the relevant tests after every change, "
        "and never edit tests to make them pass unless asked. Keep answers short and concrete; quote file paths and "
        "line numbers. When a request is ambiguous, say what you assumed.\n\n"
        f"Repository layout: src/ holds the packages {', '.join(_PACKAGES)}; tests/ mirrors it; config/ holds "
        "service YAML. The CI runs `pytest -q` with pytest-randomly."
    )


_TOOL_PICK_WEIGHTS = {"read_file": 3, "run_tests": 2, "grep": 2, "edit_file": 1}


def _turn_rounds(
    turn_rng: random.Random, child: Callable[[], random.Random], tokenizer: Tokenizer, plants: list[_Plant]
) -> list[_Round]:
    """1-3 random tool rounds plus one per tool-carried needle, in random order."""
    count = turn_rng.randint(1, 3)
    tools = turn_rng.choices(list(_TOOL_PICK_WEIGHTS), weights=list(_TOOL_PICK_WEIGHTS.values()), k=count)
    carried = [(tool, None) for tool in tools] + [(p.carrier, p) for p in plants if p.carrier in _RESULT_MAKERS]
    rounds = [
        _Round(
            reasoning=_prose(turn_rng, 2, 6),
            content=turn_rng.choice(_ROUND_CONTENT[tool]),
            call=_tool_call(turn_rng, tool, plant.path if plant else None),
            result=_RESULT_MAKERS[tool](child(), tokenizer, [plant.line] if plant else []),
            weight=_RESULT_WEIGHTS[tool] * turn_rng.uniform(0.6, 1.4),
            content_needles={},
            result_needles={plant.name: plant.text} if plant else {},
        )
        for tool, plant in carried
    ]
    turn_rng.shuffle(rounds)
    for plant in (p for p in plants if p.carrier == "assistant"):
        rounds[0].content = f"{plant.line} {rounds[0].content}"
        rounds[0].content_needles[plant.name] = plant.text
    return rounds


def generate_agent_session(
    seed: int,
    target_tokens: int,
    turns: int,
    tokenizer: Tokenizer,
    needles: int = 3,
    thinking: bool = True,
) -> AgentSession:
    """A coding-agent session of `turns` user requests whose prompt is `target_tokens` ids (±0.5%).

    Needles are planted in the first half of the turns and asked about by the last request. One
    non-final turn (when there are at least two) ends in reasoning the user interrupted. The
    prompt ends after the last turn's final tool result, with the generation prompt, so decode
    continues the agent mid-task. Raises ValueError when the target cannot hold the turns.
    """
    if turns < 1:
        raise ValueError(f"turns must be at least 1, got {turns}")
    rng = random.Random(seed)

    def child() -> random.Random:
        """An independent stream per piece, so resizing one tool result never reshuffles the others."""
        return random.Random(rng.getrandbits(64))

    facts, plants = _plan_needles(child, needles, turns)
    interrupted_turn = child().randrange(turns - 1) if turns >= 2 else None

    # Every message but the tool results, which stay elastic (_Round) until their budgets are fitted.
    layout: list[Message | _Round] = [Message("system", _system_prompt(child()), tools=TOOLS)]
    rounds: list[_Round] = []
    for turn in range(turns):
        turn_rng = child()
        turn_plants = [plant for plant, fact in zip(plants, facts) if fact.planted_turn == turn]
        user_plants = [p for p in turn_plants if p.carrier == "user"]
        request = _request(turn_rng) + "".join(" " + p.line for p in user_plants)
        if interrupted_turn is not None and turn == interrupted_turn + 1:
            request = "Stop, that's the wrong direction. " + request
        questions = [fact.question for fact in facts if turn in fact.asked_turns]
        if questions:
            request += " Also, from what we saw earlier and without re-running anything: " + " ".join(questions)
        layout.append(Message("user", request, needles={p.name: p.text for p in user_plants}))

        turn_rounds = _turn_rounds(turn_rng, child, tokenizer, turn_plants)
        layout += turn_rounds
        rounds += turn_rounds

        if turn == interrupted_turn:
            thought = _prose(turn_rng, 2, 4)
            cut_at = turn_rng.randint(len(thought) // 2, len(thought) - 1)
            layout.append(Message("assistant", reasoning=thought[:cut_at], interrupted=True))
        elif turn < turns - 1:
            layout.append(Message("assistant", f"Done. {_sentence(turn_rng)}", reasoning=_prose(turn_rng, 1, 3)))

    def encode() -> tuple[tuple[Message, ...], EncodedChat]:
        messages = [m for item in layout for m in ([item] if isinstance(item, Message) else item.messages())]
        return tuple(messages), encode_chat(messages, tokenizer, thinking=thinking)

    skeleton_tokens = len(encode()[1].ids)
    free_tokens = target_tokens - skeleton_tokens
    if free_tokens < 0:
        raise ValueError(
            f"target_tokens={target_tokens} is too small for {turns} turns and {needles} needles: "
            f"the session skeleton alone is {skeleton_tokens} tokens"
        )
    total_weight = sum(r.weight for r in rounds)
    for item in rounds:
        item.budget_tokens = int(free_tokens * item.weight / total_weight)
    # Per-line token counts are close but not exact for every tokenizer: the largest result absorbs the miss.
    largest = max(rounds, key=lambda r: r.budget_tokens)
    for _ in range(_FIT_ROUNDS):
        messages, encoded = encode()
        miss = target_tokens - len(encoded.ids)
        if abs(miss) <= _FIT_TOLERANCE * target_tokens:
            return AgentSession(seed, messages, encoded, tuple(facts))
        largest.budget_tokens = max(0, largest.budget_tokens + miss)
    raise RuntimeError(f"could not fit {target_tokens} tokens (last try {len(encoded.ids)}); seed {seed}")


# --------------------------------------------------------------------------- what comes next


def continuation_text(session: AgentSession, tokenizer: Tokenizer, min_tokens: int) -> str:
    """A plausible next assistant message for `session`, at least `min_tokens` ids long under `tokenizer`.

    The prompt ends with the generation prompt, so this is what decode would emit: in thinking mode
    reasoning, `</think>` and an answer; in chat mode only the answer. Both open by recalling every
    needle fact (the last request asks about them), so even a short teacher-forced decode puts its
    queries where the context-loss lens looks. Reasoning takes about 60% of the tokens, so a long
    decode also crosses `</think>`. Deterministic in (session.seed, min_tokens, tokenizer).
    """
    if min_tokens <= 0:
        return ""
    rng = random.Random(f"agent-session-continuation:{session.seed}")
    thinking = session.text.endswith(THINK_START)
    recalled = "; ".join(fact.text for fact in session.facts)

    def grow(text: str, tokens: int) -> str:
        while len(tokenizer.encode(text)) < tokens:
            text += " " + _sentence(rng)
        return text

    answer_opener = f"From earlier in this session: {recalled}." if recalled else f"Done. {_sentence(rng)}"
    if not thinking:
        return grow(answer_opener, min_tokens)
    reasoning_opener = (
        f"Earlier: {recalled}. The user wants these from what we already saw, without re-running anything."
        if recalled
        else _sentence(rng)
    )
    reasoning = grow(reasoning_opener, max(1, (min_tokens * 3) // 5))
    answer_tokens = min_tokens - len(tokenizer.encode(reasoning + THINK_END))
    return reasoning + THINK_END + grow(answer_opener, answer_tokens)


def continuation_ids(session: AgentSession, tokenizer: Tokenizer, steps: int) -> list[int]:
    """The first `steps` ids of `continuation_text`: the teacher-forced decode tokens after the prompt.

    The prompt ends in a special token (the thinking opener), a hard boundary for every tokenizer,
    so encoding the continuation on its own gives the ids the whole text would.
    """
    ids = tokenizer.encode(continuation_text(session, tokenizer, steps))
    return ids[:steps]
