"""User-facing errors: anything the user can fix (a file, a field, a flag) becomes a UsageError.

The CLI prints its message without a traceback and exits with code 2 (DESIGN §5: 2 = usage or input error).
"""

from __future__ import annotations


class UsageError(Exception):
    """Bad input: the message names the file, field, flag or tensor."""
