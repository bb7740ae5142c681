"""dynpipe: adaptive pipeline-parallel training on shared GPUs."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]
