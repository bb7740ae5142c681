from __future__ import annotations

from dynpipe.cli import entry

entry()
