"""Fuzz: bytes in an entry's file, and the entry codec on bytes alone.

Whatever an entry file holds, ``get`` returns the payload that was stored under that key or
None (the entry refused and removed); a file that others may write raises ``UntrustedPath``.
``verify``, ``entries`` and ``hotswap cache ls|stats|verify`` answer without a traceback, and
nothing outside the cache changes.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from pathlib import Path

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hotswap.cache.store import MAGIC, EntryRejected, split_entry, unseal
from hotswap.cache.trust import UntrustedPath
from tests.fuzz.cases import count
from tests.fuzz.sandbox import KEY, STAMP, Sandbox, make_sandbox

PAYLOAD = b"the artifact's bytes " * 8


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Sandbox:
    return make_sandbox(tmp_path_factory.mktemp("fuzz-entries"))


def _secret(box: Sandbox) -> bytes:
    return (box.root / "secret.key").read_bytes()


def _valid_entry(box: Sandbox) -> bytes:
    box.cache.put(KEY, PAYLOAD, tier="default", origin="fuzz")
    return box.cache.entry_path(KEY).read_bytes()


# Bytes that look more and more like an entry: anything, the magic, the magic and a length.
entry_bytes = st.one_of(
    st.binary(max_size=300),
    st.binary(max_size=300).map(lambda b: MAGIC + b),
    st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=300)).map(
        lambda t: MAGIC + struct.pack("!I", t[0]) + t[1]),
)


def _check_reads(box: Sandbox, path: Path, want: bytes | None) -> None:
    """``get`` returns ``want`` (None: refused and removed), and the listings and the CLI
    agree with what is left."""
    bad = dict(box.cache.verify())
    assert (KEY in bad) == (want is None)
    assert box.cli("verify") == (1 if want is None else 0)
    assert box.cli("ls") == 0
    assert box.cli("stats") == 0
    box.cache.entries()
    assert box.cache.get(KEY) == want
    assert path.exists() == (want is not None)


@given(data=entry_bytes)
def test_arbitrary_bytes_as_an_entry(box: Sandbox, data: bytes) -> None:
    count("cache entry bytes")
    with box.unchanged_outside():
        path = box.write_entry(KEY, data)
        _check_reads(box, path, None)


mutation = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, 10**6)),
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("length"), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.binary(min_size=1, max_size=40)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=40)),
    st.tuples(st.just("same")),
)


def _mutate(entry: bytes, how: tuple[object, ...]) -> bytes:
    kind, *args = how
    if kind == "truncate":
        return entry[:int(args[0]) % (len(entry) + 1)]  # type: ignore[call-overload]
    if kind == "flip":
        at = int(args[0]) % len(entry)  # type: ignore[call-overload]
        return entry[:at] + bytes([entry[at] ^ int(args[1])]) + entry[at + 1:]  # type: ignore[call-overload]
    if kind == "length":  # the header's length field, rewritten
        return entry[:len(MAGIC)] + struct.pack("!I", args[0]) + entry[len(MAGIC) + 4:]
    if kind == "insert":
        at = int(args[0]) % (len(entry) + 1)  # type: ignore[call-overload]
        return entry[:at] + args[1] + entry[at:]  # type: ignore[operator]
    if kind == "append":
        return entry + args[0]  # type: ignore[operator]
    return entry


@given(how=mutation)
def test_mutated_entry_is_the_payload_or_refused(box: Sandbox, how: tuple[object, ...]) -> None:
    count("cache entry bytes")
    with box.unchanged_outside():
        entry = _valid_entry(box)
        mutated = _mutate(entry, how)
        path = box.write_entry(KEY, mutated)
        _check_reads(box, path, PAYLOAD if mutated == entry else None)


def _signed(secret: bytes, head: bytes, payload: bytes) -> bytes:
    mac = hmac.new(secret, head + payload, hashlib.sha256).digest()
    return head + payload + mac


# Headers the cache's own key signs but seal() never wrote: any msgpack value, with its real
# length or another. Only the key's holder can make one; still no traceback.
header_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# Maps, some with the fields seal() writes (format, key, size, sha256, stamp) set as a real
# header has them, others not. A header that is not a map at all: the test below.
header_maps = st.one_of(
    st.dictionaries(st.text(max_size=8), header_values, max_size=6),
    st.fixed_dictionaries({}, optional={
        "format": st.sampled_from([3, 2, "3", None]), "key": st.sampled_from([KEY, "00", 1]),
        "size": st.integers(-1, 70) | header_values, "sha256": st.text(max_size=64),
        "stamp": st.just(STAMP) | header_values, "tier": header_values,
        "created_s": header_values}),
)


@given(header=header_maps, length=st.none() | st.integers(0, 2**32 - 1),
       payload=st.binary(max_size=64))
def test_signed_header_of_any_shape(box: Sandbox, header: object, length: int | None,
                                    payload: bytes) -> None:
    count("cache entry bytes (signed)")
    packed = msgpack.packb(header, use_bin_type=True)
    head = MAGIC + struct.pack("!I", len(packed) if length is None else length) + packed
    with box.unchanged_outside():
        path = box.write_entry(KEY, _signed(_secret(box), head, payload))
        _check_reads(box, path, None)  # no such header is one seal() writes for this cache


@given(data=entry_bytes, mode=st.sampled_from([0o600, 0o400, 0o640, 0o620, 0o602, 0o666]))
def test_entry_others_may_write_is_refused(box: Sandbox, data: bytes, mode: int) -> None:
    count("cache entry bytes")
    with box.unchanged_outside():
        path = box.write_entry(KEY, data, mode)
        if mode & 0o022:
            with pytest.raises(UntrustedPath):
                box.cache.get(KEY)
            path.unlink()
        else:
            assert box.cache.get(KEY) is None


@given(data=entry_bytes, key=st.sampled_from([KEY, "00", "f" * 64]),
       stamp=st.none() | st.just(STAMP))
def test_codec_on_bytes_raises_only_entry_rejected(data: bytes, key: str,
                                                  stamp: dict[str, object] | None) -> None:
    count("entry codec")
    parts = split_entry(data)
    assert b"".join(parts) == data
    with pytest.raises(EntryRejected):
        unseal(b"k" * 32, parts, key, stamp)


@given(header=header_maps, length=st.none() | st.integers(0, 2**32 - 1),
       payload=st.binary(max_size=64), stamp=st.none() | st.just(STAMP))
def test_codec_on_signed_headers_raises_only_entry_rejected(
        header: object, length: int | None, payload: bytes, stamp: dict[str, object] | None) -> None:
    count("entry codec (signed)")
    packed = msgpack.packb(header, use_bin_type=True)
    head = MAGIC + struct.pack("!I", len(packed) if length is None else length) + packed
    parts = split_entry(_signed(b"k" * 32, head, payload))
    with pytest.raises(EntryRejected):
        unseal(b"k" * 32, parts, KEY, stamp)


def test_signed_header_that_is_not_a_map_is_refused(box: Sandbox) -> None:
    head = MAGIC + struct.pack("!I", 1) + msgpack.packb(None)
    box.write_entry(KEY, _signed(_secret(box), head, b""))
    assert box.cache.get(KEY) is None
