"""Cache keys from named factors, serialized deterministically.

The cache knows nothing of what a key stands for: its user names the factors (for a compiled
tier: the graph's digest, its inputs, grad mode, tier config, environment stamp; see
``hotswap.engine.shipping.keys``) and gets the same hex digest for the same factors in every
process. Dicts are ordered by key, tuples are lists; values are None, bools, numbers, strings,
bytes, lists and dicts of them (anything else by its ``repr``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import msgpack

__all__ = ["cache_key"]


def cache_key(factors: Mapping[str, Any]) -> str:
    """SHA-256 of the factors' canonical msgpack form, as 64 lowercase hex digits."""
    return hashlib.sha256(msgpack.packb(_canonical(dict(factors)), use_bin_type=True)).hexdigest()


def _canonical(value: Any) -> Any:
    if isinstance(value, Mapping):
        return [[str(k), _canonical(value[k])] for k in sorted(value, key=str)]
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    return repr(value)
