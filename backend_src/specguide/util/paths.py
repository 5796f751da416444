"""Where specguide keeps what it builds once per machine (converted models, C kernels, draft heads)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$SPECGUIDE_CACHE_DIR`, default `~/.cache/specguide`."""
    return Path(os.environ.get("SPECGUIDE_CACHE_DIR", Path.home() / ".cache" / "specguide"))
