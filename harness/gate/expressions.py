"""Numbers in a policy: a number or an arithmetic expression over the run's model config (`1/index_topk`).

A policy's bounds, floors and slacks are written as expressions so that one policy holds for every model size:
each is evaluated against the run's own config. Evaluation walks the syntax tree and allows only numbers, names
and + - * / ** — a policy file is data and never runs code.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
import operator
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Mapping

from pydantic import PlainValidator, WithJsonSchema

from harness.errors import UsageError
from harness.scenario.validation import describe, problem


@dataclass(frozen=True)
class Expr:
    """A number or an arithmetic expression over the model config's numeric fields (`1/index_topk`)."""

    text: str
    line: int = 0
    path: str = ""

    def at(self, path: str, line_of: Callable[[str], int]) -> Expr:
        """The expression as written at `path` of the policy file, for messages when it cannot be evaluated."""
        return dataclasses.replace(self, line=line_of(path), path=path)

    def names(self) -> set[str]:
        """The names the expression reads."""
        return {n.id for n in ast.walk(_parsed(self.text)) if isinstance(n, ast.Name)}

    def evaluate(self, names: Mapping[str, float], file: str = "") -> float:
        try:
            value = float(_eval(_parsed(self.text), names))
        except KeyError as e:
            raise UsageError(f"{file}:{self.line}: {self.path}: {self.text!r} names {e.args[0]!r}, which is not a "
                             f"numeric field of this run's model config or a floor variable (known: "
                             f"{', '.join(sorted(names))})") from None
        except (ZeroDivisionError, OverflowError, ValueError) as e:
            raise UsageError(f"{file}:{self.line}: {self.path}: cannot evaluate {self.text!r}: {e}") from None
        if not math.isfinite(value) or value < 0:
            raise UsageError(f"{file}:{self.line}: {self.path}: {self.text!r} = {value} must be finite and ≥ 0")
        return value


@functools.cache
def _parsed(text: str) -> ast.expr:
    """The syntax tree of an expression, parsed once: a floor that reads the unit's positions is evaluated per unit
    (10⁴–10⁵ of them in a long run)."""
    return ast.parse(text, mode="eval").body


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow}


def _eval(node: ast.AST, names: Mapping[str, float]) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name):
        return names[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand, names)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left, names), _eval(node.right, names)
        if isinstance(node.op, ast.Pow) and abs(right) > 1024:
            raise ValueError(f"exponent {right} is out of range")
        return _BINOPS[type(node.op)](left, right)
    raise ValueError(f"only numbers, config names and + - * / ** are allowed, not {ast.dump(node)[:40]}")


def _check_expr_syntax(text: str) -> str | None:
    """None when `text` is an allowed expression, else the problem."""
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return f"{text!r} is not a number or an arithmetic expression"
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Constant, ast.Name, ast.UnaryOp, ast.BinOp, ast.USub, ast.UAdd, ast.Load)
                          + tuple(_BINOPS)):
            return f"{text!r}: only numbers, model config names and + - * / ** are allowed"
        if isinstance(node, ast.Constant) and (isinstance(node.value, bool)
                                               or not isinstance(node.value, (int, float))):
            return f"{text!r}: {node.value!r} is not a number"
    return None


def _expr(value: Any) -> Expr:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise problem(f"expected a number or an expression like \"1/index_topk\"; got {describe(value)}")
    if isinstance(value, str):
        trouble = _check_expr_syntax(value)
        if trouble:
            raise problem(trouble)
        return Expr(value)
    if not math.isfinite(value) or value < 0:
        raise problem(f"{value} must be a finite number ≥ 0")
    return Expr(repr(value))


ExprValue = Annotated[Expr, PlainValidator(_expr), WithJsonSchema(
    {"anyOf": [{"type": "number", "minimum": 0}, {"type": "string"}]})]
