"""A real Redis server per test, on a free localhost port (scripts/test installs Debian's
redis-server when it is missing), and the fleet's signing key."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from hotswap.testing.servers import RedisServer, free_port

__all__ = ["RedisServer", "free_port", "write_key"]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(free_port(), tmp_path)
    try:
        server.start()
    except RuntimeError as e:  # not installed: a failure, never a skip
        pytest.fail(str(e))
    try:
        yield server
    finally:
        server.stop()


def write_key(path: Path, data: bytes | None = None, mode: int = 0o600) -> Path:
    path.write_bytes(data if data is not None else os.urandom(32))
    path.chmod(mode)
    return path


@pytest.fixture
def fleet_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    key = write_key(tmp_path / "fleet.key")
    monkeypatch.setenv("HOTSWAP_CACHE_KEY_FILE", str(key))
    return key


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    """Every test's models are new to dynamo (its recompile limit counts across tests)."""
    import torch

    torch._dynamo.reset()
