"""Reading a scenario YAML file into a `harness.scenario.schema.Scenario`, with every problem reported as
`file:line: field.path: problem` (all of them at once, in a `ScenarioError`); and finding shipped scenarios.

Patch ids and options are checked against the patch registry (built-ins plus the scenario's plugin
modules) at load time, so a typo fails before any model is built, naming the variant.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from pathlib import Path
from typing import Any, Callable, Sequence

from harness.scenario.chat_encoding import ROLES, Message, ToolCall, render_chat
from harness.scenario.schema import (
    CANONICAL_TAPS, DECODE_KEYWORDS, DEFAULT_CHUNK_SIZE, DTYPES, GENERATOR_KINDS, NAME_PATTERN, PARITY_SWITCHES,
    PROMPT_SOURCES, TAP_PATTERN, TOKENIZER_KEYWORDS, VARIANT_NAME_PATTERN, DecodeSpec, DumpSpec, EngineSpec,
    GateSpec, GeneratorSpec, MeasureSpec, ModelSpec, PrefillSpec, ProbesSpec, PromptSpec, ReferenceSpec, Scenario,
    StacksSpec, VariantSpec)
from harness.scenario.yaml_source import Issue, Located, ScenarioError, read_located, load_located

SCENARIOS_DIR = Path(__file__).resolve().parents[2] / "scenarios"
"""The scenarios shipped with the harness (the repository's top-level `scenarios/`)."""

class _Bad(Exception):
    """A value does not fit its field; the message is the problem."""


_REQUIRED = object()


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int):
        return f"an integer ({value})"
    if isinstance(value, float):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, dict):
        return "a mapping"
    return "a list"


