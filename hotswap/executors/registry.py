"""The executor specs ``executor=`` (and ``HOTSWAP_EXECUTOR``) take, checked without importing
an executor: None or "local" (the local worker pool), a Dask scheduler address, or a
``distributed.Client`` (recognised by its type's name: distributed is an optional extra).
"""

from __future__ import annotations

from typing import Any

__all__ = ["SCHEMES", "Spec", "check"]

# The address schemes a Dask scheduler is reached by.
SCHEMES = ("dask://", "tcp://", "tls://", "inproc://")

# What check() returns: None (the local pool), a scheduler address (str), or the
# distributed.Client given. Any, as the Client type is not importable here.
Spec = Any


def check(value: Any) -> Spec:
    """``executor=`` as given: None or "local" (the local pool), a Dask address
    ("dask://host:8786", "tcp://host:8786"), or a ``distributed.Client``. ValueError else."""
    if value is None or value == "local":
        return None
    if isinstance(value, str):
        if not value.startswith(SCHEMES):
            raise ValueError(f"executor must be 'local', a Dask scheduler address "
                             f"(dask://host:port) or a distributed.Client, got {value!r}")
        return value
    if type(value).__name__ == "Client" and type(value).__module__.startswith("distributed"):
        return value
    raise ValueError(f"executor must be 'local', a Dask scheduler address (dask://host:port) "
                     f"or a distributed.Client, got {value!r}")
