"""Load a repository script that is not a package module (``bench/``, ``analysis/``) by its
path, as the tests of those scripts do."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relpath: str, name: str | None = None) -> ModuleType:
    """The module at ``ROOT / relpath``, executed under ``name`` (default: its file stem)
    and registered in ``sys.modules`` (a dataclass in it looks its module up there)."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
