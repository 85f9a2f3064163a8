"""Numbers from ``HOTSWAP_*`` environment variables, checked the same way everywhere."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

__all__ = ["env_number"]

T = TypeVar("T", int, float)


def env_number(name: str, kind: Callable[[str], T], ok: Callable[[T], bool], expected: str,
               default: T | None = None) -> T | None:
    """The number in ``name`` (``default`` when unset or blank). One that does not parse as
    ``kind`` or that ``ok`` rejects raises ``ValueError`` naming the variable and ``expected``."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise ValueError(f"{name} must be {expected}, got {raw!r}")
    return value
