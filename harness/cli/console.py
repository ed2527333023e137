"""Console output shared by the commands: rich, at least 120 columns wide when output is not a terminal."""

from __future__ import annotations

import shutil

from rich.console import Console


def console(stderr: bool = False) -> Console:
    probe = Console(stderr=stderr)
    width = None if probe.is_terminal else max(120, shutil.get_terminal_size((120, 24)).columns)
    return Console(stderr=stderr, width=width)
