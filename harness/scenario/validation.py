"""Pydantic models read from YAML that remembers its lines: every validation error becomes `file:line: field: problem`.

Scenario and gate-policy files are described by pydantic v2 models, whose JSON Schema lets editors complete and
check the files while they are written (the YAML language server's `# yaml-language-server: $schema=…` line).
Pydantic names a problem by a location — a tuple of keys and list indices — in its own words; users of this
harness read `file:line: field.path: problem`, with a did-you-mean for a misspelt key or value.
`validate_located` bridges the two for both kinds of file: it validates the plain data of a `Located` tree and maps
each error's location back to the YAML node it names. A problem with a key points at the key's line, one with a
scalar at the value's line, one with a mapping or list (or a field missing from it) at the line of its key.

Validators that see more than one field (exactly one prompt source, patches against the registry, …) raise
`problem(text, at=…)`: `at` is a location relative to what is being validated, so a rule checked on a whole
variant can still point at its second patch.
"""

from __future__ import annotations

import difflib
import json
import re
import types
from typing import Annotated, Any, ClassVar, Mapping, Sequence, Union, get_args, get_origin

from annotated_types import Ge
from pydantic import AfterValidator, BaseModel, ConfigDict, PrivateAttr, Strict, ValidationError, WithJsonSchema
from pydantic_core import PydanticCustomError

from harness.scenario.yaml_source import Issue, Located, ScenarioError

# YAML scalars are taken as written: `1` is not true, `"5"` is not 5, 2.0 is not an integer (pydantic's lax mode
# would convert all three). Lists still validate as tuples: the models are immutable.
Int = Annotated[int, Strict()]
NonNegInt = Annotated[int, Strict(), Ge(0)]
PositiveInt = Annotated[int, Strict(), Ge(1)]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]

Loc = tuple[str | int, ...]
_PROBLEM = "problem"


class Model(BaseModel):
    """A section of a file: unknown keys are errors (with a did-you-mean), and a loaded value does not change."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class FileModel(Model):
    """A whole file: remembers where it was read from and the line of every field, for problems found later (a
    prompt too short for its decode steps, an expression naming an unknown config field)."""

    error_type: ClassVar[type[ScenarioError]] = ScenarioError
    _file: str = PrivateAttr("<string>")
    _lines: Mapping[str, int] = PrivateAttr(default_factory=dict)

    def model_post_init(self, context: Any) -> None:
        if isinstance(context, dict):  # validate_located's context: runs before the model's own after-validators
            self._file = context.get("file", self._file)
            self._lines = context.get("lines", self._lines)

    @property
    def file(self) -> str:
        return self._file

    def line_of(self, field_path: str) -> int:
        """The line a field was written on; for a defaulted field, its nearest written parent's line."""
        path = field_path
        while path:
            if path in self._lines:
                return self._lines[path]
            path = re.sub(r"(\.[^.\[\]]+|\[\d+\])$", "", path) if re.search(r"[.\[]", path) else ""
        return 1

    def error(self, field_path: str, problem: str) -> ScenarioError:
        """An error pointing at a field, for problems found after loading (e.g. when the prompt is resolved)."""
        return self.error_type([Issue(self.file, self.line_of(field_path), field_path, problem)])


def problem(text: str, *, at: Loc = (), line_at: Sequence[Loc] = (), first: Loc | None = None) -> PydanticCustomError:
    """A validation error worded for users. `at`: where, relative to what is being validated. `line_at`: report the
    line of the latest written of these (relative) locations instead, keeping the field path. `first`: a duplicate's
    first occurrence, whose line the message cites."""
    return PydanticCustomError(_PROBLEM, "{problem}", {"problem": text, "at": at, "line_at": tuple(line_at),
                                                       "first": first})


