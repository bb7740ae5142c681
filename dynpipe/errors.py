"""One exception type for bad input: the CLI prints it as one line and exits with 2."""

from __future__ import annotations

__all__ = ["UserError"]


class UserError(ValueError):
    """Bad input from the user. The message carries the numbers and the fix, on one line."""
