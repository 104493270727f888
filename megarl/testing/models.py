"""Tiny models written once per process into a cache folder (MEGARL_TEST_CACHE or the system temp dir)."""
from __future__ import annotations

import os
import tempfile

from ..models.tiny import write_tiny_model

_written: dict[tuple, str] = {}


def tiny_model_dir(family: str, **overrides) -> str:
    """Path of a tiny random `family` model (written on first use, reused afterwards in this process)."""
    key = (family, tuple(sorted(overrides.items())))
    if key not in _written:
        root = os.environ.get("MEGARL_TEST_CACHE") or tempfile.mkdtemp(prefix="megarl-tiny-")
        suffix = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
        _written[key] = write_tiny_model(os.path.join(root, f"{family}{'-' + suffix if suffix else ''}"), family,
                                         **overrides)
    return _written[key]