def suggest(word: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def describe(value: Any) -> str:
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
    return "a mapping" if isinstance(value, dict) else "a list"


def not_one_of(value: Any, options: Sequence[str]) -> str:
    """The problem of a value outside a fixed set of words."""
    shown = repr(value) if isinstance(value, str) else describe(value)
    hint = suggest(value, options) if isinstance(value, str) else ""
    return f"expected one of {', '.join(options)}; got {shown}{hint}"


def matching(pattern: re.Pattern[str], what: str) -> Any:
    """A string type that must match `pattern` (the JSON Schema says so too)."""
    def check(text: str) -> str:
        if not pattern.fullmatch(text):
            raise problem(f"{text!r} is not a valid {what} (allowed: {pattern.pattern})")
        return text
    return Annotated[Str, AfterValidator(check), WithJsonSchema({"type": "string", "pattern": f"^{pattern.pattern}$"})]


def validate_located(model: type[BaseModel], located: Located, file: str, *, error: type[ScenarioError] = ScenarioError,
                     context: dict[str, Any] | None = None) -> Any:
    """`model` validated from a Located tree; raises `error` listing every problem as `file:line: field: problem`.

    `context` reaches the validators (with `file` and `lines`, the line of every written field, added)."""
    lines = lines_of(located)
    try:
        return model.model_validate(plain(located), context={**(context or {}), "file": file, "lines": lines})
    except ValidationError as e:
        issues = [_issue(model, located, file, err) for err in e.errors() if not _consequence(err)]
        raise error(sorted(issues, key=lambda issue: issue.line)) from None


def schema_json(model: type[BaseModel]) -> str:
    """The JSON Schema of a file model, as shipped beside the files and printed by the CLI."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **model.model_json_schema()}
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def plain(located: Located) -> Any:
    """A Located tree as plain Python values."""
    if isinstance(located.value, dict):
        return {key: plain(value) for key, value in located.value.items()}
    if isinstance(located.value, list):
        return [plain(item) for item in located.value]
    return located.value


def lines_of(located: Located, path: str = "") -> dict[str, int]:
    """The line of every written field and list item, by its `field.path[i]`."""
    lines = {path: located.key_line} if path else {}
    if isinstance(located.value, dict):
        for key, value in located.value.items():
            lines.update(lines_of(value, f"{path}.{key}" if path else key))
    elif isinstance(located.value, list):
        for index, item in enumerate(located.value):
            lines.update(lines_of(item, f"{path}[{index}]"))
    return lines


# --------------------------------------------------------------------------- from a pydantic error to an Issue


def _consequence(err: Mapping[str, Any]) -> bool:
    """Errors pydantic adds after a real one: a default computed from a field that failed, and a list "too short"
    because its bad items were not counted."""
    if err["type"] == "default_factory_not_called":
        return True
    given = err.get("input")
    return err["type"] == "too_short" and isinstance(given, list) and len(given) >= err["ctx"]["min_length"]


def _issue(model: type[BaseModel], root: Located, file: str, err: Mapping[str, Any]) -> Issue:
    ctx = err.get("ctx") or {}
    loc = tuple(err["loc"]) + tuple(ctx.get("at", ()))
    path, node, found = _walk(root, loc)
    line = node.key_line if err["type"] == "extra_forbidden" or "[key]" in loc else _line(node, found)
    written = [(node, found) for _, node, found in (_walk(root, loc + tuple(at)) for at in ctx.get("line_at", ()))]
    line = max([_line(node, True) for node, found in written if found] or [line])
    text = _message(model, loc, err)
    if ctx.get("first") is not None:
        text += f" (first on line {_line(_walk(root, tuple(err['loc']) + tuple(ctx['first']))[1], True)})"
    return Issue(file, line, path, text)


def _line(node: Located, whole: bool) -> int:
    """A scalar's problem is on its value's line; a mapping's or a list's, or a field missing from one, on the line
    of its key."""
    return node.line if whole and not isinstance(node.value, (dict, list)) else node.key_line


def _walk(root: Located, loc: Loc) -> tuple[str, Located, bool]:
    """The field path of `loc`, the deepest node of it the file holds, and whether that node is all of `loc`.

    Pydantic's locations also hold parts that are not in the file: a union member's tag, `[key]` for a mapping's
    key, the index 0 of a one-item list written as a bare value. They name no node and are left out."""
    path, node, found = "", root, True
    for key in loc:
        value = node.value
        if found and isinstance(value, dict) and isinstance(key, str):
            found = key in value
            node = value.get(key, node)
        elif found and isinstance(value, list) and isinstance(key, int):
            found = 0 <= key < len(value)
            node = value[key] if found else node
        elif found:
            continue
        path += f"[{key}]" if isinstance(key, int) else (f".{key}" if path else key)
    return path, node, found


def _message(model: type[BaseModel], loc: Loc, err: Mapping[str, Any]) -> str:
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == _PROBLEM:
        return ctx["problem"]
    if kind == "missing":
        section = _is_model(_type_at(model, loc))
        return f"required {'section' if section else 'field'} is missing"
    if kind == "extra_forbidden":
        known = _keys(_type_at(model, loc[:-1]))
        return f"unknown key{suggest(str(loc[-1]), known)} (known: {', '.join(known)})"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        known = _keys(_type_at(model, loc))
        return f"expected a mapping{' with keys ' + ', '.join(known) if known else ''}; got {describe(value)}"
    if kind == "literal_error":
        return not_one_of(value, re.findall(r"'([^']*)'", ctx["expected"]) or [ctx["expected"]])
    if kind == "greater_than_equal":
        bound = "positive" if ctx["ge"] == 1 else f"at least {ctx['ge']}"
        return f"must be {bound}, got {value}"
    if kind == "too_short" and ctx.get("min_length") == 1:
        return "expected a non-empty list"
    if kind == "string_too_short":
        return "must not be empty"
    expected = _EXPECTED.get(kind)
    return f"expected {expected}, got {describe(value)}" if expected else err["msg"]


_EXPECTED = {"int_type": "an integer", "int_from_float": "an integer", "bool_type": "true or false",
             "string_type": "a string", "float_type": "a number", "list_type": "a list", "tuple_type": "a list"}


def _type_at(model: type[BaseModel], loc: Loc) -> Any:
    """The type pydantic validates at `loc` (following fields, list items and mapping values); None if unknown."""
    tp: Any = model
    for key in loc:
        tp = _unwrap(tp)
        if _is_model(tp):
            fields = {info.alias or name: info for name, info in tp.model_fields.items()}
            if key not in fields:
                return None
            tp = fields[key].annotation
        elif get_origin(tp) in (tuple, list) and isinstance(key, int):
            tp = get_args(tp)[0]
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1]
        else:
            return None
    return _unwrap(tp)


def _unwrap(tp: Any) -> Any:
    """`Annotated[X, …]` → X; `X | None` → X; a union → its model member, if any."""
    while True:
        if get_origin(tp) is Annotated:
            tp = get_args(tp)[0]
        elif get_origin(tp) in (Union, types.UnionType):
            members = [a for a in get_args(tp) if a is not type(None)]
            tp = next((a for a in members if _is_model(_unwrap(a))), members[0])
        else:
            return tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _keys(tp: Any) -> list[str]:
    return [info.alias or name for name, info in tp.model_fields.items()] if _is_model(tp) else []
