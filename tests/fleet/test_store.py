"""The fleet store on a real Redis server: entries checked as local ones are, the key file's
rules, and claims that expire when their holder dies."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from hotswap.fleet.store import FleetStore, load_fleet_key
from tests.fleet.conftest import RedisServer, write_key

KEY = "ab" * 32
STAMP = {"torch": "x", "format": 2}


def _store(server: RedisServer, secret: bytes, stamp: dict[str, object] | None = STAMP,
           ttl_s: float = 30.0) -> FleetStore:
    return FleetStore(server.url, secret, stamp, ttl_s=ttl_s)


def test_an_entry_travels_and_bad_ones_are_refused_and_removed(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    secret = os.urandom(32)
    store = _store(redis_server, secret)
    store.put(KEY, b"payload" * 1000, tier="default", origin="forward (m.py:1)")
    assert store.get(KEY) == b"payload" * 1000
    assert [(e.key, e.tier, e.origin) for e in store.entries()] == [
        (KEY, "default", "forward (m.py:1)")]

    raw = redis_server.client()
    name = f"hotswap:e:{KEY}"
    blob = raw.get(name)
    raw.set(name, blob[:-40] + bytes([blob[-40] ^ 1]) + blob[-39:])  # one bit of the payload
    with caplog.at_level(logging.WARNING, logger="hotswap"):
        assert store.get(KEY) is None
    assert store.rejected == 1 and raw.get(name) is None and store.entries() == []
    assert "refused and removed (signature does not match" in caplog.text

    _store(redis_server, os.urandom(32)).put(KEY, b"foreign", tier="default")  # another key
    assert store.get(KEY) is None and store.rejected == 2 and raw.get(name) is None

    _store(redis_server, secret, {"torch": "other", "format": 2}).put(KEY, b"old build")
    assert store.get(KEY) is None and store.rejected == 3
    assert raw.get(name) is None  # written by another build: removed as a local one would be

    raw.set(name, b"not an entry at all")
    assert store.get(KEY) is None and store.rejected == 4


def test_a_payload_read_with_spans_left_unread_is_never_sent(redis_server: RedisServer) -> None:
    from hotswap.cache.store import Unread

    unread = Unread(b"entry with a header left as zeros")
    unread.unread = ((11, 6),)
    store = _store(redis_server, os.urandom(32))
    for data in (unread, memoryview(unread)):
        with pytest.raises(ValueError, match="unread"):
            store.put(KEY, data, tier="default")
    assert store.get(KEY) is None and store.entries() == []


def test_verify_and_clear(redis_server: RedisServer) -> None:
    secret = os.urandom(32)
    store = _store(redis_server, secret)
    store.put(KEY, b"good", tier="default")
    store.put("cd" * 32, b"good too", tier="gate-verdict")
    redis_server.client().set("hotswap:e:" + "ef" * 32, b"garbage")
    assert store.verify() == [("ef" * 32, "truncated or not a hotswap artifact")]
    assert store.verify(remove=True) == [("ef" * 32, "truncated or not a hotswap artifact")]
    assert store.verify() == []
    assert store.clear("gate-verdict") == 1
    assert [e.key for e in store.entries()] == [KEY]
    assert store.clear() == 1 and store.get(KEY) is None


def test_the_key_file_must_exist_be_private_and_long_enough(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOTSWAP_CACHE_KEY_FILE", raising=False)
    with pytest.raises(ValueError, match="HOTSWAP_CACHE_KEY_FILE is not set"):
        load_fleet_key()
    with pytest.raises(ValueError, match="cannot read the fleet key"):
        load_fleet_key(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"open to other users \(mode 644\).*chmod 600"):
        load_fleet_key(write_key(tmp_path / "open.key", mode=0o644))
    with pytest.raises(ValueError, match="holds 8 bytes"):
        load_fleet_key(write_key(tmp_path / "short.key", b"12345678"))
    good = write_key(tmp_path / "good.key")
    monkeypatch.setenv("HOTSWAP_CACHE_KEY_FILE", str(good))
    assert load_fleet_key() == good.read_bytes()
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)  # anyone may rename the key away and put theirs in its place
    with pytest.raises(ValueError, match="without the sticky bit"):
        load_fleet_key(write_key(open_folder / "k.key"))
    if os.geteuid() == 0:  # another user's key, however private, is theirs to change
        foreign = write_key(tmp_path / "foreign.key")
        os.chown(foreign, 4242, 4242)
        with pytest.raises(ValueError, match="belongs to uid 4242"):
            load_fleet_key(foreign)


def test_malformed_index_records_in_redis_are_left_out_not_a_traceback(
        redis_server: RedisServer) -> None:
    store = FleetStore(redis_server.url, b"k" * 32, {"t": 1})
    store.put(KEY, b"good", tier="default")
    client = redis_server.client()
    client.hset("hotswap:index", "cd" * 32, b"\xc1 not msgpack")
    client.hset("hotswap:index", "ef" * 32, msgpack.packb({"size": "big"}))
    client.hset("hotswap:index", "not-a-key", msgpack.packb({"size": 1}))
    assert [e.key for e in store.entries()] == [KEY]
    assert store.clear("default") == 1 and store.entries() == []


def test_a_claim_is_exclusive_renewed_and_released(redis_server: RedisServer) -> None:
    a, b = _store(redis_server, b"k" * 32, ttl_s=1.5), _store(redis_server, b"k" * 32)
    assert a.claim(KEY)
    assert not b.claim(KEY) and b.held(KEY)
    time.sleep(2.5)  # past its ttl: renewed meanwhile by a's renewal thread
    assert not b.claim(KEY) and a.claims() == [KEY]
    a.release(KEY)
    assert not b.held(KEY) and b.claim(KEY)
    b.release(KEY)
    # With no claim left, a's renewal thread ends (it starts again with the next claim).
    deadline = time.monotonic() + 5.0
    while a._renewer is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a._renewer is None
    assert a.claim(KEY) and a._renewer is not None and a._renewer.is_alive()
    a.release(KEY)


# Take the fleet claim on KEY (ttl 2 s), say so, then hang until killed.
_HOLDER = r"""
import sys, time
from hotswap.fleet.store import FleetStore
store = FleetStore(sys.argv[1], b"k" * 32, {}, ttl_s=2.0)
assert store.claim(sys.argv[2])
print("claimed", flush=True)
time.sleep(3600)
"""


def test_a_killed_claim_holder_does_not_wedge_the_others(redis_server: RedisServer) -> None:
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, redis_server.url, KEY],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "claimed"
    other = _store(redis_server, b"k" * 32)
    try:
        assert not other.claim(KEY)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        t = time.monotonic()
        while other.held(KEY):
            assert time.monotonic() - t < 5.0, "a dead holder's claim did not expire"
            time.sleep(0.05)
        assert other.claim(KEY)
    finally:
        holder.kill()
        other.release(KEY)
