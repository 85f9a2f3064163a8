"""Opening the artifact stores: the local signed directory, and a remote one by its URL.

    CacheAccess --open_local(directory, stamp)--> ArtifactCache, in every installed wrapper
                --open_remote(url, stamp)------> the remote store of url's scheme (redis://,
                                                 rediss://, unix://: hotswap.fleet.store),
                                                 imported by name on first use

``wrap_local`` is the seam for what changes how entries are read (hotswap.testing's corrupting
store is one): a wrapper applies to the stores opened while it is installed, so production
code calls no hook on its path. ``register_remote`` adds a URL scheme.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

from hotswap.cache.store import ArtifactCache
from hotswap.plugins import Wrappers, load

__all__ = ["RemoteStore", "open_local", "open_remote", "register_remote", "wrap_local"]


class RemoteStore(Protocol):
    """A store shared beyond this machine: signed entries and expiring compile claims."""

    rejected: int

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, payload: bytes | bytearray | memoryview, *, tier: str = "",
            origin: str = "") -> None: ...

    def claim(self, key: str) -> bool: ...

    def held(self, key: str) -> bool: ...

    def release(self, key: str) -> None: ...


_FLEET = "hotswap.fleet.store:open_store"
# scheme -> factory(url, stamp), or the "module:attribute" naming it.
_remote: dict[str, Callable[[str, dict[str, Any] | None], RemoteStore] | str] = {
    "redis": _FLEET, "rediss": _FLEET, "unix": _FLEET}
_lock = threading.Lock()
_wrappers: Wrappers[ArtifactCache] = Wrappers()


def open_local(directory: str | os.PathLike[str] | None,
               stamp: dict[str, Any] | None) -> ArtifactCache:
    """The local artifact cache in ``directory`` (None: the default), in every installed
    wrapper. Raises as ``ArtifactCache`` does (OSError, ValueError)."""
    return _wrappers.apply(ArtifactCache(directory, stamp=stamp))


def wrap_local(wrapper: Callable[[ArtifactCache], ArtifactCache]) -> Callable[[], None]:
    """Wrap every local store opened from now on (``wrapper(cache)`` returns the store to
    use: a subclass or a proxy of ``ArtifactCache``); returns the function that removes it."""
    return _wrappers.add(wrapper)


def register_remote(scheme: str,
                    factory: Callable[[str, dict[str, Any] | None], RemoteStore] | str) -> None:
    """Open URLs ``"<scheme>://..."`` with ``factory(url, stamp)`` (or the
    ``"package.module:attribute"`` naming it, imported on first use)."""
    with _lock:
        _remote[scheme] = factory


def open_remote(url: str, stamp: dict[str, Any] | None) -> RemoteStore:
    """The remote store at ``url``; ValueError when it cannot be used (no key, say). A
    scheme nobody registered goes to the fleet store, which says what it takes."""
    with _lock:
        factory = _remote.get(url.partition("://")[0], _FLEET)
    if isinstance(factory, str):
        factory = load(factory)
    return factory(url, stamp)
