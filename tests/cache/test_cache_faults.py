"""The environment breaks the cache, never the user's call: a full disk at a hit, an entry
that cannot be read, a directory that is not a cache."""

from __future__ import annotations

import errno
import logging
import threading
from pathlib import Path

import pytest
import torch

import hotswap
from hotswap.cache import ArtifactCache
from hotswap.engine.shipping.keys import environment_stamp
from hotswap.engine.sources.cache_access import CacheAccess


def _disk_full(*_: object, **__: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_hit_on_a_full_disk_is_still_a_hit(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cache = ArtifactCache(tmp_path, stamp=environment_stamp())
    cache.put("c" * 64, b"payload", tier="default")
    monkeypatch.setattr(ArtifactCache, "_write_index", _disk_full)
    assert cache.get("c" * 64) == b"payload"


def test_every_call_is_served_when_the_disk_fills_under_a_warm_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    hotswap.compile(model, mode="subprocess", workers=1, cache_dir=str(tmp_path))(x)  # warm
    monkeypatch.setattr(ArtifactCache, "_write_index", _disk_full)
    torch._dynamo.reset()
    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(model, mode="subprocess", workers=1, cache_dir=str(tmp_path))
        torch.testing.assert_close(compiled(x), model(x))
        torch.testing.assert_close(compiled(x), model(x))
    assert d["cache_hits"] == 1 and d["worker_compiles"] == 0


def test_a_warm_cache_is_a_hit_inside_fault_injection_that_draws_no_fault(
        tmp_path: Path) -> None:
    """``testing.inject`` wraps the local store (``stores.wrap_local``): the wrapper takes
    every argument of a read for a load (a read it refused was a miss, and every run of
    ``hotswap stress`` compiled what its cache held)."""
    from hotswap import testing

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    hotswap.compile(model, mode="subprocess", workers=1, cache_dir=str(tmp_path))(x)  # warm
    torch._dynamo.reset()
    with testing.inject(testing.FaultPlan({"corrupt-cache": 0.0})), \
            hotswap.counters_delta() as d:
        compiled = hotswap.compile(model, mode="subprocess", workers=1, cache_dir=str(tmp_path))
        torch.testing.assert_close(compiled(x), model(x))
    assert d["cache_hits"] == 1 and d["worker_compiles"] == 0


def test_a_read_for_a_load_leaves_a_header_in_place_unread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from hotswap.engine.loading import artifacts, kernel_files

    headers = tmp_path / "inductor" / kernel_files.HEADERS_DIR
    monkeypatch.setattr(kernel_files, "headers_dir", lambda: str(headers))
    if "torch._inductor.codecache" not in sys.modules:  # as after a dynamo trace
        monkeypatch.setitem(sys.modules, "torch._inductor.codecache",
                            types.ModuleType("torch._inductor.codecache"))
    access = CacheAccess(str(tmp_path / "cache"), None)
    access.keys(torch.fx.symbolic_trace(torch.nn.ReLU()), (), False, [])  # opens the cache
    header = b"h" * (128 * 1024)
    entry = artifacts.pack_entry(b"a" * 500, {"precompiled_headers/c7ud.h.gch": header})
    access._put("d" * 64, entry, "default")
    headers.mkdir(parents=True)
    (headers / "c7ud.h.gch").write_bytes(header)
    read = access.get("d" * 64)
    assert read is not None and len(read) == len(entry)
    assert [n for _, n in getattr(read, "unread", ())] == [len(header)]
    assert artifacts.entry_parts(read)[1] == {}  # nothing to restore: it is in place


def test_an_unreadable_entry_is_a_miss_logged_once(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    access = CacheAccess(str(tmp_path), None)
    access.keys(torch.fx.symbolic_trace(torch.nn.ReLU()), (), False, [])  # opens the cache
    assert access.enabled
    for key in ("a" * 64, "b" * 64):
        path = access._cache._path(key)  # type: ignore[union-attr]
        path.mkdir(parents=True)  # an entry path that is a directory: IsADirectoryError
    with caplog.at_level(logging.WARNING, logger="hotswap"):
        assert access.get("a" * 64) is None and access.get("b" * 64) is None
    warnings = [r for r in caplog.records if "could not read the artifact cache" in r.message]
    assert len(warnings) == 1 and str(tmp_path) in warnings[0].message


def test_a_refused_entry_counts_once_when_another_read_runs_beside_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    access = CacheAccess(str(tmp_path), None)
    access.keys(torch.fx.symbolic_trace(torch.nn.ReLU()), (), False, [])  # opens the cache
    cache = access._cache
    assert cache is not None
    good, bad = "a" * 64, "b" * 64
    cache.put(good, b"payload", tier="default")
    cache.put(bad, b"payload", tier="default")
    path = cache._path(bad)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    # The two reads overlap: both start before the refusal, the hit ends after it.
    both_in, refused = threading.Barrier(2), threading.Event()
    read = ArtifactCache.get

    def overlapping(self: ArtifactCache, key: str, **kwargs: bool) -> bytes | bytearray | None:
        both_in.wait(5)
        entry = read(self, key, **kwargs)
        if entry is None:
            refused.set()
        else:
            assert refused.wait(5)
        return entry

    monkeypatch.setattr(ArtifactCache, "get", overlapping)
    got: dict[str, object] = {}
    with hotswap.counters_delta() as d:
        readers = [threading.Thread(target=lambda k=k: got.update({k: access.get(k)}))
                   for k in (good, bad)]
        for t in readers:
            t.start()
        for t in readers:
            t.join(10)
    assert got == {good: b"payload", bad: None}
    assert d["cache_rejects"] == 1 and cache.rejected == 1


def _snapshot(path: Path) -> tuple[int, list[str]]:
    return path.stat().st_mode, sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_a_foreign_directory_is_refused_untouched(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    from hotswap.cli import main

    home = tmp_path / "home"
    (home / "projects").mkdir(parents=True)
    (home / "notes.txt").write_text("mine")
    home.chmod(0o755)
    before = _snapshot(home)
    with pytest.raises(ValueError, match="refusing to use"):
        ArtifactCache(home)
    for action in ("ls", "stats", "verify", "clear"):
        assert main(["cache", action, "--cache-dir", str(home)]) == 2
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    x = torch.randn(2, 8)
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="hotswap"):
        compiled = hotswap.compile(model, mode="subprocess", workers=1, cache_dir=str(home))
        torch.testing.assert_close(compiled(x), model(x))  # served, compiled, uncached
    assert hotswap.status(compiled)[0].tier == "default"
    assert "refusing to use" in caplog.text
    assert _snapshot(home) == before


def test_an_empty_directory_becomes_a_cache_and_keeps_its_mode(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    mine.chmod(0o750)
    cache = ArtifactCache(mine, stamp=environment_stamp())
    cache.put("d" * 64, b"x", tier="default")
    assert (mine / "HOTSWAP_CACHE").exists() and mine.stat().st_mode & 0o777 == 0o750
    assert ArtifactCache(mine, stamp=environment_stamp()).get("d" * 64) == b"x"  # opens again
    fresh = tmp_path / "fresh" / "cache"
    ArtifactCache(fresh)
    assert fresh.stat().st_mode & 0o777 == 0o700  # one hotswap creates is private


def test_a_cache_from_before_markers_is_adopted(tmp_path: Path) -> None:
    old = tmp_path / "old"
    cache = ArtifactCache(old, stamp=environment_stamp())
    cache.put("e" * 64, b"payload", tier="default")
    (old / "HOTSWAP_CACHE").unlink()  # as a cache written before markers
    assert ArtifactCache(old, stamp=environment_stamp()).get("e" * 64) == b"payload"
    assert (old / "HOTSWAP_CACHE").exists()


def test_links_inside_the_cache_are_not_followed(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache", stamp=environment_stamp())
    key = "ab" + "0" * 62
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / f"{key}.hsa").write_bytes(b"not ours")
    (tmp_path / "cache" / "entries" / "ab").symlink_to(outside)  # a linked shard
    access = CacheAccess(str(tmp_path / "cache"), None)
    access.keys(torch.fx.symbolic_trace(torch.nn.ReLU()), (), False, [])
    assert access.get(key) is None  # a miss, not a read through the link
    assert access.store(key, "default", b"payload") is None  # nor a write
    assert cache.clear() == 0
    assert [p.name for p in outside.iterdir()] == [f"{key}.hsa"]
    assert (outside / f"{key}.hsa").read_bytes() == b"not ours"


def test_clear_removes_only_what_hotswap_wrote(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path, stamp=environment_stamp())
    key = "ab" + "1" * 62
    cache.put(key, b"payload", tier="default")
    shard = cache.entry_path(key).parent
    strangers = [shard / "notes.hsa", shard / "README", tmp_path / "entries" / "cd" /
                 f"{key}.hsa"]  # not a key's name; not an entry; an entry in the wrong shard
    for path in strangers:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"not hotswap's")
    assert cache.clear() == 1
    assert not cache.entry_path(key).exists()
    assert all(p.read_bytes() == b"not hotswap's" for p in strangers)
    assert cache.verify() == [] and cache.entries() == []
