from __future__ import annotations

import logging
import shutil
import stat
from pathlib import Path

import pytest

from hotswap.cache import ArtifactCache

KEY_A, KEY_B, KEY_C = "aa" + "0" * 62, "bb" + "1" * 62, "cc" + "2" * 62
STAMP = {"torch": "2.13.0", "gpus": []}


def _cache(root: Path, **kwargs: object) -> ArtifactCache:
    return ArtifactCache(root, stamp=kwargs.pop("stamp", STAMP), **kwargs)  # type: ignore[arg-type]


def test_round_trip_and_permissions(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "c")
    assert cache.get(KEY_A) is None
    cache.put(KEY_A, b"artifact bytes", tier="default")
    assert cache.get(KEY_A) == b"artifact bytes"
    assert stat.S_IMODE((tmp_path / "c").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "c" / "secret.key").stat().st_mode) == 0o600
    [entry] = cache.entries()
    assert (entry.key, entry.tier) == (KEY_A, "default")
    # Another process (another ArtifactCache on the same root) sees the entry.
    assert _cache(tmp_path / "c").get(KEY_A) == b"artifact bytes"


def _corrupt_truncate(path: Path, tmp: Path) -> None:
    path.write_bytes(path.read_bytes()[:-40])


def _corrupt_flip(path: Path, tmp: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _corrupt_foreign_key(path: Path, tmp: Path) -> None:
    other = _cache(tmp / "other")  # another cache, another secret
    other.put(KEY_A, b"artifact bytes")
    shutil.copy(other._path(KEY_A), path)


@pytest.mark.parametrize("corrupt", [_corrupt_truncate, _corrupt_flip, _corrupt_foreign_key],
                         ids=["truncated", "flipped-byte", "signed-by-another-cache"])
def test_bad_entries_are_refused_removed_and_warned_once(
    tmp_path: Path, corrupt: object, caplog: pytest.LogCaptureFixture
) -> None:
    cache = _cache(tmp_path / "c")
    cache.put(KEY_A, b"artifact bytes")
    path = cache._path(KEY_A)
    corrupt(path, tmp_path)  # type: ignore[operator]
    with caplog.at_level(logging.WARNING, logger="hotswap"):
        assert cache.get(KEY_A) is None
        assert cache.get(KEY_A) is None
    assert not path.exists() and cache.entries() == []
    assert sum("refused" in r.message for r in caplog.records) == 1


def test_entry_from_another_build_is_never_loaded(tmp_path: Path) -> None:
    _cache(tmp_path / "c", stamp={"torch": "2.11.0", "gpus": []}).put(KEY_A, b"old build")
    assert _cache(tmp_path / "c").get(KEY_A) is None


def test_lru_eviction_order(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "c", max_bytes=2 * 1300)  # two entries (~1.2 KB each) fit
    cache.put(KEY_A, b"a" * 1000)
    cache.put(KEY_B, b"b" * 1000)
    assert cache.get(KEY_A) is not None  # A is now more recently used than B
    cache.put(KEY_C, b"c" * 1000)
    assert [e.key for e in cache.entries()] == [KEY_C, KEY_A]
    assert cache.get(KEY_B) is None


def test_index_survives_a_crash(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "c")
    cache.put(KEY_A, b"x")
    (tmp_path / "c" / "index.msgpack").write_bytes(b"\xc1garbage")
    assert [e.key for e in _cache(tmp_path / "c").entries()] == [KEY_A]


def test_verify_and_clear(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "c")
    cache.put(KEY_A, b"x")
    cache.put(KEY_B, b"y")
    _corrupt_flip(cache._path(KEY_B), tmp_path)
    assert [k for k, _ in cache.verify()] == [KEY_B]
    assert [k for k, _ in cache.verify()] == [KEY_B]  # reported, not removed
    assert [k for k, _ in cache.verify(remove=True)] == [KEY_B]
    assert cache.verify() == []
    assert cache.clear() == 1
    assert cache.entries() == []


def test_bad_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        _cache(tmp_path / "c", max_bytes=0)
    for bad in ("lots", "0", "1.5"):
        monkeypatch.setenv("HOTSWAP_CACHE_MAX_BYTES", bad)
        with pytest.raises(ValueError, match="HOTSWAP_CACHE_MAX_BYTES must be a whole number"):
            _cache(tmp_path / "c")
    monkeypatch.setenv("HOTSWAP_CACHE_MAX_BYTES", "4096")
    assert _cache(tmp_path / "c").max_bytes == 4096
    with pytest.raises(ValueError, match="hex"):
        _cache(tmp_path / "c").get("../etc/passwd")


# ------------------------------------------------------------------ shared content

def _entry(own: bytes, header: bytes) -> bytes:
    """An artifact entry whose kernel files include a precompiled header, as a first compile
    in a fresh inductor cache ships one."""
    from hotswap.engine.loading.artifacts import pack_entry

    return pack_entry(own, {"precompiled_headers/c7ud.h.gch": header, "ab/cab.so": own[:100]})


def _put_entry(cache: ArtifactCache, key: str, entry: bytes) -> None:
    from hotswap.engine.loading.artifacts import shared_spans

    cache.put(key, entry, tier="default", shared=shared_spans(entry))


def test_a_second_entry_with_the_same_headers_adds_only_its_own_bytes(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "c")
    header = bytes(range(256)) * 1024  # 256 KiB
    first, second = _entry(b"a" * 3000, header), _entry(b"b" * 5000, header)
    _put_entry(cache, KEY_A, first)
    after_first = cache.stats()
    assert after_first["shared_bytes"] == len(header) and after_first["shared_files"] == 1
    assert after_first["entry_bytes"] < len(first) - len(header) + 1024  # header not in it
    _put_entry(cache, KEY_B, second)
    after_second = cache.stats()
    own_b = next(e.size_bytes for e in cache.entries() if e.key == KEY_B)
    assert after_second["shared_bytes"] == len(header)
    assert after_second["bytes"] - after_first["bytes"] == own_b < len(second) - len(header) + 1024
    assert {e.key: e.shared_bytes for e in cache.entries()} == {KEY_A: len(header),
                                                                KEY_B: len(header)}
    # Each reads back whole, in this process and another.
    assert cache.get(KEY_A) == first and _cache(tmp_path / "c").get(KEY_B) == second


def test_shared_content_goes_with_the_last_entry_naming_it(tmp_path: Path) -> None:
    header = b"h" * (128 * 1024)
    cache = _cache(tmp_path / "c", max_bytes=len(header) + 3 * 1024)
    _put_entry(cache, KEY_A, _entry(b"a" * 500, header))
    _put_entry(cache, KEY_B, _entry(b"b" * 500, header))
    blobs = list((tmp_path / "c" / "shared").glob("*/*.blob"))
    assert len(blobs) == 1
    cache.put(KEY_C, b"c" * 2500)  # evicts A, then B; the header goes with B
    assert [e.key for e in cache.entries()] == [KEY_C]
    assert not blobs[0].exists()
    assert cache.stats()["shared_bytes"] == 0
    _put_entry(cache, KEY_A, _entry(b"a" * 500, header))
    cache.clear()
    assert list((tmp_path / "c" / "shared").glob("*/*.blob")) == []


def _flip_blob(blob: Path) -> None:
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [Path.unlink, _flip_blob,
                                    lambda p: p.write_bytes(p.read_bytes()[:-1])],
                         ids=["missing", "altered", "truncated"])
