"""A real Redis server per test, on a free localhost port (scripts/test installs Debian's
redis-server when it is missing), and the fleet's signing key."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RedisServer:
    port: int
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: scripts/test installs it (apt-get "
                        "install redis-server); the fleet store's tests need a real one")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        pytest.fail(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def client(self):  # type: ignore[no-untyped-def]
        import redis

        return redis.Redis.from_url(self.url)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(free_port(), tmp_path)
    server.start()
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
