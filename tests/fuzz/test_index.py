"""Fuzz: bytes and msgpack values as the cache's ``index.msgpack``.

Whatever the index holds, ``entries``, ``touch``, ``put`` and ``hotswap cache ls|stats|verify``
raise no TypeError, KeyError or AttributeError; an index that is not one is rebuilt from the
entries and counted once in ``ArtifactCache.index_rebuilds``; nothing outside the cache changes.
"""

from __future__ import annotations

import math
import os
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.cases import count
from tests.fuzz.sandbox import KEY, OTHER_KEY, Sandbox, make_sandbox

PAYLOAD = b"payload " * 4


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Sandbox:
    return make_sandbox(tmp_path_factory.mktemp("fuzz-index"), max_bytes=1 << 20)


leaves = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
          | st.text(max_size=12) | st.binary(max_size=12))
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=6) | st.binary(max_size=6), inner,
                                        max_size=4), max_leaves=16)
keys = st.sampled_from([KEY, OTHER_KEY, "0" * 64, "ab", "AB" + "c" * 62, "x", ""]) | st.text(max_size=8)
# Records near an index's own: each field present or not, of its type or another.
records = st.fixed_dictionaries({}, optional={
    "size": st.integers(-5, 2**64 - 1) | leaves,
    "tier": st.text(max_size=12) | leaves,
    "origin": st.text(max_size=12) | leaves,
    "created_s": st.floats() | st.integers(-2**63, 2**64 - 1) | leaves,
    "used_s": st.floats() | st.integers(-2**63, 2**64 - 1) | leaves,
}) | values
# Indexes of the right shape, with any size and any time a platform's clock can show (times
# past it make an index malformed: see the test below).
times = st.floats(-1e9, 1e10) | st.integers(0, 2**33)
well_formed = st.dictionaries(
    st.sampled_from([KEY, OTHER_KEY, "0" * 64, "ab"]),
    st.fixed_dictionaries({"size": st.integers(0, 2**64 - 1)}, optional={
        "tier": st.text(max_size=12), "origin": st.text(max_size=12), "created_s": times,
        "used_s": times}), max_size=4)
indexes = st.one_of(
    well_formed.map(lambda v: ("value", v)),
    st.binary(max_size=200).map(lambda b: ("bytes", b)),
    values.map(lambda v: ("value", v)),
    st.dictionaries(keys, records, max_size=4).map(lambda v: ("value", v)),
)


def _is_record(r: Any) -> bool:
    """What docs/security.md promises an index record is checked for."""
    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)
    return (isinstance(r, dict) and isinstance(r.get("size"), int)
            and not isinstance(r["size"], bool) and r["size"] >= 0
            and isinstance(r.get("tier", ""), str) and isinstance(r.get("origin", ""), str)
            and number(r.get("created_s", 0.0)) and number(r.get("used_s", 0.0)))


def _is_index(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and len(k) >= 2 and all(c in "0123456789abcdef" for c in k)
        and _is_record(r) for k, r in value.items())


def _write_index(box: Sandbox, index: tuple[str, Any]) -> Any:
    """Writes the fuzzed index; returns what it decodes to (None: not msgpack at all)."""
    kind, value = index
    data = value if kind == "bytes" else msgpack.packb(value, use_bin_type=True)
    path = box.root / "index.msgpack"
    tmp = path.with_name(".tmp-fuzz")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    try:
        return msgpack.unpackb(data, raw=False)
    except Exception:
        return None


def _ensure_entries(box: Sandbox) -> None:
    for key in (KEY, OTHER_KEY):
        if not box.cache.entry_path(key).exists():
            box.cache.put(key, PAYLOAD)


@given(index=indexes)
def test_index_of_any_shape_is_read_or_rebuilt(box: Sandbox, index: tuple[str, Any]) -> None:
    count("index bytes")
    with box.unchanged_outside():
        _ensure_entries(box)
        decoded = _write_index(box, index)
        before = box.cache.index_rebuilds
        listed = {e.key for e in box.cache.entries()}
        if _is_index(decoded):
            assert box.cache.index_rebuilds == before
            assert listed == set(decoded)
        else:
            assert box.cache.index_rebuilds == before + 1
            assert listed == {KEY, OTHER_KEY}  # rebuilt from the entry files
        for action in ("ls", "stats", "verify"):
            assert box.cli(action) in (0, 1)


@given(index=indexes, key=st.sampled_from([KEY, OTHER_KEY, "0" * 64]))
def test_touch_and_put_over_an_index_of_any_shape(box: Sandbox, index: tuple[str, Any],
                                                  key: str) -> None:
    count("index bytes")
    with box.unchanged_outside():
        _ensure_entries(box)
        _write_index(box, index)
        box.cache.touch(key) if key != "0" * 64 else None
        _write_index(box, index)
        box.cache.put(key, PAYLOAD)
        # Either way the index is now one the cache wrote, with the new entry in it.
        listed = {e.key: e for e in box.cache.entries()}
        assert key in listed and math.isfinite(listed[key].used_s)
        assert box.cache.get(key) == PAYLOAD


@pytest.mark.parametrize("time_s", [1e300, 2**63, -1e20, math.inf, math.nan])
def test_ls_of_an_index_with_a_time_past_the_clock(box: Sandbox, time_s: float) -> None:
    """No clock shows such a time: the index is malformed, rebuilt, and ls lists the entry."""
    _ensure_entries(box)
    _write_index(box, ("value", {KEY: {"size": 1, "used_s": time_s}}))
    assert box.cli("ls") == 0
