"""Scenario YAML as plain data that remembers where every value was written.

Scenario files are data, never code: they are *composed* with PyYAML's SafeLoader (composing builds
the node graph and constructs nothing) and every node is then converted here by hand. Only the plain
tags are accepted — mapping, sequence, str, int, float, bool, null (timestamps read as strings) —
so a tag such as `!!python/object/apply:os.system` is reported with its file and line and never
runs. Duplicate keys, merge keys (`<<`) and non-string keys are errors too, and alias expansion is
bounded (a "billion laughs" file is an error, not an out-of-memory).

Every converted value is a `Located`: the value plus the line it starts on and the line of the key
that holds it, so schema errors read `file:line: field.path: problem`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import SafeConstructor

from harness.errors import UsageError

_YAML = "tag:yaml.org,2002:"
_SCALAR_TAGS = {_YAML + name for name in ("str", "int", "float", "bool", "null")}
_TIMESTAMP_TAG = _YAML + "timestamp"
_MAX_NODES = 200_000  # after alias expansion; the largest shipped scenario has a few hundred
_MAX_DEPTH = 64


@dataclass(frozen=True)
class Issue:
    """One problem in a scenario file; `str()` is `file:line: field.path: problem`."""

    file: str
    line: int
    path: str  # dotted field path with [i] for list items; "" for file-level problems
    problem: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.path + ': ' if self.path else ''}{self.problem}"


class ScenarioError(UsageError):
    """A scenario file is invalid; carries every issue found (one per line of the message)."""

    def __init__(self, issues: list[Issue]):
        self.issues = list(issues)
        super().__init__("\n".join(str(issue) for issue in self.issues))


@dataclass(frozen=True)
class Located:
    """A YAML value with its 1-based line and the line of the key holding it (its own line at top level).

    `value` is a Python scalar (str, int, float, bool, None), a `dict[str, Located]` in file order,
    or a `list[Located]`.
    """

    value: Any
    line: int
    key_line: int


def _tag_label(tag: str) -> str:
    return "!!" + tag[len(_YAML):] if tag.startswith(_YAML) else tag


class _Converter:
    def __init__(self, file: str, kind: str):
        self.file = file
        self.kind = kind
        self.issues: list[Issue] = []
        self.nodes_seen = 0
        self._constructor = SafeConstructor()
        self._open: set[int] = set()  # nodes being converted: meeting one again is a recursive alias

    def fail(self, line: int, path: str, problem: str) -> None:
        self.issues.append(Issue(self.file, line, path, problem))

    def convert(self, node: yaml.Node, path: str, key_line: int, depth: int = 0) -> Located | None:
        line = node.start_mark.line + 1
        if id(node) in self._open:
            self.fail(line, path, "a recursive alias (an anchor used inside itself) is not allowed")
            return None
        self._open.add(id(node))
        try:
            return self._convert(node, path, key_line, depth, line)
        finally:
            self._open.discard(id(node))

    def _convert(self, node: yaml.Node, path: str, key_line: int, depth: int, line: int) -> Located | None:
        self.nodes_seen += 1
        if self.nodes_seen > _MAX_NODES or depth > _MAX_DEPTH:
            if self.nodes_seen == _MAX_NODES + 1 or depth == _MAX_DEPTH + 1:
                self.fail(line, path, f"the document is too large or too deeply nested after alias expansion "
                                      f"(limits: {_MAX_NODES} values, depth {_MAX_DEPTH}); recursive or "
                                      "exponential aliases are not allowed")
            return None
        if isinstance(node, yaml.MappingNode):
            if node.tag != _YAML + "map":
                return self._bad_tag(node, path)
            return self._mapping(node, path, key_line, depth)
        if isinstance(node, yaml.SequenceNode):
            if node.tag != _YAML + "seq":
                return self._bad_tag(node, path)
            items = [self.convert(item, f"{path}[{i}]", item.start_mark.line + 1, depth + 1)
                     for i, item in enumerate(node.value)]
            if any(item is None for item in items):
                return None
            return Located(items, line, key_line)
        if node.tag == _TIMESTAMP_TAG:
            return Located(str(node.value), line, key_line)
        if node.tag not in _SCALAR_TAGS:
            return self._bad_tag(node, path)
        try:
            value = SafeConstructor.yaml_constructors[node.tag](self._constructor, node)
        except (yaml.YAMLError, ValueError) as e:
            self.fail(line, path, f"cannot read {_tag_label(node.tag)} value {node.value!r}: {e}")
            return None
        return Located(value, line, key_line)

    def _bad_tag(self, node: yaml.Node, path: str) -> None:
        self.fail(node.start_mark.line + 1, path,
                  f"YAML tag {_tag_label(node.tag)!r} is not allowed: {self.kind} files are plain data (mappings, "
                  "lists, strings, numbers, booleans, null) and tags never execute")
        return None

    def _mapping(self, node: yaml.MappingNode, path: str, key_line: int, depth: int) -> Located | None:
        entries: dict[str, Located] = {}
        ok = True
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if key_node.tag == _YAML + "merge":
                self.fail(line, path, "merge keys (<<) are not supported: write the fields out")
                ok = False
                continue
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != _YAML + "str":
                shown = key_node.value if isinstance(key_node, yaml.ScalarNode) else type(key_node).__name__
                self.fail(line, path, f"mapping keys must be plain strings, got {shown!r} "
                                      f"({_tag_label(key_node.tag)}); quote it")
                ok = False
                continue
            key = key_node.value
            child_path = f"{path}.{key}" if path else key
            if key in entries:
                self.fail(line, child_path, f"duplicate key (first given on line {entries[key].key_line})")
                ok = False
                continue
            value = self.convert(value_node, child_path, line, depth + 1)
            if value is None:
                ok = False
                continue
            entries[key] = value
        return Located(entries, node.start_mark.line + 1, key_line) if ok else None


NEEDS = {"scenario": "at least name, model and prompt", "policy": "a list of checks"}
"""What a file of each kind must hold at least (the message for an empty file)."""


def load_located(text: str, file: str, kind: str = "scenario") -> Located:
    """Parse one YAML document into `Located` values; raises ScenarioError naming file and line. `kind` (a key of
    NEEDS) names what the file is in messages: a policy file is not called a scenario file."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else 1
        problem = " ".join(p for p in (e.context, e.problem) if p)
        raise ScenarioError([Issue(file, line, "", f"YAML syntax error: {problem}")]) from None
    except yaml.YAMLError as e:
        raise ScenarioError([Issue(file, 1, "", f"YAML error: {e}")]) from None
    if node is None:
        raise ScenarioError([Issue(file, 1, "", f"the file is empty; a {kind} is a mapping with {NEEDS[kind]}")])
    converter = _Converter(file, kind)
    located = converter.convert(node, "", node.start_mark.line + 1)
    if converter.issues or located is None:
        raise ScenarioError(converter.issues)
    return located


def read_located(path: str | Path) -> Located:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScenarioError([Issue(str(p), 1, "", "no such scenario file")]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ScenarioError([Issue(str(p), 1, "", f"cannot read the file: {e}")]) from None
    return load_located(text, str(p))