def _suggest(word: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _plain(located: Located) -> Any:
    """A Located tree as plain Python values."""
    if isinstance(located.value, dict):
        return {key: _plain(value) for key, value in located.value.items()}
    if isinstance(located.value, list):
        return [_plain(item) for item in located.value]
    return located.value


# Value checks: each takes a Located and returns the Python value or raises _Bad.


def _integer(minimum: int | None = None) -> Callable[[Located], int]:
    def check(loc: Located) -> int:
        if isinstance(loc.value, bool) or not isinstance(loc.value, int):
            raise _Bad(f"expected an integer, got {_describe(loc.value)}")
        if minimum is not None and loc.value < minimum:
            raise _Bad(f"must be {'positive' if minimum == 1 else f'at least {minimum}'}, got {loc.value}")
        return loc.value

    return check


def _boolean(loc: Located) -> bool:
    if not isinstance(loc.value, bool):
        raise _Bad(f"expected true or false, got {_describe(loc.value)}")
    return loc.value


def _string(loc: Located) -> str:
    if not isinstance(loc.value, str):
        raise _Bad(f"expected a string, got {_describe(loc.value)}")
    return loc.value


def _matching(pattern: re.Pattern[str], what: str) -> Callable[[Located], str]:
    def check(loc: Located) -> str:
        text = _string(loc)
        if not pattern.fullmatch(text):
            raise _Bad(f"{text!r} is not a valid {what} (allowed: {pattern.pattern})")
        return text

    return check


def _choice(options: Sequence[str]) -> Callable[[Located], str]:
    def check(loc: Located) -> str:
        if not isinstance(loc.value, str) or loc.value not in options:
            shown = _describe(loc.value) if not isinstance(loc.value, str) else repr(loc.value)
            hint = _suggest(loc.value, options) if isinstance(loc.value, str) else ""
            raise _Bad(f"expected one of {', '.join(options)}; got {shown}{hint}")
        return loc.value

    return check


class _Reader:
    """Walks the Located tree, collecting every issue and the line of every field it reads."""

    def __init__(self, file: str, base_dir: Path):
        self.file = file
        self.base_dir = base_dir
        self.issues: list[Issue] = []
        self.lines: dict[str, int] = {}

    def fail(self, line: int, path: str, problem: str) -> None:
        self.issues.append(Issue(self.file, line, path, problem))

    def section(self, fields: dict[str, Located], key: str, path: str, known: Sequence[str],
                required: bool = False, parent_line: int = 1) -> dict[str, Located] | None:
        """fields[key] as a mapping whose keys are all in `known`; {} when absent; None when unusable."""
        if key not in fields:
            if required:
                self.fail(parent_line, path, "required section is missing")
                return None
            return {}
        return self.mapping(fields[key], path, known)

    def line(self, path: str) -> int:
        return self.lines.get(path, 1)

    def mapping(self, loc: Located, path: str, known: Sequence[str] | None) -> dict[str, Located] | None:
        """loc as a mapping; with `known`, every key must be one of them (None: free keys, e.g. needle names)."""
        self.lines[path] = loc.key_line
        if not isinstance(loc.value, dict):
            expected = f"a mapping with keys {', '.join(known)}" if known else "a mapping"
            self.fail(loc.line, path, f"expected {expected}; got {_describe(loc.value)}")
            return None
        for key, value in loc.value.items():
            if known is not None and key not in known:
                self.fail(value.key_line, f"{path}.{key}" if path else key,
                          f"unknown key{_suggest(key, known)} (known: {', '.join(known)})")
        return loc.value

    def value(self, fields: dict[str, Located], key: str, path: str, check: Callable[[Located], Any],
              default: Any = _REQUIRED, parent_line: int = 1) -> Any:
        """fields[key] checked, or the default when absent (an issue when required)."""
        if key not in fields:
            if default is _REQUIRED:
                self.fail(parent_line, path, "required field is missing")
                return None
            return default
        return self.check(fields[key], path, check)

    def check(self, loc: Located, path: str, check: Callable[[Located], Any]) -> Any:
        self.lines[path] = loc.key_line
        try:
            return check(loc)
        except _Bad as e:
            self.fail(loc.line, path, str(e))
            return None

    def items(self, fields: dict[str, Located], key: str, path: str, check: Callable[[Located], Any],
              unique: bool = False) -> list[Any] | None:
        """fields[key] as a list with every item checked; [] when absent; None on any bad item."""
        if key not in fields:
            return []
        loc = fields[key]
        self.lines[path] = loc.key_line
        if not isinstance(loc.value, list):
            self.fail(loc.line, path, f"expected a list, got {_describe(loc.value)}")
            return None
        values, ok = [], True
        for index, item in enumerate(loc.value):
            value = self.check(item, f"{path}[{index}]", check)
            if value is None:
                ok = False
            elif unique and value in values:
                self.fail(item.line, f"{path}[{index}]", f"{value!r} is listed twice")
                ok = False
            values.append(value)
        return values if ok else None

    def path_field(self, loc: Located, path: str, must_be: str) -> Path | None:
        """A file or directory path, relative to the scenario file, that must exist."""
        text = self.check(loc, path, _string)
        if text is None:
            return None
        resolved = (self.base_dir / Path(text).expanduser()).resolve()
        exists = resolved.is_dir() if must_be == "directory" else resolved.is_file()
        if not exists:
            self.fail(loc.line, path, f"{must_be} {text!r} does not exist (looked for {resolved})")
            return None
        return resolved


def parse_scenario(text: str, file: str = "<string>", base_dir: str | Path | None = None) -> Scenario:
    """A Scenario from YAML text; relative paths resolve against `base_dir` (default: the current directory)."""
    located = load_located(text, file)
    return _build(located, file, Path(base_dir) if base_dir is not None else Path.cwd())


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; raises ScenarioError listing every problem as file:line: field: problem."""
    p = Path(path)
    located = read_located(p)
    return _build(located, str(p), p.resolve().parent)


def shipped_scenarios() -> list[Path]:
    """The scenario files in the repository's `scenarios/` directory, by name."""
    return sorted(SCENARIOS_DIR.glob("*.yaml"))


def find_scenario(name_or_path: str | Path) -> Path:
    """A scenario argument: an existing file path, or the name of a shipped scenario (`demo-cpu`)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    shipped = SCENARIOS_DIR / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    names = [s.stem for s in shipped_scenarios()]
    raise ScenarioError([Issue(str(p), 1, "", f"no such scenario file, nor a shipped scenario name"
                                               f"{_suggest(str(name_or_path), names)} (shipped: {', '.join(names)})")])


_TOP_KEYS = ("name", "description", "model", "prompt", "tokenizer", "prefill", "decode", "stacks", "measure",
             "probes", "gate")


def _build(located: Located, file: str, base_dir: Path) -> Scenario:
    reader = _Reader(file, base_dir)
    top = reader.mapping(located, "", _TOP_KEYS)
    if top is None:
        raise ScenarioError(reader.issues)
    root_line = located.line
    name = reader.value(top, "name", "name", _matching(NAME_PATTERN, "scenario name"), parent_line=root_line)
    description = reader.value(top, "description", "description", _string, "") or ""
    model = _model(reader, top, root_line)
    prompt = _prompt(reader, top, root_line)
    tokenizer = _tokenizer(reader, top)
    prefill = _prefill(reader, top)
    decode = _decode(reader, top, prompt)
    stacks = _stacks(reader, top)
    measure = _measure(reader, top)
    probes = _probes(reader, top)
    gate = _gate(reader, top)
    if reader.issues:
        raise ScenarioError(reader.issues)
    return Scenario(name=name, description=description, model=model, prompt=prompt, tokenizer=tokenizer,
                    prefill=prefill, decode=decode, stacks=stacks, measure=measure, probes=probes, gate=gate,
                    file=file, field_lines=dict(reader.lines))


def _model(reader: _Reader, top: dict[str, Located], root_line: int) -> ModelSpec | None:
    fields = reader.section(top, "model", "model", ("preset", "seed", "checkpoint"), True, root_line)
    if fields is None:
        return None
    line = top["model"].line
    from reference.config import PRESETS

    if ("preset" in fields) == ("checkpoint" in fields):
        reader.fail(line, "model", "give exactly one of preset (synthetic weights) or checkpoint (a directory)")
        return None
    if "checkpoint" in fields:
        if "seed" in fields:
            reader.fail(fields["seed"].key_line, "model.seed", "seed applies to synthetic weights (preset) only")
        checkpoint = reader.path_field(fields["checkpoint"], "model.checkpoint", "directory")
        return ModelSpec(checkpoint=checkpoint) if checkpoint else None
    preset = reader.value(fields, "preset", "model.preset", _choice(sorted(PRESETS)))
    seed = reader.value(fields, "seed", "model.seed", _integer(0), 0)
    return ModelSpec(preset=preset, seed=seed) if preset else None


_MESSAGE_KEYS = ("role", "content", "reasoning", "interrupted", "tool_calls", "tools", "needles")
_PROMPT_KEYS = ("messages", "thinking", "keep_earlier_reasoning", "token_file", "decode_token_file", "turn_starts",
                "needle_spans", "generator")
_SOURCE_ONLY_KEYS = {
    "messages": ("thinking", "keep_earlier_reasoning"),
    "token_file": ("decode_token_file", "turn_starts", "needle_spans"),
    "generator": (),
}


def _prompt(reader: _Reader, top: dict[str, Located], root_line: int) -> PromptSpec | None:
    fields = reader.section(top, "prompt", "prompt", _PROMPT_KEYS, True, root_line)
    if fields is None:
        return None
    line = top["prompt"].line
    sources = [s for s in PROMPT_SOURCES if s in fields]
    if len(sources) != 1:
        where = max(fields[s].key_line for s in sources) if len(sources) > 1 else line
        given = f"; got {' and '.join(sources)}" if sources else ""
        reader.fail(where, "prompt", f"give exactly one prompt source: {', '.join(PROMPT_SOURCES)}{given}")
        return None
    source = sources[0]
    for other, keys in _SOURCE_ONLY_KEYS.items():
        for key in keys:
            if key in fields and other != source:
                reader.fail(fields[key].key_line, f"prompt.{key}", f"applies to {other} prompts only, "
                                                                   f"this prompt uses {source}")
    if source == "generator":
        generator = _generator(reader, fields["generator"])
        return PromptSpec("generator", generator=generator) if generator else None
    if source == "token_file":
        return _token_file_prompt(reader, fields)
    thinking = reader.value(fields, "thinking", "prompt.thinking", _boolean, True)
    keep = reader.value(fields, "keep_earlier_reasoning", "prompt.keep_earlier_reasoning", _boolean, False)
    messages = _messages(reader, fields["messages"], thinking, keep)
    if messages is None or thinking is None or keep is None:
        return None
    return PromptSpec("messages", messages=messages, thinking=thinking, keep_earlier_reasoning=keep)


def _generator(reader: _Reader, loc: Located) -> GeneratorSpec | None:
    path = "prompt.generator"
    fields = reader.mapping(loc, path, ("kind", "seed", "target_tokens", "turns", "needles", "thinking"))
    if fields is None:
        return None
    values = dict(
        kind=reader.value(fields, "kind", f"{path}.kind", _choice(GENERATOR_KINDS), "agent-session"),
        seed=reader.value(fields, "seed", f"{path}.seed", _integer(0), 0),
        target_tokens=reader.value(fields, "target_tokens", f"{path}.target_tokens", _integer(1),
                                   parent_line=loc.line),
        turns=reader.value(fields, "turns", f"{path}.turns", _integer(1), 4),
        needles=reader.value(fields, "needles", f"{path}.needles", _integer(0), 3),
        thinking=reader.value(fields, "thinking", f"{path}.thinking", _boolean, True),
    )
    return None if any(v is None for v in values.values()) else GeneratorSpec(**values)


def _token_file_prompt(reader: _Reader, fields: dict[str, Located]) -> PromptSpec | None:
    token_file = reader.path_field(fields["token_file"], "prompt.token_file", "file")
    decode_file = None
    if "decode_token_file" in fields:
        decode_file = reader.path_field(fields["decode_token_file"], "prompt.decode_token_file", "file")
    starts = reader.items(fields, "turn_starts", "prompt.turn_starts", _integer(0))
    if starts:
        for index, (before, after) in enumerate(zip(starts, starts[1:]), 1):
            if after <= before:
                reader.fail(fields["turn_starts"].value[index].line, f"prompt.turn_starts[{index}]",
                            f"turn starts must increase; {after} follows {before}")
    needle_spans: dict[str, tuple[int, int]] = {}
    if "needle_spans" in fields:
        spans = reader.mapping(fields["needle_spans"], "prompt.needle_spans", None)
        for name, loc in (spans or {}).items():
            path = f"prompt.needle_spans.{name}"
            pair = reader.items({name: loc}, name, path, _integer(0))
            if pair is None:
                continue
            if len(pair) != 2 or pair[1] <= pair[0]:
                reader.fail(loc.line, path, f"expected [start, end) with start < end, got {pair}")
                continue
            needle_spans[name] = (pair[0], pair[1])
    if token_file is None or starts is None or ("decode_token_file" in fields and decode_file is None):
        return None
    return PromptSpec("token_file", token_file=token_file, decode_token_file=decode_file, turn_starts=tuple(starts),
                      needle_spans=needle_spans)


def _messages(reader: _Reader, loc: Located, thinking: bool, keep: bool) -> tuple[Message, ...] | None:
    path = "prompt.messages"
    reader.lines[path] = loc.key_line
    if not isinstance(loc.value, list) or not loc.value:
        reader.fail(loc.line, path, f"expected a non-empty list of messages, got {_describe(loc.value)}"
                    if not isinstance(loc.value, list) else "expected at least one message")
        return None
    messages: list[Message] = []
    for index, item in enumerate(loc.value):
        message = _message(reader, item, f"{path}[{index}]")
        if message is None:
            return None
        messages.append(message)
    last = messages[-1]
    if last.role == "assistant" and last.needles:
        reader.fail(loc.value[-1].line, f"{path}[{len(messages) - 1}].needles",
                    "a final assistant message is the decode continuation, not prompt: needles must be in the prompt")
    prompt_messages = messages[:-1] if last.role == "assistant" else messages
    try:
        render_chat(prompt_messages, thinking=thinking, keep_earlier_reasoning=keep)
        render_chat(messages, thinking=thinking, keep_earlier_reasoning=keep)
    except ValueError as e:  # chat_encoding names the message: "message 3 (tool): …"
        found = re.match(r"message (\d+)", str(e))
        index = int(found.group(1)) if found else 0
        reader.fail(loc.value[index].line, f"{path}[{index}]", re.sub(r"^message \d+( \(\w+\))?: ", "", str(e)))
        return None
    return tuple(messages)


def _message(reader: _Reader, loc: Located, path: str) -> Message | None:
    fields = reader.mapping(loc, path, _MESSAGE_KEYS)
    if fields is None:
        return None
    role = reader.value(fields, "role", f"{path}.role", _choice(ROLES), parent_line=loc.line)
    content = reader.value(fields, "content", f"{path}.content", _string, "")
    reasoning = reader.value(fields, "reasoning", f"{path}.reasoning", _string, None)
    interrupted = reader.value(fields, "interrupted", f"{path}.interrupted", _boolean, False)
    tool_calls = []
    if "tool_calls" in fields:
        calls = reader.items(fields, "tool_calls", f"{path}.tool_calls", lambda item: item)
        for index, call in enumerate(calls or []):
            call_path = f"{path}.tool_calls[{index}]"
            call_fields = reader.mapping(call, call_path, ("name", "arguments"))
            if call_fields is None:
                continue
            name = reader.value(call_fields, "name", f"{call_path}.name", _string, parent_line=call.line)
            arguments = {}
            if "arguments" in call_fields:
                arguments_loc = call_fields["arguments"]
                reader.lines[f"{call_path}.arguments"] = arguments_loc.key_line
                if not isinstance(arguments_loc.value, dict):
                    reader.fail(arguments_loc.line, f"{call_path}.arguments",
                                f"expected a mapping of argument names to values, got {_describe(arguments_loc.value)}")
                else:
                    arguments = _plain(arguments_loc)
            if name is not None:
                tool_calls.append(ToolCall(name, arguments))
    tools = []
    if "tools" in fields:
        for index, tool in enumerate(reader.items(fields, "tools", f"{path}.tools", lambda item: item) or []):
            if not isinstance(tool.value, dict):
                reader.fail(tool.line, f"{path}.tools[{index}]", f"expected a tool schema mapping, got "
                                                                 f"{_describe(tool.value)}")
            else:
                tools.append(_plain(tool))
    needles: dict[str, str] = {}
    if "needles" in fields:
        needles_loc = fields["needles"]
        reader.lines[f"{path}.needles"] = needles_loc.key_line
        if not isinstance(needles_loc.value, dict):
            reader.fail(needles_loc.line, f"{path}.needles", f"expected a mapping of needle name to text, got "
                                                             f"{_describe(needles_loc.value)}")
        for name, text_loc in (needles_loc.value if isinstance(needles_loc.value, dict) else {}).items():
            text = reader.check(text_loc, f"{path}.needles.{name}", _string)
            if text == "":
                reader.fail(text_loc.line, f"{path}.needles.{name}", "a needle must be a non-empty substring")
            elif text is not None:
                needles[name] = text
    if None in (role, content, interrupted) or (reasoning is None and "reasoning" in fields):
        return None
    return Message(role, content, reasoning, tuple(tool_calls), tuple(tools), interrupted, needles)


def _tokenizer(reader: _Reader, top: dict[str, Located]) -> str | Path:
    if "tokenizer" not in top:
        return "auto"
    loc = top["tokenizer"]
    text = reader.check(loc, "tokenizer", _string)
    if text is None or text in TOKENIZER_KEYWORDS:
        return text or "auto"
    directory = reader.path_field(loc, "tokenizer", "directory")
    if directory is not None and not (directory / "tokenizer.json").is_file():
        reader.fail(loc.line, "tokenizer", f"{directory} holds no tokenizer.json (expected auto, fallback or a "
                                           "directory with tokenizer.json)")
    return directory or "auto"


def _prefill(reader: _Reader, top: dict[str, Located]) -> PrefillSpec:
    fields = reader.section(top, "prefill", "prefill", ("chunk_size", "reference_chunk_size")) or {}
    chunk = reader.value(fields, "chunk_size", "prefill.chunk_size", _integer(1), DEFAULT_CHUNK_SIZE)
    reference_chunk = chunk
    if "reference_chunk_size" in fields:
        loc = fields["reference_chunk_size"]
        reader.lines["prefill.reference_chunk_size"] = loc.key_line
        reference_chunk = None if loc.value is None else reader.check(loc, "prefill.reference_chunk_size",
                                                                      _integer(1))
    return PrefillSpec(chunk or DEFAULT_CHUNK_SIZE, reference_chunk)


def _decode(reader: _Reader, top: dict[str, Located], prompt: PromptSpec | None) -> DecodeSpec:
    fields = reader.section(top, "decode", "decode", ("steps", "tokens")) or {}
    tokens, ids = "continuation", ()
    if "tokens" in fields:
        loc = fields["tokens"]
        if isinstance(loc.value, list):
            ids = tuple(reader.items(fields, "tokens", "decode.tokens", _integer(0)) or ())
            tokens = "ids"
        else:
            tokens = reader.check(loc, "decode.tokens", _choice(DECODE_KEYWORDS)) or "continuation"
    steps = reader.value(fields, "steps", "decode.steps", _integer(0), len(ids) if tokens == "ids" else 16)
    if steps is None:
        return DecodeSpec()
    if tokens == "ids" and len(ids) != steps:
        reader.fail(fields["tokens"].line, "decode.tokens", f"{len(ids)} ids given for {steps} decode steps")
    if prompt is not None:
        _check_decode_source(reader, fields, prompt, tokens, steps)
    return DecodeSpec(steps, tokens, ids)


def _check_decode_source(reader: _Reader, fields: dict[str, Located], prompt: PromptSpec, tokens: str,
                         steps: int) -> None:
    line = fields["tokens"].line if "tokens" in fields else reader.line("decode")
    tokens_label = tokens if "tokens" in fields else f"{tokens} (the default)"
    final_assistant = prompt.continuation_message is not None
    if prompt.source == "messages" and final_assistant and tokens != "continuation":
        reader.fail(line, "decode.tokens", f"the final assistant message is the continuation, but decode.tokens is "
                                           f"{tokens}: remove that message or use tokens: continuation")
    if tokens != "continuation" or steps == 0:
        if prompt.decode_token_file is not None:
            reader.fail(line, "decode.tokens", "prompt.decode_token_file is given but decode.tokens is not "
                                               "continuation (with steps > 0)")
        return
    if prompt.source == "messages" and not final_assistant:
        reader.fail(line, "decode.tokens", f"{tokens_label} with explicit messages needs a final assistant "
                                           "message (its tokens are decoded); or use tokens: greedy, a list of ids "
                                           "or steps: 0")
    if prompt.source == "token_file" and prompt.decode_token_file is None:
        reader.fail(line, "decode.tokens", f"{tokens_label} with a token_file prompt needs "
                                           "prompt.decode_token_file; or use tokens: greedy, a list of ids or "
                                           "steps: 0")


_VARIANT_KEYS = ("name", "patches", "options")


def _stacks(reader: _Reader, top: dict[str, Located]) -> StacksSpec:
    fields = reader.section(top, "stacks", "stacks",
                            ("reference", "yardstick", "engine", "variants", "patch_modules")) or {}
    reference_fields = reader.section(fields, "reference", "stacks.reference", ("dtype", "parity")) or {}
    reference = ReferenceSpec(
        dtype=reader.value(reference_fields, "dtype", "stacks.reference.dtype", _choice(DTYPES), "float32")
        or "float32",
        parity=tuple(reader.items(reference_fields, "parity", "stacks.reference.parity", _choice(PARITY_SWITCHES),
                                  unique=True) or ()),
    )
    yardstick = reader.value(fields, "yardstick", "stacks.yardstick", _boolean, True)
    engine_fields = reader.section(fields, "engine", "stacks.engine", ("indexer_fp4",)) or {}
    engine = EngineSpec(reader.value(engine_fields, "indexer_fp4", "stacks.engine.indexer_fp4", _boolean, False)
                        or False)

    registry, modules = _registry(reader, fields)
    variants: list[VariantSpec] = []
    if "variants" not in fields:
        variants = [VariantSpec("base"), VariantSpec("all", tuple(registry.built_in_ids()) if registry else (),
                                                     patches_as_written="all")]
    else:
        loc = fields["variants"]
        reader.lines["stacks.variants"] = loc.key_line
        if not isinstance(loc.value, list) or not loc.value:
            reader.fail(loc.line, "stacks.variants", "expected a non-empty list of variants ({name, patches, "
                                                     f"options}}); got {_describe(loc.value)}"
                        if not isinstance(loc.value, list) else "at least one variant is needed")
        else:
            seen: dict[str, int] = {}
            for index, item in enumerate(loc.value):
                name_loc = item.value.get("name") if isinstance(item.value, dict) else None
                if name_loc is not None and isinstance(name_loc.value, str):
                    if name_loc.value in seen:
                        reader.fail(name_loc.line, f"stacks.variants[{index}].name",
                                    f"duplicate variant name {name_loc.value!r} (first used on line "
                                    f"{seen[name_loc.value]})")
                        continue
                    seen[name_loc.value] = name_loc.line
                variant = _variant(reader, item, f"stacks.variants[{index}]", registry)
                if variant is not None:
                    variants.append(variant)
    return StacksSpec(reference, True if yardstick is None else yardstick, engine, tuple(variants), modules)


def _registry(reader: _Reader, fields: dict[str, Located]):
    """The built-in registry plus each plugin module, loaded one at a time so a failure names its entry."""
    from optimized.patching import PatchError, PatchRegistry, load_plugin
    from optimized.patches import BUILT_IN_PATCHES

    registry = PatchRegistry()
    for patch in BUILT_IN_PATCHES:
        registry.add(patch)
    specs = reader.items(fields, "patch_modules", "stacks.patch_modules", _string)
    modules: list[str] = []
    for index, spec in enumerate(specs or []):
        path = f"stacks.patch_modules[{index}]"
        line = fields["patch_modules"].value[index].line
        if spec.endswith(".py") or "/" in spec or "\\" in spec:
            resolved = (reader.base_dir / Path(spec).expanduser()).resolve()
            if not resolved.is_file():
                reader.fail(line, path, f"patch module file {spec!r} does not exist (looked for {resolved})")
                continue
            spec = str(resolved)
        try:
            load_plugin(registry, spec)
        except PatchError as e:
            reader.fail(line, path, str(e))
            continue
        modules.append(spec)
    return registry, tuple(modules)


def _variant(reader: _Reader, loc: Located, path: str, registry) -> VariantSpec | None:
    from optimized.patching import PatchError

    fields = reader.mapping(loc, path, _VARIANT_KEYS)
    if fields is None:
        return None
    name = reader.value(fields, "name", f"{path}.name", _matching(VARIANT_NAME_PATTERN, "variant name"),
                        parent_line=loc.line)
    if name is None:
        return None
    where = f"variant {name!r}"
    patch_ids: list[str] = []
    written: str | tuple[str, ...] = ()
    ok = True
    if "patches" in fields:
        patches_loc = fields["patches"]
        reader.lines[f"{path}.patches"] = patches_loc.key_line
        if patches_loc.value in ("all", "none"):
            written = patches_loc.value
            patch_ids = registry.built_in_ids() if patches_loc.value == "all" else []
        elif isinstance(patches_loc.value, list):
            known = registry.ids()
            for index, item in enumerate(patches_loc.value):
                item_path = f"{path}.patches[{index}]"
                pid = reader.check(item, item_path, _string)
                if pid is None:
                    ok = False
                elif pid not in known:
                    reader.fail(item.line, item_path, f"{where}: unknown patch {pid!r}{_suggest(pid, known)} "
                                                      f"(known: {', '.join(known)})")
                    ok = False
                elif pid in patch_ids:
                    reader.fail(item.line, item_path, f"{where}: patch {pid!r} is listed twice")
                    ok = False
                else:
                    patch_ids.append(pid)
            written = tuple(patch_ids)
        else:
            reader.fail(patches_loc.line, f"{path}.patches", f"{where}: expected a list of patch ids, all or none; "
                                                             f"got {_describe(patches_loc.value)}")
            ok = False
    options: dict[str, dict[str, Any]] = {}
    if "options" in fields:
        options_loc = fields["options"]
        reader.lines[f"{path}.options"] = options_loc.key_line
        if not isinstance(options_loc.value, dict):
            reader.fail(options_loc.line, f"{path}.options", f"{where}: expected a mapping of patch id to its "
                                                             f"options; got {_describe(options_loc.value)}")
            return None
        for pid, patch_options in options_loc.value.items():
            options_path = f"{path}.options.{pid}"
            reader.lines[options_path] = patch_options.key_line
            if pid not in patch_ids:
                hint = _suggest(pid, patch_ids) if patch_ids else ""
                reader.fail(patch_options.key_line, options_path,
                            f"{where}: options for patch {pid!r}, which this variant does not select{hint} "
                            f"(selected: {', '.join(patch_ids) or 'none'})")
                ok = False
                continue
            checked = _patch_options(reader, patch_options, options_path, registry.get(pid), where)
            if checked is None:
                ok = False
            else:
                options[pid] = checked
    if not ok:
        return None
    try:  # the registry's own check, so a scenario accepts exactly what the engine will
        registry.choose(list(patch_ids), {pid: dict(o) for pid, o in options.items()})
    except PatchError as e:
        reader.fail(loc.line, path, f"{where}: {e}")
        return None
    return VariantSpec(name, tuple(patch_ids), options, written)


def _patch_options(reader: _Reader, loc: Located, path: str, patch, where: str) -> dict[str, Any] | None:
    if not isinstance(loc.value, dict):
        reader.fail(loc.line, path, f"{where}: expected a mapping of option names to values; got "
                                    f"{_describe(loc.value)}")
        return None
    known = sorted(patch.defaults)
    options, ok = {}, True
    for key, value_loc in loc.value.items():
        option_path = f"{path}.{key}"
        reader.lines[option_path] = value_loc.key_line
        if key not in patch.defaults:
            reader.fail(value_loc.key_line, option_path,
                        f"{where}: patch {patch.id!r} has no option {key!r}{_suggest(key, known)} "
                        f"(options: {', '.join(known) or 'none'})")
            ok = False
            continue
        value = _plain(value_loc)
        problem = patch.option_problem(key, value)  # the patch's own choices (a string "false" is not false)
        if problem:
            reader.fail(value_loc.line, option_path, f"{where}: patch {patch.id!r}: {problem}")
            ok = False
            continue
        options[key] = value
    return options if ok else None


def _measure(reader: _Reader, top: dict[str, Located]) -> MeasureSpec:
    fields = reader.section(top, "measure", "measure", ("local", "force_decisions")) or {}
    local = reader.value(fields, "local", "measure.local", _boolean, True)
    force = reader.value(fields, "force_decisions", "measure.force_decisions", _boolean, False)
    return MeasureSpec(True if local is None else local, bool(force))


def _tap_pattern(loc: Located) -> str:
    text = _matching(TAP_PATTERN, "tap name or pattern")(loc)
    if not any(fnmatch.fnmatchcase(tap, text) for tap in CANONICAL_TAPS):
        raise _Bad(f"{text!r} matches no tap{_suggest(text, CANONICAL_TAPS)} (taps: {', '.join(CANONICAL_TAPS)})")
    return text


def _probes(reader: _Reader, top: dict[str, Located]) -> ProbesSpec:
    fields = reader.section(top, "probes", "probes", ("bin_size", "attn_sample_every", "logits_sample_every",
                                                      "dump")) or {}
    dump_fields = reader.section(fields, "dump", "probes.dump", ("positions", "taps")) or {}
    dump = DumpSpec(
        positions=tuple(reader.items(dump_fields, "positions", "probes.dump.positions", _integer(0), unique=True)
                        or ()),
        taps=tuple(reader.items(dump_fields, "taps", "probes.dump.taps", _tap_pattern, unique=True) or ()),
    )
    return ProbesSpec(
        bin_size=reader.value(fields, "bin_size", "probes.bin_size", _integer(1), 512) or 512,
        attn_sample_every=reader.value(fields, "attn_sample_every", "probes.attn_sample_every", _integer(1), 64)
        or 64,
        logits_sample_every=reader.value(fields, "logits_sample_every", "probes.logits_sample_every", _integer(1),
                                         256) or 256,
        dump=dump,
    )


def _gate(reader: _Reader, top: dict[str, Located]) -> GateSpec:
    fields = reader.section(top, "gate", "gate", ("policy",)) or {}
    if "policy" not in fields:
        return GateSpec()
    loc = fields["policy"]
    if loc.value == "default":
        reader.lines["gate.policy"] = loc.key_line
        return GateSpec()
    policy = reader.path_field(loc, "gate.policy", "file")
    return GateSpec(policy or "default")
