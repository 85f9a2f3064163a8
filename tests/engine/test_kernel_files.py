from __future__ import annotations

import os
import time
from pathlib import Path

from hotswap.engine.loading import kernel_files


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
    (dst / "ab" / "kernel.cpp").write_text("// already here")
    escaping = {**files, os.path.join("..", "escape.so"): b"no"}
    assert kernel_files.restore_files(str(dst), escaping) == 4  # all but the one already there
    assert (dst / "ab" / "kernel.so").read_bytes() == b"\x7fELF kernel"
    assert (dst / "ab" / "kernel.cpp").read_text() == "// already here"  # never overwritten
    assert not (tmp_path / "escape.so").exists()  # never outside the cache dir


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
