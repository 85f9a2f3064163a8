"""Compiled artifacts as they travel and rest: the worker's bytes plus its kernel files.

A cache entry, a gate benchmark job and a load all use the same packed form, so an artifact
that was stored is byte for byte one that was loaded here (or by a worker's benchmark).
"""

from __future__ import annotations

from typing import Any

import msgpack

from hotswap.orchestrator import compat

__all__ = ["load_artifact", "load_entry", "pack_entry"]


def pack_entry(artifact: bytes, files: dict[str, bytes]) -> bytes:
    """The artifact plus the kernel files the worker's compile produced."""
    return msgpack.packb({"artifact": artifact, "files": files},  # type: ignore[no-any-return]
                         use_bin_type=True)


def load_artifact(artifact: bytes, files: dict[str, bytes]) -> Any:
    """Put the worker's compiled kernels where this process's inductor looks (when it lacks
    them: a separate TORCHINDUCTOR_CACHE_DIR), then load. Saves re-running the C++ compiler."""
    if files:
        compat.restore_files(compat.inductor_cache_dir(), files)
    return compat.artifact_from_bytes(artifact)


def load_entry(entry: bytes) -> Any:
    unpacked = msgpack.unpackb(entry, raw=False)
    return load_artifact(unpacked["artifact"], unpacked.get("files") or {})
