from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from hotswap.cli import main


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("hotswap ")


def test_doctor_starts_a_worker(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "1 workers started" in out
    assert "torch intra-op threads:" in out
    # this torch (OpenMP, MKL) lets hotswap set a thread's own count
    assert "eager answers while compile workers run: at most the cores the workers leave" in out
    assert "\nbytecode: " in out and "hotswap's bytecode cache (HOTSWAP_PYCACHE=" in out


def test_doctor_says_what_recompiling_at_every_start_costs_and_where_the_cache_is(
        tmp_path: Path) -> None:
    from hotswap.cli import bytecode_lines
    from hotswap.system.bytecode import Bytecode

    (tmp_path / "m.cpython-311.pyc").write_bytes(b"x" * 2048)
    why = "PYTHONDONTWRITEBYTECODE is set and torch's modules have no bytecode beside them"
    first, cache, note = bytecode_lines(Bytecode("auto", why, tmp_path), 50 * 2**20, 10 * 2**20)
    assert first == (f"bytecode: every fresh process compiles Python sources here ({why}): "
                     "~5.0 s a start (50.0 MiB of source a worker imports, compiled here at "
                     "10.0 MiB/s)")
    assert cache == (f"  hotswap's bytecode cache (HOTSWAP_PYCACHE=auto): in use by its workers "
                     f"and service, {tmp_path} (2.0 KiB in 1 files)")
    assert f"PYTHONPYCACHEPREFIX={tmp_path}" in note
    fine = Bytecode("auto", None, None, "not needed: fresh processes read bytecode")
    assert bytecode_lines(fine, None, None) == [
        "bytecode: fresh processes read torch's bytecode (nothing compiled at start)",
        "  hotswap's bytecode cache (HOTSWAP_PYCACHE=auto): not needed: fresh processes read "
        "bytecode"]


def test_doctor_says_how_the_bytecode_cache_is_filled_and_what_this_process_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hotswap.cli import filling_lines
    from hotswap.system import bytecode
    from hotswap.system.bytecode import Bytecode

    monkeypatch.setattr(bytecode, "MIN_CPUS", 8)  # as shipped (the tests' fixture raises it)

    used = Bytecode("auto", "no bytecode", tmp_path)
    own = {"read": 83, "compiled": 2, "written": 2}
    assert filling_lines(used, 16, tmp_path, own) == [
        "  a first process fills it in 8 processes at once (16 usable cores)",
        f"  hotswap's own modules in this process: 83 read from {tmp_path}, 2 compiled from "
        "source"]
    assert filling_lines(used, 2, None, own) == [
        "  filled by the workers as they import (2 usable cores; in parallel from 8)"]
    assert filling_lines(Bytecode("auto", None, None, "not needed"), 16, None, own) == []


def test_thread_advice_only_when_a_cpu_model_fills_every_core() -> None:
    from hotswap.cli import thread_advice

    advice = thread_advice(cores=2, threads=2, cuda=False)
    assert advice is not None and "torch.set_num_threads(1)" in advice
    assert "HOTSWAP_EAGER_THREADS=auto" in advice
    assert "HOTSWAP_EAGER_THREADS=keep" in str(thread_advice(2, 2, False, lends=False))
    assert thread_advice(cores=8, threads=16, cuda=False) is not None
    assert thread_advice(cores=2, threads=1, cuda=False) is None  # a core left free
    assert thread_advice(cores=1, threads=1, cuda=False) is None  # nothing to leave free
    assert thread_advice(cores=16, threads=16, cuda=True) is None  # the GPU does the work


def test_unknown_command_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def test_cache_commands_on_a_populated_cache(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from hotswap.cache import ArtifactCache

    cache = ArtifactCache(tmp_path, stamp={"torch": "2.13.0", "gpus": []})  # a real build's stamp
    cache.put("aa" + "0" * 62, b"x" * 2048, tier="default")
    cache.put("bb" + "0" * 62, b"y" * 1024, tier="max-autotune")
    assert main(["cache", "ls", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "max-autotune" in out and "default" in out and "2 entries" in out
    assert main(["cache", "stats", "--cache-dir", str(tmp_path)]) == 0
    assert "entries: 2" in capsys.readouterr().out
    path = cache._path("bb" + "0" * 62)
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # the MAC's last byte, changed whatever it was
    assert main(["cache", "verify", "--cache-dir", str(tmp_path)]) == 1
    assert "2 entries verified, 1 bad" in capsys.readouterr().out
    assert main(["cache", "verify", "--remove", "--cache-dir", str(tmp_path)]) == 1
    assert "1 entries verified, 1 removed" in capsys.readouterr().out
    assert main(["cache", "clear", "--cache-dir", str(tmp_path)]) == 0
    assert "removed 1 entries" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["doctor", "--workers", "0"], ["doctor", "--workers", "two"]])
def test_bad_numbers_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "--workers: must be a whole number >= 1" in capsys.readouterr().err


def test_a_cache_dir_that_is_a_file_is_a_usage_error_with_a_message(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("mine")
    assert main(["cache", "ls", "--cache-dir", str(a_file)]) == 2
    err = capsys.readouterr().err
    assert "is not a directory" in err and "Traceback" not in err
    assert a_file.read_text() == "mine"  # untouched


def test_cache_commands_on_a_missing_directory_create_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere"
    for action in ("ls", "stats", "verify", "clear"):
        assert main(["cache", action, "--cache-dir", str(missing)]) == 0
        assert "no artifact cache at" in capsys.readouterr().out
    assert main(["cache", "stats", "--cache-dir", str(missing), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"root": str(missing), "exists": False,
                                                   "entries": 0}
    assert not missing.exists()


def test_cache_stats_reads_as_sizes_and_as_json(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from hotswap.cache import ArtifactCache

    cache = ArtifactCache(tmp_path / "c", stamp={"test": 1})
    cache.put("ab" * 32, b"x" * 3000, tier="default", origin="forward (model.py:12)")
    assert main(["cache", "stats", "--cache-dir", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "entries: 1" in out and "KiB" in out and "None" not in out
    assert "shared, stored once: 0 bytes in 0 files" in out
    assert main(["cache", "ls", "--cache-dir", str(tmp_path / "c")]) == 0
    assert "forward (model.py:12)" in capsys.readouterr().out
    assert main(["cache", "ls", "--cache-dir", str(tmp_path / "c"), "--json"]) == 0
    [entry] = json.loads(capsys.readouterr().out)
    assert entry["tier"] == "default" and entry["size_bytes"] >= 3000
    assert entry["origin"] == "forward (model.py:12)"


@pytest.mark.parametrize("command", ["bench", "stress", "profile", "corpus"])
def test_help_shows_no_markup(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "``" not in capsys.readouterr().out


def test_bench_check_fails_on_a_missed_target_and_progress_goes_to_stderr(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from hotswap.tools.bench import main as bench

    def row(name: str, first_output_s: float) -> dict[str, object]:
        return {"row": name, "ready_s": 1.0, "first_output_s": first_output_s,
                "first_call_s": 0.1, "to_final_s": 5.0, "largest_call_ms": 0.0, "calls": 1,
                "steady_ms": 1.0, "eager_ms": 1.0, "caller": "busy"}

    slow = {"hotswap:async": 9.0, "torch:eager-backend": 2.0}  # 4.5x, target <= 1.1x
    monkeypatch.setattr(bench, "spawn_row", lambda name, args, **_: row(name, slow[name]))
    argv = ["--rows", "hotswap:async,torch:eager-backend", "--no-dispatch", "--device", "cpu"]
    assert bench.main(argv) == 0  # without --check, a miss is reported, not an exit status
    captured = capsys.readouterr()
    assert "MISSED" in captured.out and "running hotswap:async" in captured.err
    assert "running" not in captured.out
    assert bench.main([*argv, "--check"]) == 1
    assert "1 target(s) missed" in capsys.readouterr().err
    slow["hotswap:async"] = 2.1
    assert bench.main([*argv, "--check"]) == 0


def _files(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


def test_a_folder_that_only_looks_like_a_cache_is_never_written_or_cleared(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A secret.key and an entries/ folder of the user's own (no marker): every command
    refuses it with a message, and nothing in it changes."""
    looks = tmp_path / "looks"
    (looks / "entries" / "ab").mkdir(parents=True)
    (looks / "secret.key").write_bytes(b"k" * 32)
    (looks / "entries" / "ab" / f"{'ab' * 32}.hsa").write_bytes(b"the user's own file")
    looks.chmod(0o700)
    before = _files(looks)
    for argv in (["ls"], ["stats"], ["verify"], ["verify", "--remove"], ["clear"],
                 ["clear", "--verdicts"]):
        assert main(["cache", *argv, "--cache-dir", str(looks)]) == 2
        err = capsys.readouterr().err
        assert "is not a hotswap artifact cache" in err and "Traceback" not in err
    assert _files(looks) == before


def test_read_only_commands_write_nothing(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from hotswap.cache import ArtifactCache

    empty = tmp_path / "empty"
    empty.mkdir()
    for action in ("ls", "stats", "verify"):
        assert main(["cache", action, "--cache-dir", str(empty)]) == 0
        assert "no artifact cache at" in capsys.readouterr().out
    assert list(empty.iterdir()) == []
    cache = ArtifactCache(tmp_path / "c", stamp={"test": 1})
    cache.put("ab" * 32, b"x", tier="default")
    (tmp_path / "c" / "index.msgpack").unlink()  # ls rebuilds it in memory, not on disk
    before = _files(tmp_path / "c")
    for action in ("ls", "stats", "verify"):
        assert main(["cache", action, "--cache-dir", str(tmp_path / "c")]) == 0
    assert "1 entries" in capsys.readouterr().out
    assert _files(tmp_path / "c") == before


def test_clear_empties_the_compiled_python_folders_stats_counts_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bytecode and inductor's templates sit beside the entries, outside the size limit:
    stats counts them, clear empties them (the folders stay), a folder another user could
    write is left with a message, and --verdicts leaves them alone."""
    from hotswap.cache import ArtifactCache
    from hotswap.system.bytecode import claim_folder

    root = tmp_path / "c"
    ArtifactCache(root, stamp={"test": 1}).put("ab" * 32, b"x", tier="default")
    pyc = claim_folder(root / "pycache-cpython-311")
    (pyc / "usr" / "lib").mkdir(parents=True)
    (pyc / "usr" / "lib" / "m.cpython-311.pyc").write_bytes(b"p" * 300)
    (pyc / "usr" / "lib" / "n.cpython-311.pyc").write_bytes(b"p" * 200)
    templates = claim_folder(root / "templates-cpython-311")
    (templates / ("ef" * 32 + ".code")).write_bytes(b"t" * 40)
    (templates / ".tmp-x1y2").write_bytes(b"t" * 10)  # a write that was killed
    (templates / "elsewhere").symlink_to(tmp_path / "outside")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "keep").write_bytes(b"k")
    lent = root / "pycache-cpython-312"
    lent.mkdir(mode=0o777)
    lent.chmod(0o777)  # others may write it: not ours to empty
    (lent / "m.cpython-312.pyc").write_bytes(b"q")

    assert main(["cache", "stats", "--json", "--cache-dir", str(root)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["python_files"], stats["python_bytes"]) == (6, 300 + 200 + 40 + 10 + 1 + len(
        str(tmp_path / "outside")))
    assert stats["python_folders"] == ["pycache-cpython-311", "pycache-cpython-312",
                                       "templates-cpython-311"]
    assert main(["cache", "clear", "--verdicts", "--cache-dir", str(root)]) == 0
    capsys.readouterr()
    assert (templates / ".tmp-x1y2").exists()

    assert main(["cache", "clear", "--json", "--cache-dir", str(root)]) == 0
    captured = capsys.readouterr()
    cleared = json.loads(captured.out)
    assert cleared == {"removed": 1, "python_files": 5,
                       "python_bytes": 300 + 200 + 40 + 10 + len(str(tmp_path / "outside"))}
    assert f"left {lent}" in captured.err
    assert list(pyc.iterdir()) == [] and list(templates.iterdir()) == []
    assert (tmp_path / "outside" / "keep").read_bytes() == b"k"  # a link is not followed
    assert (lent / "m.cpython-312.pyc").exists()
    assert main(["cache", "stats", "--cache-dir", str(root)]) == 0
    assert "compiled Python: 1 bytes in 1 files (pycache-cpython-311, pycache-cpython-312, " \
        "templates-cpython-311; outside the size limit, removed by clear)" in \
        capsys.readouterr().out


@pytest.mark.parametrize("index", [
    msgpack.packb({"ab" * 32: "not a record"}),
    msgpack.packb({"ab" * 32: {"size": "big", "tier": 3}}),
    msgpack.packb([1, 2, 3]),
    b"\xc1 not msgpack at all",
])
def test_a_malformed_index_is_rebuilt_not_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], index: bytes) -> None:
    from hotswap.cache import ArtifactCache

    cache = ArtifactCache(tmp_path, stamp={"test": 1})
    cache.put("ab" * 32, b"x", tier="default")
    (tmp_path / "index.msgpack").write_bytes(index)
    for action in ("ls", "stats", "verify"):
        assert main(["cache", action, "--cache-dir", str(tmp_path)]) == 0, action
    out = capsys.readouterr()
    assert "1 entries" in out.out and "Traceback" not in out.err
    assert (tmp_path / "index.msgpack").read_bytes() == index  # read-only: left for the library
    reopened = ArtifactCache(tmp_path, stamp={"test": 1})
    reopened.put("cd" * 32, b"y", tier="default")  # the library rebuilds it, and counts that
    assert reopened.index_rebuilds == 1
    assert sorted(e.key for e in reopened.entries()) == ["ab" * 32, "cd" * 32]


def test_a_bad_key_file_is_a_message_not_a_traceback(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from hotswap.cache import ArtifactCache

    ArtifactCache(tmp_path, stamp={"test": 1}).put("ab" * 32, b"x")
    (tmp_path / "secret.key").write_bytes(b"short")
    for action in ("ls", "verify", "clear"):
        assert main(["cache", action, "--cache-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "not a hotswap cache key" in err and "Traceback" not in err
