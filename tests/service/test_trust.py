"""Another user's folder, a folder others may open, a socket that is a link, a peer of another
uid: refused with a message, the local pool compiles, nothing of the attacker's is touched."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import hotswap
from hotswap import cli
from hotswap.executors import registry
from hotswap.service import wire
from hotswap.service.place import stamp
from tests.cache.test_trust import ATTACKER, as_root, attack, tree
from tests.cache.test_trust import shared as shared  # the fixture
from tests.service.conftest import kill_services, services_of
from tests.service.test_lifecycle import ECHO


@pytest.fixture
def attacked(shared: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A service folder in a sticky folder every user may write (as /tmp is), and the
    attacker's own folder beside it."""
    folder = shared / "svc"
    monkeypatch.setenv("HOTSWAP_SERVICE_DIR", str(folder))
    monkeypatch.setenv("HOTSWAP_WORKERS", "1")

    def plant() -> None:
        os.mkdir(shared / "theirs", 0o755)
        (shared / "theirs" / "note").write_text("the attacker's")

    attack(plant)
    try:
        yield folder
    finally:
        registry.shutdown(wait=True)
        kill_services(folder)


CASES = {
    "folder of another uid": f"belongs to uid {ATTACKER}",
    "folder open to others": "is open to other users (mode 777)",
    "socket is a symlink": "socket) is a symlink",
}


@as_root
@pytest.mark.parametrize("case", list(CASES))
def test_an_untrusted_place_is_refused_and_the_local_pool_compiles(
        case: str, attacked: Path, shared: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if case == "folder of another uid":  # they made it first
        attack(lambda: os.mkdir(attacked, 0o700))
    elif case == "folder open to others":
        os.mkdir(attacked)
        os.chmod(attacked, 0o777)
    else:
        os.mkdir(attacked, 0o700)
        os.symlink(shared / "theirs" / "service.sock", attacked / f"{stamp()}.sock")
    # Only our own folder (the symlink case) may gain our key; theirs stays as it was.
    watched = shared / "theirs" if case == "socket is a symlink" else shared
    before = tree(watched)
    hotswap.runtime()
    executor = registry.resolve("service://", workers=1)
    with hotswap.counters_delta() as d:
        assert executor.submit(ECHO, "here", 60).result(120) == "here"
    assert d["cluster_fallbacks"] == 1
    link = registry.connect("service://").cluster  # type: ignore[attr-defined]
    assert CASES[case] in link.refused
    assert cli.main(["service", "status"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("compile service not usable:") and CASES[case] in out
    assert cli.main(["service", "start"]) == 1
    assert tree(watched) == before  # nothing made, moved or removed
    if case == "socket is a symlink":  # left for its owner to look at, not replaced
        assert os.readlink(attacked / f"{stamp()}.sock") == str(shared / "theirs" / "service.sock")
    assert services_of(attacked) == []


@as_root
def test_both_ends_check_the_peer_uid(shared: Path) -> None:
    """A client refuses a service of another uid before any challenge; a service refuses a
    client of another uid."""
    theirs = shared / "theirs.sock"
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the attacker's service)
        try:
            os.setgroups([])
            os.setgid(ATTACKER)
            os.setuid(ATTACKER)
            listener = socket.socket(socket.AF_UNIX)
            listener.bind(str(theirs))
            listener.listen(1)
            listener.settimeout(10)
            listener.accept()
            time.sleep(1)
        finally:
            os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while not theirs.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(wire.PeerRefused, match=f"runs as uid {ATTACKER}"):
            wire.connect(theirs, b"k" * 32)
    finally:
        os.waitpid(pid, 0)

    ours = shared / "ours.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(ours))
    os.chmod(ours, 0o777)  # so that they may connect at all
    listener.listen(1)
    refused: list[BaseException] = []

    def serve() -> None:
        sock, _ = listener.accept()
        try:
            wire.accept(sock, b"k" * 32)
        except BaseException as e:
            refused.append(e)

    server = threading.Thread(target=serve)
    server.start()

    def call() -> None:
        client = socket.socket(socket.AF_UNIX)
        client.connect(str(ours))
        client.recv(1)  # the service hangs up without a challenge

    attack(call)
    server.join(10)
    listener.close()
    assert len(refused) == 1 and isinstance(refused[0], wire.PeerRefused)
    assert f"uid {ATTACKER} connected" in str(refused[0])
