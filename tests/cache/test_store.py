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
