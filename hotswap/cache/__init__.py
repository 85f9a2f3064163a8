"""Persistent, signed cache of compiled artifacts (see store.py for the layout and checks)."""

from hotswap.cache.store import ArtifactCache, EntryInfo, default_cache_dir

__all__ = ["ArtifactCache", "EntryInfo", "default_cache_dir"]
