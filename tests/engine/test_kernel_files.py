from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from hotswap.engine.loading import kernel_files
from tests.cache.test_trust import ATTACKER, as_root


def test_files_written_since_and_restore(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "ab").mkdir(parents=True)
    old = src / "ab" / "old.so"
    old.write_bytes(b"old")
    os.utime(old, (time.time() - 100, time.time() - 100))
    since = time.time() - 1
    (src / "ab" / "kernel.so").write_bytes(b"\x7fELF kernel")
    (src / "ab" / "kernel.cpp").write_text("// source")
    (src / "ab" / "x.lock").write_text("")
    for entries in ("fxgraph", "aotautograd"):  # the artifact itself carries these
        (src / entries / "ab").mkdir(parents=True)
        (src / entries / "ab" / "entry").write_bytes(b"cache entry")
    kernel = src / "triton" / "0" / "HASH"  # triton's cache: the binary and metadata travel
    kernel.mkdir(parents=True)
    for suffix in ("cubin", "json", "ptx", "llir", "ttir", "ttgir", "source"):
        (kernel / f"k.{suffix}").write_bytes(suffix.encode())
    (src / "ab" / "not_triton.ptx").write_bytes(b"outside triton's cache, kept")
    files = kernel_files.files_written_since(str(src), since)
    triton = os.path.join("triton", "0", "HASH")
    assert files == {os.path.join("ab", "kernel.so"): b"\x7fELF kernel",
                     os.path.join("ab", "kernel.cpp"): b"// source",
                     os.path.join("ab", "not_triton.ptx"): b"outside triton's cache, kept",
                     os.path.join(triton, "k.cubin"): b"cubin",
                     os.path.join(triton, "k.json"): b"json"}
    (dst / "ab").mkdir(parents=True)
    (dst / "ab" / "kernel.cpp").write_text("// SOURCE")  # there whole (as long as the entry's)
    escaping = {**files, os.path.join("..", "escape.so"): b"no"}
    assert kernel_files.restore_files(str(dst), escaping) == 4  # all but the one already there
    assert (dst / "ab" / "kernel.so").read_bytes() == b"\x7fELF kernel"
    assert (dst / "ab" / "kernel.cpp").read_text() == "// SOURCE"  # never written again
    assert not (tmp_path / "escape.so").exists()  # never outside the cache dir
    # A library cut short (a compile killed while linking it in place) is replaced.
    (dst / "ab" / "kernel.so").write_bytes(b"\x7fE")
    assert kernel_files.restore_files(str(dst), files) == 1
    assert (dst / "ab" / "kernel.so").read_bytes() == b"\x7fELF kernel"


def test_an_entry_reads_back_as_views_and_a_damaged_one_is_refused() -> None:
    import pytest

    from hotswap.engine.loading.artifacts import entry_parts, pack_entry

    files = {os.path.join("ab", "kernel.so"): b"\x7fELF", "empty.py": b""}
    entry = pack_entry(b"artifact bytes", files)
    artifact, parts = entry_parts(entry)
    assert isinstance(artifact, memoryview) and artifact == b"artifact bytes"
    assert {k: bytes(v) for k, v in parts.items()} == files and list(parts) == list(files)
    assert entry_parts(pack_entry(b"", {}))[0] == b""
    for damaged in (entry[:-1], entry + b"x", b"HSE0" + entry[4:], entry[:6], b"HSE1\0\0\0\3abc"):
        with pytest.raises(ValueError):
            entry_parts(damaged)