def test_an_entry_whose_shared_content_is_bad_is_refused(tmp_path: Path, damage: object) -> None:
    cache = _cache(tmp_path / "c")
    entry = _entry(b"a" * 500, b"h" * (128 * 1024))
    _put_entry(cache, KEY_A, entry)
    [blob] = (tmp_path / "c" / "shared").glob("*/*.blob")
    damage(blob)  # type: ignore[operator]
    assert cache.verify() != []
    assert cache.get(KEY_A) is None and cache.rejected == 1
    assert cache.entries() == [] and not blob.exists()
    _put_entry(cache, KEY_A, entry)  # stored anew, blob included
    assert cache.get(KEY_A) == entry


def test_a_header_in_place_is_neither_read_nor_restored_and_such_a_read_is_never_stored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load whose precompiled header is where inductor looks, whole, does not read it (a
    warm restart read and hashed 149 MiB for nothing): the span comes as zeros, named unread,
    and ``load_entry``'s files leave it out; such a payload is never stored. Not in place (or
    of another size), it is read and checked as before."""
    import sys
    import types

    from hotswap.cache.store import Unread
    from hotswap.engine.loading import artifacts, kernel_files

    headers = tmp_path / "inductor" / kernel_files.HEADERS_DIR
    monkeypatch.setattr(kernel_files, "headers_dir", lambda: str(headers))
    if "torch._inductor.codecache" not in sys.modules:  # as after a dynamo trace
        monkeypatch.setitem(sys.modules, "torch._inductor.codecache",
                            types.ModuleType("torch._inductor.codecache"))
    cache = _cache(tmp_path / "c")
    header = bytes(range(256)) * 512
    entry = _entry(b"a" * 3000, header)
    _put_entry(cache, KEY_A, entry)
    [blob] = (tmp_path / "c" / "shared").glob("*/*.blob")

    read = cache.get(KEY_A, have=artifacts.headers_in_place())  # not in place: read
    assert read == entry and not getattr(read, "unread", ())
    headers.mkdir(parents=True)
    (headers / "c7ud.h.gch").write_bytes(b"x" * (len(header) - 1))  # cut short: read
    assert cache.get(KEY_A, have=artifacts.headers_in_place()) == entry
    (headers / "c7ud.h.gch").write_bytes(header)
    _flip_blob(blob)  # not read: a changed byte goes unnoticed by this read
    unread = cache.get(KEY_A, have=artifacts.headers_in_place())
    assert isinstance(unread, Unread) and len(unread) == len(entry)
    [(offset, n)] = unread.unread
    assert n == len(header) and unread[offset:offset + n] == bytes(n)
    assert unread[:offset] == entry[:offset] and unread[offset + n:] == entry[offset + n:]
    _, files = artifacts.entry_parts(unread)
    assert list(files) == ["ab/cab.so"]  # the header is not restored from zeros
    for data in (unread, memoryview(unread)):
        with pytest.raises(ValueError, match="unread"):
            cache.put(KEY_B, data, tier="default")
    assert cache.get(KEY_A) is None  # a whole read still checks the blob: refused
    _put_entry(cache, KEY_A, entry)
    [blob] = (tmp_path / "c" / "shared").glob("*/*.blob")
    blob.write_bytes(blob.read_bytes()[:-1])  # cut short: even a read that skips it refuses
    assert cache.get(KEY_A, have=artifacts.headers_in_place()) is None
    assert cache.rejected == 2 and not blob.exists()


def test_shared_content_another_user_may_write_is_refused(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "c")
    _put_entry(cache, KEY_A, _entry(b"a" * 500, b"h" * (128 * 1024)))
    [blob] = (tmp_path / "c" / "shared").glob("*/*.blob")
    blob.chmod(0o666)
    assert cache.get(KEY_A) is None and cache.rejected == 1


def test_a_lost_index_is_rebuilt_with_what_entries_share(tmp_path: Path) -> None:
    header = b"h" * (128 * 1024)
    cache = _cache(tmp_path / "c")
    _put_entry(cache, KEY_A, _entry(b"a" * 500, header))
    _put_entry(cache, KEY_B, _entry(b"b" * 500, header))
    (tmp_path / "c" / "index.msgpack").unlink()
    assert cache.stats()["shared_bytes"] == len(header)
    cache.clear(tier="default")
    assert cache.entries() == [] and cache.stats()["shared_files"] == 0


def test_shared_spans_must_lie_inside_the_payload_and_apart(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "c")
    for spans in ([(0, 11)], [(0, 4), (2, 4)], [(3, 0)]):
        with pytest.raises(ValueError, match="shared spans"):
            cache.put(KEY_A, b"0123456789", shared=spans)
    cache.put(KEY_A, b"0123456789", shared=[(6, 4), (0, 2)])
    assert cache.get(KEY_A) == b"0123456789"


def test_blobs_no_entry_names_go_once_old_and_a_replaced_entry_lets_its_own_go(
        tmp_path: Path) -> None:
    import os
    import time

    cache = _cache(tmp_path / "c")
    _put_entry(cache, KEY_A, _entry(b"a" * 500, b"h" * (128 * 1024)))
    [first] = (tmp_path / "c" / "shared").glob("*/*.blob")
    # The same key stored again with another header: the old header goes with the old record.
    _put_entry(cache, KEY_A, _entry(b"a" * 500, b"g" * (128 * 1024)))
    assert not first.exists() and cache.stats()["shared_files"] == 1
    # A blob a put cut short left (no record names it): kept while young, removed once old.
    stray = first.parent.parent / ("ab")
    stray.mkdir(exist_ok=True)
    young, old = stray / ("ab" + "1" * 62 + ".blob"), stray / ("ab" + "2" * 62 + ".blob")
    for blob in (young, old):
        blob.write_bytes(b"left behind")
        blob.chmod(0o600)
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    cache.put(KEY_B, b"another entry")
    assert young.exists() and not old.exists()


def test_an_entry_noted_without_a_record_keeps_the_blobs_it_names(tmp_path: Path) -> None:
    header = b"h" * (128 * 1024)
    cache = _cache(tmp_path / "c")
    _put_entry(cache, KEY_A, _entry(b"a" * 500, header))
    (tmp_path / "c" / "index.msgpack").write_bytes(b"\x80")  # an empty index: no record
    cache.touch(KEY_A)
    [entry] = cache.entries()
    assert entry.shared_bytes == len(header)
