"""The extension points the cache's stores and the executors' registry share: a factory named
``"package.module:attribute"`` and imported only when first used, and a stack of wrappers
applied to what is opened while they are installed (test fault injection, middleware)."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["Wrappers", "load"]

T = TypeVar("T")


def load(name: str) -> Any:
    """The attribute ``"package.module:attribute"`` names, importing its module."""
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)


class Wrappers(Generic[T]):
    """Wrappers applied, in the order installed, to each value opened while they are."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._installed: list[Callable[[T], T]] = []

    def add(self, wrapper: Callable[[T], T]) -> Callable[[], None]:
        """Install ``wrapper``; returns the function that removes it."""
        with self._lock:
            self._installed.append(wrapper)

        def remove() -> None:
            with self._lock:
                if wrapper in self._installed:
                    self._installed.remove(wrapper)

        return remove

    def apply(self, value: T) -> T:
        with self._lock:
            installed = list(self._installed)
        for wrapper in installed:
            value = wrapper(value)
        return value
