"""hotswap's bytecode cache for the processes it starts (hotswap/system/bytecode.py): which
environments get it, which folders are refused, and a real worker writing bytecode there."""

from __future__ import annotations

import contextlib
import logging
import os
import py_compile
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hotswap import WorkerPool
from hotswap.system import bytecode

NO_WRITE = "PYTHONDONTWRITEBYTECODE"
PREFIX = "PYTHONPYCACHEPREFIX"


@pytest.fixture
def sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """A torch installed without bytecode: the modules probed, and no __pycache__ beside them."""
    found = [tmp_path / "torch" / "__init__.py", tmp_path / "torch" / "_inductor" / "compile_fx.py"]
    for path in found:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("X = 1\n")
    monkeypatch.setattr(bytecode, "probe_sources", lambda: found)
    monkeypatch.delenv("HOTSWAP_PYCACHE", raising=False)
    return found


def test_auto_gives_a_process_that_would_recompile_at_every_start_the_cache(
        sources: list[Path]) -> None:
    env = {"PATH": "/bin", NO_WRITE: "1"}
    child = bytecode.child_env(env)
    folder = bytecode.cache_folder()
    assert folder is not None and folder.name == f"pycache-{sys.implementation.cache_tag}"
    assert child == {"PATH": "/bin", PREFIX: str(folder)}
    assert env == {"PATH": "/bin", NO_WRITE: "1"}  # the caller's own is left alone
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert (folder.parent / "HOTSWAP_CACHE").is_file()  # the artifact cache it sits in


@pytest.mark.parametrize("case", ["writable", "bytecode beside", "own prefix", "off"])
def test_auto_leaves_alone_what_needs_no_cache_and_off_leaves_everything(
        case: str, sources: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"PATH": "/bin", NO_WRITE: "1"}
    if case == "writable":
        del env[NO_WRITE]  # the first start writes __pycache__, the next ones read it
    elif case == "bytecode beside":
        for path in sources:
            py_compile.compile(str(path), doraise=True)
    elif case == "own prefix":
        env[PREFIX] = "/somewhere/of/theirs"
    else:
        monkeypatch.setenv("HOTSWAP_PYCACHE", "off")
    assert bytecode.child_env(env) is env
    plan = bytecode.plan(env)
    assert plan.folder is None
    assert (plan.recompiles is None) == (case in ("writable", "bytecode beside"))
    assert plan.note is not None and plan.note.startswith(
        "not used" if case in ("own prefix", "off") else "not needed")


