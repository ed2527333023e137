"""`dsv4-drift patches`: the built-in and plugin patches with their phases, options and descriptions."""

from __future__ import annotations

import argparse

from harness.cli.console import console
from rich.table import Table

from harness.errors import UsageError
from optimized.patching import PatchError
from optimized.registry import default_registry


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("patches", help="list built-in and plugin patches (id, phases, options, description)")
    p.add_argument("--patch-module", action="append", default=[], metavar="FILE_OR_MODULE",
                   help="also load patches from this plugin module (repeatable)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        registry = default_registry(args.patch_module)
    except PatchError as e:
        raise UsageError(str(e)) from None
    table = Table(title="patches")
    for col in ("id", "phases", "ops", "options (defaults)", "source", "description"):
        table.add_column(col, no_wrap=col in ("id", "phases"))
    for patch in registry.all():
        options = ", ".join(f"{k}={v}" for k, v in patch.defaults.items()) or "—"
        table.add_row(patch.id, ",".join(patch.phases), ",".join(patch.ops), options, patch.source,
                      patch.description + (f" [{patch.spec}]" if patch.spec else ""))
    console().print(table)
    return 0
