"""Where a job runs, by spec: the registry of executors (httpx mounts transports the same way).

    executor= / HOTSWAP_EXECUTOR --check()--> a Spec --resolve(spec, workers, devices)-->
        [middleware installed by wrap(), outermost last] (FallbackExecutor(connect(spec), local)
                                                          or the local pool's executor)

``check`` tells a valid ``executor=`` value from an invalid one without importing any
executor (options check it at ``hotswap.compile``): None or "local" (the local worker pool),
an address whose scheme is registered ("dask://host:8786", "tcp://...", "service://": the
machine's compile service, also what None means under HOTSWAP_SERVICE=on), or a
``distributed.Client`` (recognised by its type's name: distributed is an optional extra).
``connect`` makes one executor per spec per process, importing its factory by name on first use
(the Dask executor for the Dask schemes): the backend imports none. ``register`` adds a
scheme; ``shutdown`` stops the local pools and every executor opened.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from hotswap import settings
from hotswap.executors.base import Executor, FallbackExecutor
from hotswap.executors.local import LocalExecutor, pools
from hotswap.plugins import Wrappers, load

__all__ = [
    "SCHEMES",
    "SERVICE",
    "Factory",
    "Middleware",
    "Spec",
    "check",
    "connect",
    "count",
    "count_with",
    "register",
    "resolve",
    "shutdown",
    "wrap",
]

# What check() returns: None (the local pool), an address (str), or the distributed.Client
# given. Any, as the Client type is not importable here.
Spec = Any
# Makes the executor of a spec: the address, or the client object.
Factory = Callable[[Spec], Executor]
# Wraps every executor resolve() returns from now on (fault injection is one).
Middleware = Callable[[Executor], Executor]

_DASK = "hotswap.executors.dask:DaskExecutor"
# This user's machine-wide compile service (hotswap.service): "service://".
SERVICE = "service://"
# scheme -> a factory, or the "module:attribute" naming one (imported on first connect()).
_factories: dict[str, Factory | str] = {
    "dask": _DASK, "tcp": _DASK, "tls": _DASK, "inproc": _DASK,
    "service": "hotswap.executors.service:ServiceExecutor"}
# (module prefix, type name) of client objects taken as specs -> the scheme that opens them.
_clients: dict[tuple[str, str], str] = {("distributed", "Client"): "dask"}

_lock = threading.Lock()
_opened: dict[Any, Executor] = {}
_middleware: Wrappers[Executor] = Wrappers()


def _uncounted(name: str) -> None:
    pass


_count: Callable[[str], None] = _uncounted


def _schemes() -> tuple[str, ...]:
    return tuple(f"{scheme}://" for scheme in _factories)


# The address schemes registered when this module is imported (the Dask scheduler's).
SCHEMES = _schemes()


def register(scheme: str, factory: Factory | str) -> None:
    """Open specs ``"<scheme>://..."`` with ``factory(spec) -> Executor`` (or the
    ``"package.module:attribute"`` naming it, imported on first use)."""
    with _lock:
        _factories[scheme] = factory


def check(value: Any) -> Spec:
    """``executor=`` as given: None or "local" (the local pool), an address of a registered
    scheme ("dask://host:8786", "tcp://host:8786", "service://"), or a ``distributed.Client``.
    None (nothing chosen) is the compile service when HOTSWAP_SERVICE=on. ValueError else."""
    if value is None and settings.service():
        return SERVICE
    if value is None or value == "local":
        return None
    if isinstance(value, str):
        if not value.startswith(_schemes()):
            raise ValueError(f"executor must be 'local', a Dask scheduler address "
                             f"(dask://host:port) or a distributed.Client, got {value!r}")
        return value
    if _client_scheme(value) is not None:
        return value
    raise ValueError(f"executor must be 'local', a Dask scheduler address (dask://host:port) "
                     f"or a distributed.Client, got {value!r}")


def _client_scheme(value: Any) -> str | None:
    kind = type(value)
    return next((scheme for (module, name), scheme in _clients.items()
                 if kind.__name__ == name and kind.__module__.startswith(module)), None)


def connect(spec: Spec) -> Executor:
    """The executor of ``spec`` (not None), made on first use and shared by every caller of
    this process until ``shutdown()``."""
    scheme = _client_scheme(spec) if not isinstance(spec, str) else spec.partition("://")[0]
    key = spec if isinstance(spec, str) else id(spec)
    with _lock:
        executor = _opened.get(key)
        if executor is None:
            factory = _factories[scheme or ""]
            if isinstance(factory, str):
                factory = _factories[scheme or ""] = load(factory)
            executor = _opened[key] = factory(spec)
        return executor


def resolve(spec: Spec, *, workers: int | None = None,
            devices: tuple[str, ...] = ()) -> Executor:
    """Where a job runs now: the executor of ``spec`` with the local pool of ``workers`` (on
    ``devices``) behind it for the jobs it cannot take (or that pool alone: spec None), in
    every installed middleware."""
    executor: Executor = LocalExecutor(workers, devices)
    if spec is not None:
        executor = FallbackExecutor(connect(spec), executor,
                                    on_fallback=lambda job: count("cluster_fallbacks"))
    return _middleware.apply(executor)


def wrap(middleware: Middleware) -> Callable[[], None]:
    """Wrap every executor ``resolve`` returns from now on (``middleware(executor)`` returns
    the executor to use); returns the function that removes it."""
    return _middleware.add(middleware)


def shutdown(wait: bool = True) -> None:
    """Stop every local worker and every executor opened; their pending jobs fail with
    ``PoolClosed``. A later ``resolve`` starts again."""
    with _lock:
        opened = list(_opened.values())
        _opened.clear()
    pools.shutdown(wait=wait)
    for executor in opened:
        executor.shutdown(wait=wait)


def count_with(counter: Callable[[str], None]) -> None:
    """Executors count events (remote compiles, jobs sent home) with ``counter(name)``; the
    backend installs its counters here."""
    global _count
    _count = counter


def count(name: str) -> None:
    _count(name)
