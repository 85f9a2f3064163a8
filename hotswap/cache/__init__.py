"""Persistent, signed cache of compiled artifacts (see store.py for the layout and checks)."""

from hotswap.cache.root import default_cache_dir
from hotswap.cache.store import VERDICT_TIER, ArtifactCache, EntryInfo

__all__ = ["VERDICT_TIER", "ArtifactCache", "EntryInfo", "default_cache_dir"]