def test_on_gives_the_cache_even_where_bytecode_works(
        sources: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSWAP_PYCACHE", "on")
    assert bytecode.child_env({})[PREFIX] == str(bytecode.cache_folder())


def test_the_compile_services_workers_keep_the_cache_it_was_started_with(
        sources: list[Path]) -> None:
    service = bytecode.child_env({NO_WRITE: "1"})  # what control.py starts the service with
    assert NO_WRITE not in service
    assert bytecode.child_env(dict(service)) == service  # what its pool gives its workers


def test_the_reason_names_what_makes_every_start_recompile(sources: list[Path]) -> None:
    reason = bytecode.recompile_reason({NO_WRITE: "1"})
    assert reason is not None and NO_WRITE in reason and "beside them" in reason
    assert bytecode.recompile_reason({}) is None


OPEN_TO_OTHERS = ["another uid", "group-writable", "world-writable"]


def open_to_others(folder: Path, problem: str) -> None:
    """Gives ``folder`` to uid 65534 (root only: skipped otherwise), or opens it to writes."""
    if problem == "another uid":
        if os.geteuid() != 0:
            pytest.skip("giving a folder away takes root")
        os.chown(folder, 65534, 65534)
    else:
        folder.chmod(0o770 if problem == "group-writable" else 0o707)


@pytest.mark.parametrize("problem", OPEN_TO_OTHERS)
def test_a_folder_another_user_could_write_is_refused_with_one_note(
        problem: str, sources: list[Path], caplog: pytest.LogCaptureFixture) -> None:
    folder = bytecode.cache_folder()
    assert folder is not None
    assert bytecode.child_env({NO_WRITE: "1"})[PREFIX] == str(folder)  # made, and ours
    open_to_others(folder, problem)
    env = {NO_WRITE: "1"}
    with caplog.at_level(logging.WARNING, logger="hotswap"):
        assert bytecode.child_env(env) is env
        assert bytecode.child_env(env) is env
    plan = bytecode.plan(env)
    assert plan.folder is None and plan.note is not None and str(folder) in plan.note
    assert ("belongs to uid 65534" if problem == "another uid" else "open to other users") \
        in plan.note
    notes = [r for r in caplog.records if "bytecode cache is not used" in r.getMessage()]
    assert len(notes) == 1


def test_a_malformed_setting_is_a_note_here_and_an_error_at_compile(
        sources: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from hotswap import settings

    monkeypatch.setenv("HOTSWAP_PYCACHE", "sometimes")
    env = {NO_WRITE: "1"}
    assert bytecode.child_env(env) is env
    with pytest.raises(ValueError, match="HOTSWAP_PYCACHE must be"):
        settings.check_all()


def test_a_worker_started_without_bytecode_writes_it_into_the_cache(
        sources: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NO_WRITE, "1")
    with WorkerPool(1, warm_modules=()) as pool:
        assert pool.submit("hotswap.testing.faults:echo", 7, timeout_s=60).result() == 7
    folder = bytecode.cache_folder()
    assert folder is not None
    job = Path(bytecode.__file__).resolve().parents[1] / "testing" / "faults.py"
    mirrored = folder / str(job.parent).lstrip(os.sep) / f"faults.{sys.implementation.cache_tag}.pyc"
    assert mirrored.is_file()  # the job's module, compiled by the worker
    files, size = bytecode.usage(folder)
    assert files > 20 and size > 0  # the worker's other imports too


def test_a_process_that_writes_no_bytecode_reads_the_cache_for_its_later_imports(
        sources: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NO_WRITE, "1")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    with bytecode.read_for_imports() as folder:
        assert folder == bytecode.cache_folder() and sys.pycache_prefix == str(folder)
    assert sys.pycache_prefix is None  # the block's imports alone: __pycache__ counts again


def test_blocks_on_two_threads_keep_the_prefix_until_the_last_one_ends(
        sources: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # The warm-up's imports and triton's, side by side: the first one out must not take the
    # prefix from under the other's imports.
    monkeypatch.setenv(NO_WRITE, "1")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    inside, leave = threading.Event(), threading.Event()
    seen: list[str | None] = []

    def other() -> None:
        with bytecode.read_for_imports():
            inside.set()
            leave.wait(30)
            seen.append(sys.pycache_prefix)

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(30)
    with bytecode.read_for_imports() as folder:
        assert sys.pycache_prefix == str(folder)
    assert sys.pycache_prefix == str(folder)  # the other block is still inside
    leave.set()
    thread.join(30)
    assert seen == [str(folder)] and sys.pycache_prefix is None


@pytest.mark.parametrize("case", ["writes bytecode", "own prefix", "bytecode beside", "off"])
def test_a_process_is_left_alone_where_reading_the_cache_would_change_more_than_speed(
        case: str, sources: list[Path], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    monkeypatch.setenv(NO_WRITE, "1")
    monkeypatch.setattr(sys, "dont_write_bytecode", case != "writes bytecode")
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path) if case == "own prefix" else None)
    if case == "bytecode beside":
        for source in sources:
            py_compile.compile(str(source), cfile=str(bytecode.bytecode_path(source, None)))
    if case == "off":
        monkeypatch.setenv("HOTSWAP_PYCACHE", "off")
    before = sys.pycache_prefix
    with bytecode.read_for_imports() as folder:
        assert folder is None and sys.pycache_prefix == before


def test_a_child_compiles_what_this_process_is_about_to_import_into_the_cache(
        sources: list[Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The first process ever: nothing in the cache yet, so a child imports the modules first
    # and writes their bytecode there; this process then reads it (and writes nothing).
    (tmp_path / "hs_about_to_import.py").write_text("VALUE = 42\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv(NO_WRITE, "1")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    with bytecode.read_for_imports(["hs_about_to_import"]) as folder:
        assert folder is not None
    assert list(folder.rglob("hs_about_to_import.*.pyc"))
    assert not list(tmp_path.rglob("__pycache__"))


@pytest.fixture
def served(sources: list[Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A process that writes no bytecode and has none in its own cache yet, beside a compile
    service's folder holding the probed modules' bytecode (offered, as its status does)."""
    monkeypatch.setenv(NO_WRITE, "1")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    folder = tmp_path / "service-pycache"
    folder.mkdir(mode=0o700)
    for source in sources:
        py_compile.compile(str(source), cfile=str(bytecode.bytecode_path(source, str(folder))))
    monkeypatch.setattr(bytecode, "_offered", [])
    bytecode.offer(folder)
    return folder


def test_the_compile_services_bytecode_serves_where_this_process_has_none(
        served: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    children: list[object] = []
    monkeypatch.setattr(bytecode, "_compile_in_a_child", children.append)
    with bytecode.read_for_imports(["json"]) as folder:
        assert folder == served and sys.pycache_prefix == str(served)
    assert children == [] and sys.pycache_prefix is None


@pytest.mark.parametrize("written", ["meanwhile", "never"])
def test_a_compile_services_folder_still_being_written_is_read_once_written_through(
        written: str, served: Path, sources: list[Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The service's workers write compile_fx's bytecode before that of the modules it
    imports: the folder is read once inductor's largest ones are there too (this process
    would compile them from source), waited for while they appear; where they stop
    appearing, a child writes this process's own."""
    ir = sources[1].parent / "ir.py"
    ir.write_text("Y = 2\n")
    monkeypatch.setattr(bytecode, "SERVED_STALL_S", 1.0)
    children: list[object] = []
    monkeypatch.setattr(bytecode, "_compile_in_a_child", children.append)
    writer = threading.Timer(0.3, py_compile.compile, args=(str(ir),), kwargs={
        "cfile": str(bytecode.bytecode_path(ir, str(served)))})
    if written == "meanwhile":
        writer.start()
    start = time.monotonic()
    with bytecode.read_for_imports(["json"]) as folder:
        waited = time.monotonic() - start
        if written == "meanwhile":
            assert folder == served and waited >= 0.3
        else:
            assert folder == bytecode.cache_folder() and waited >= 1.0
    assert children == ([] if written == "meanwhile" else [["json"]])


def test_this_processs_own_folder_still_being_written_by_its_workers_is_waited_for(
        sources: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Its workers write the same folder (and so does the compile service it starts, with its
    environment): compile_fx's bytecode is there before ir.py's. The load path reads the
    folder once ir.py's is there too, instead of compiling ir.py (351 KB) from source beside
    the user's calls."""
    monkeypatch.setenv(NO_WRITE, "1")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(bytecode, "_offered", [])
    own = bytecode.plan(dict(os.environ)).folder
    assert own is not None
    for source in sources:
        py_compile.compile(str(source), cfile=str(bytecode.bytecode_path(source, str(own))))
    ir = sources[1].parent / "ir.py"
    ir.write_text("Y = 2\n")
    children: list[object] = []
    monkeypatch.setattr(bytecode, "_compile_in_a_child", children.append)
    writer = threading.Timer(0.3, py_compile.compile, args=(str(ir),), kwargs={
        "cfile": str(bytecode.bytecode_path(ir, str(own)))})
    writer.start()
    start = time.monotonic()
    with bytecode.read_for_imports(["json"]) as folder:
        assert folder == own and time.monotonic() - start >= 0.3
    assert children == []


@pytest.mark.parametrize("attack", [
    "others may write it",
    pytest.param("another uid's", marks=pytest.mark.skipif(
        os.geteuid() != 0, reason="giving a folder to another uid needs root"))])
def test_an_offered_folder_that_fails_the_checks_is_not_read(
        attack: str, served: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    if attack == "others may write it":
        served.chmod(0o777)
    else:
        os.chown(served, 4242, 4242)
    children: list[object] = []
    monkeypatch.setattr(bytecode, "_compile_in_a_child", children.append)
    with caplog.at_level(logging.WARNING, logger="hotswap"), \
            bytecode.read_for_imports(["json"]) as folder:
        assert folder == bytecode.cache_folder()  # its own, filled by a child as before
    assert children == [["json"]]
    assert "not read from the compile service" in caplog.text and str(served) in caplog.text


@pytest.fixture
def package(tmp_path: Path) -> Path:
    """A package a compile would import: modules, a test folder, and a file that cannot compile."""
    root = tmp_path / "pkg"
    for name in ("a.py", "sub/b.py", "tests/t.py", "broken.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("def (:\n" if name == "broken.py" else "Y = 2\n")
    return root


def test_a_many_core_machines_first_child_starts_a_filler_of_what_workers_import(
        sources: list[Path], package: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bytecode, "MIN_CPUS", 1)
    monkeypatch.setattr(bytecode, "filler", None)
    monkeypatch.setattr(bytecode, "fill_list", lambda: [*map(str, sources), str(package)])
    bytecode.child_env({NO_WRITE: "1"})
    started, folder = bytecode.filler, bytecode.cache_folder()
    assert started is not None and folder is not None
    assert started.wait(timeout=120) == 0
    for source in [*sources, package / "a.py", package / "sub" / "b.py"]:
        assert bytecode.current(source, bytecode.bytecode_path(source, str(folder)))
    for left in (package / "tests" / "t.py", package / "broken.py"):
        assert not bytecode.bytecode_path(left, str(folder)).exists()
    bytecode.child_env({NO_WRITE: "1"})
    assert bytecode.filler is started  # one per process


def test_what_a_filler_writes_serves_a_plain_process_unoptimized(
        package: Path, tmp_path: Path) -> None:
    """Python reads the filler's bytecode (no recompile: its file is not written again), and
    a filler under PYTHONOPTIMIZE still writes what a plain process may run (asserts kept)."""
    (package / "a.py").write_text("assert False, 'kept'\n")
    folder = tmp_path / "pyc"
    folder.mkdir(mode=0o700)
    env = {**os.environ, "PYTHONOPTIMIZE": "2", PREFIX: str(folder)}
    subprocess.run([sys.executable, "-m", "hotswap.system.bytecode_fill", str(folder)],
                   input=str(package).encode(), env=env, check=True, timeout=120)
    pyc = bytecode.bytecode_path(package / "a.py", str(folder))
    written = pyc.stat().st_mtime_ns
    plain = {k: v for k, v in os.environ.items() if k != "PYTHONOPTIMIZE"}
    done = subprocess.run([sys.executable, "-c", "import a"], cwd=package, capture_output=True,
                          text=True, env={**plain, PREFIX: str(folder), "PYTHONPATH": str(package)})
    assert "AssertionError: kept" in done.stderr
    assert pyc.stat().st_mtime_ns == written


@pytest.mark.parametrize("case", ["few cores", "filled already"])
def test_no_filler_where_cores_are_few_or_the_folder_has_torchs_bytecode(
        case: str, sources: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bytecode, "filler", None)
    from hotswap.system.bytecode_fill import cores

    monkeypatch.setattr(bytecode, "MIN_CPUS", cores() + 1 if case == "few cores" else 1)
    if case == "filled already":
        folder = bytecode.cache_folder()
        assert folder is not None
        bytecode.claim_folder(folder)
        for source in sources:
            py_compile.compile(str(source), cfile=str(bytecode.bytecode_path(source, str(folder))))
    assert PREFIX in bytecode.child_env({NO_WRITE: "1"})  # the cache is used all the same
    assert bytecode.filler is None


@pytest.mark.parametrize("case", ["held", "gone", "open to others"])
def test_a_filler_leaves_a_folder_another_holds_or_that_is_no_longer_ours(
        case: str, sources: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    import filelock

    from hotswap.system import bytecode_fill

    folder = bytecode.claim_folder(bytecode.cache_folder() or tmp_path)
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(map(str, sources))))
    monkeypatch.setattr(bytecode_fill, "lower_priority", lambda nice, idle: None)
    with filelock.FileLock(folder / bytecode_fill.LOCK_NAME) if case == "held" \
            else contextlib.nullcontext():
        if case == "gone":
            folder.rmdir()
        elif case == "open to others":
            folder.chmod(0o777)
        assert bytecode_fill.main([str(folder)]) == 0
    assert not any(bytecode.bytecode_path(s, str(folder)).exists() for s in sources)
    assert folder.exists() == (case != "gone")  # not made again


def test_a_filler_runs_at_the_lowest_priority(tmp_path: Path) -> None:
    from hotswap.system import bytecode_fill

    code = ("import os, sys, hotswap.system.bytecode_fill as f; f.main([sys.argv[1]]); "
            "print(os.sched_getscheduler(0) == os.SCHED_IDLE, os.getpriority(os.PRIO_PROCESS, 0))")
    folder = tmp_path / "pyc"
    folder.mkdir(mode=0o700)
    done = subprocess.run([sys.executable, "-c", code, str(folder)], input="", text=True,
                          capture_output=True, check=True, timeout=60)
    assert done.stdout.split() == ["True", "19"]
    assert bytecode_fill.cores() >= 1
