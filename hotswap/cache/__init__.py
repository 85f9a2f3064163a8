"""Persistent, signed cache of compiled artifacts (see store.py for the layout and checks).

The store is loaded on first use: ``hotswap.system.own_bytecode`` imports ``cache.root`` and
``cache.trust`` before the rest of hotswap, and the store's imports are then read as bytecode.
"""

from typing import TYPE_CHECKING, Any

from hotswap.cache.root import default_cache_dir

if TYPE_CHECKING:
    from hotswap.cache.store import VERDICT_TIER, ArtifactCache, EntryInfo

__all__ = ["VERDICT_TIER", "ArtifactCache", "EntryInfo", "default_cache_dir"]


def __getattr__(name: str) -> Any:
    if name in ("VERDICT_TIER", "ArtifactCache", "EntryInfo"):
        from hotswap.cache import store

        return getattr(store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