def test_an_entry_carries_the_headers_where_inductor_keeps_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Precompiled headers live under inductor's default cache directory, not the one
    TORCHINDUCTOR_CACHE_DIR names: a compile's files carry those written since its worker's
    warm-up (a load needs them) but not the warm-up's own kernels, and a load puts each file
    back where inductor looks for it; one whose build was cut short (gcc's mark missing) is
    not shipped."""
    cache, headers = tmp_path / "cache", tmp_path / "default" / kernel_files.HEADERS_DIR
    monkeypatch.setattr(kernel_files, "inductor_cache_dir", lambda: str(cache))
    monkeypatch.setattr(kernel_files, "headers_dir", lambda: str(headers))
    warm_s, job_s = time.time() - 100, time.time() - 1
    headers.mkdir(parents=True)
    (headers / "c7ud.h").write_bytes(b"#include <torch>")
    (headers / "c7ud.h.gch").write_bytes(b"gpch+014 precompiled")
    (headers / "cut.h.gch").write_bytes(b"gpcWrite, then killed")
    (headers / "older.h.gch").write_bytes(b"gpch+014 built before the worker started")
    os.utime(headers / "older.h.gch", (warm_s - 10, warm_s - 10))
    warm_kernel = cache / "wa" / "warm.so"
    warm_kernel.parent.mkdir(parents=True)
    warm_kernel.write_bytes(b"warm-up's kernel")
    for path in (headers / "c7ud.h", headers / "c7ud.h.gch", headers / "cut.h.gch", warm_kernel):
        os.utime(path, (warm_s + 10, warm_s + 10))
    (cache / "ab").mkdir()
    (cache / "ab" / "job.so").write_bytes(b"job's kernel")
    files = kernel_files.compile_outputs([], job_s, headers_since_s=warm_s)
    assert files == {"precompiled_headers/c7ud.h": b"#include <torch>",
                     "precompiled_headers/c7ud.h.gch": b"gpch+014 precompiled",
                     os.path.join("ab", "job.so"): b"job's kernel"}
    assert kernel_files.compile_outputs([], job_s) == {
        os.path.join("ab", "job.so"): b"job's kernel"}
    shutil.rmtree(cache)
    shutil.rmtree(headers)
    assert kernel_files.restore(files) == 3
    assert (headers / "c7ud.h.gch").read_bytes() == b"gpch+014 precompiled"
    assert (cache / "ab" / "job.so").read_bytes() == b"job's kernel"
    assert not (cache / kernel_files.HEADERS_DIR).exists()


def test_a_header_whose_build_was_cut_short_is_removed_unless_being_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gcc marks a precompiled header it is writing ("gpcWrite") and puts its real mark there
    at the end; inductor builds one only where none is, so one a kill cut short would stand
    for good (and gcc takes it for none). Removed, but never while inductor's lock for it is
    held (a build under way), and never in a folder others may write."""
    import filelock

    headers = tmp_path / kernel_files.HEADERS_DIR
    (headers / "locks").mkdir(parents=True)
    monkeypatch.setattr(kernel_files, "headers_dir", lambda: str(headers))
    (headers / "cdone.h.gch").write_bytes(b"gpch+014" + b"\0" * 100)
    (headers / "ccut.h.gch").write_bytes(b"gpcWrite" + b"\0" * 100)
    (headers / "cnow.h.gch").write_bytes(b"gpcWrite")
    (headers / "cempty.h.gch").write_bytes(b"")
    with filelock.FileLock(str(headers / "locks" / "cnow.lock")):
        removed = kernel_files.remove_cut_short_headers()
    assert sorted(removed) == [str(headers / "ccut.h.gch"), str(headers / "cempty.h.gch")]
    assert sorted(p.name for p in headers.glob("*.gch")) == ["cdone.h.gch", "cnow.h.gch"]
    os.chmod(headers, 0o777)  # anyone may write it: nothing there is ours to judge
    assert kernel_files.remove_cut_short_headers() == []
    assert (headers / "cnow.h.gch").exists()
    os.chmod(headers, 0o755)
    assert kernel_files.remove_cut_short_headers() == [str(headers / "cnow.h.gch")]


@as_root
def test_nothing_another_user_could_have_written_rides_in_an_entry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Inductor's folders default to ``/tmp/torchinductor_<user>``, a name another user can
    take first: an entry signs what it carries, so a folder of theirs ships nothing and is
    not restored into, and in a folder of ours a file they own, one anyone may write or a
    link is left out."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for folder in (ours, theirs):
        (folder / "ab").mkdir(parents=True)
        (folder / "ab" / "kernel.so").write_bytes(b"\x7fELF")
    os.chown(theirs, ATTACKER, ATTACKER)
    for name, mode in (("foreign.so", 0o644), ("group.so", 0o664), ("world.so", 0o646)):
        (ours / "ab" / name).write_bytes(b"planted")
        os.chmod(ours / "ab" / name, mode)
    os.chown(ours / "ab" / "foreign.so", ATTACKER, ATTACKER)
    outside = tmp_path / "outside.so"
    outside.write_bytes(b"outside the cache")
    (ours / "ab" / "link.so").symlink_to(outside)
    headers = tmp_path / "default" / kernel_files.HEADERS_DIR
    headers.mkdir(parents=True)
    (headers / "h.gch").write_bytes(b"gpch+014")
    monkeypatch.setattr(kernel_files, "headers_dir", lambda: str(headers))
    since = time.time() - 10

    monkeypatch.setattr(kernel_files, "inductor_cache_dir", lambda: str(ours))
    assert kernel_files.compile_outputs([str(ours / "ab" / "group.cpp")], since) == {
        os.path.join("ab", "kernel.so"): b"\x7fELF",
        "precompiled_headers/h.gch": b"gpch+014"}
    assert "not trusted" not in caplog.text

    monkeypatch.setattr(kernel_files, "inductor_cache_dir", lambda: str(theirs))
    assert kernel_files.compile_outputs([], since) == {"precompiled_headers/h.gch": b"gpch+014"}
    assert kernel_files.restore({os.path.join("cd", "new.so"): b"ours"}) == 0
    assert not (theirs / "cd").exists()
    assert f"inductor's folder {theirs} is not trusted" in caplog.text
    assert f"belongs to uid {ATTACKER}" in caplog.text
    assert "ab/group.so is not shipped in a cache entry" in caplog.text

    # Not made yet, in a folder anyone may write with the sticky bit (/tmp, as inductor's
    # default is): restored, the folder made; under a folder of theirs: not.
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    fresh = sticky / "torchinductor_me"
    monkeypatch.setattr(kernel_files, "inductor_cache_dir", lambda: str(fresh))
    assert kernel_files.restore({os.path.join("cd", "new.so"): b"ours"}) == 1
    assert (fresh / "cd" / "new.so").read_bytes() == b"ours"
    monkeypatch.setattr(kernel_files, "inductor_cache_dir", lambda: str(theirs / "below"))
    assert kernel_files.restore({os.path.join("cd", "new.so"): b"ours"}) == 0
    assert not (theirs / "below").exists()


def test_a_damaged_library_is_named_only_inside_inductors_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hotswap.engine.loading.kernel_files import damaged_library

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    inside = tmp_path / "inductor" / "ab" / "cab.main.so"
    inside.parent.mkdir(parents=True)
    inside.write_bytes(b"\x7fELF")
    outside = tmp_path / "elsewhere.so"
    outside.write_bytes(b"\x7fELF")
    assert damaged_library(ImportError(f"{inside}: file too short")) == str(inside)
    try:  # found where the loader's error is the cause of inductor's own
        try:
            raise OSError(f"{inside}: invalid ELF header")
        except OSError as e:
            raise RuntimeError("inductor raised") from e
    except RuntimeError as wrapped:
        assert damaged_library(wrapped) == str(inside)
    assert damaged_library(ImportError(f"{outside}: file too short")) is None
    assert damaged_library(ImportError(f"{inside}: undefined symbol: foo")) is None
    inside.unlink()
    assert damaged_library(ImportError(f"{inside}: file too short")) is None  # gone already
