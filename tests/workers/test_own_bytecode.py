"""hotswap's own modules read from its bytecode cache where Python would compile them at every
start (hotswap/system/own_bytecode.py). Each case starts a process importing a copy of
hotswap's sources that has no bytecode beside it, as a checkout or an environment installed
without compiling does."""

from __future__ import annotations

import compileall
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import hotswap
from hotswap.cache.root import claim_root
from hotswap.cache.store import FORMAT_VERSION
from hotswap.system.own_bytecode import bytecode_path
from tests.workers.test_bytecode import OPEN_TO_OTHERS, open_to_others

CODE = """
import json, sys
import hotswap, hotswap.counting
from hotswap.system import own_bytecode
loader = type(sys.modules["hotswap.workers.pool"].__loader__).__name__
print(json.dumps({"counts": own_bytecode.counts(), "folder": str(own_bytecode.install()),
                  "file": hotswap.__file__, "loader": loader,
                  "changed": getattr(hotswap.counting, "CHANGED", None),
                  "doc": hotswap.counting.__doc__ is not None}))
"""


@pytest.fixture
def package(tmp_path: Path) -> Path:
    """hotswap's sources, copied without any bytecode beside them."""
    shutil.copytree(Path(hotswap.__file__).parent, tmp_path / "src" / "hotswap",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "src"


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def start(package: Path, cache: Path, *flags: str, code: str = CODE, **env: str) -> dict:
    """A process importing ``package``'s hotswap (``code``, given the cache as its argument):
    what it printed, by default what it read, compiled and wrote."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPYCACHEPREFIX", "HOTSWAP_PYCACHE", "PYTHONDONTWRITEBYTECODE")}
    full = {**base, "PYTHONPATH": str(package), "HOTSWAP_CACHE_DIR": str(cache),
            "PYTHONDONTWRITEBYTECODE": "1", **env}
    full = {k: v for k, v in full.items() if v}
    done = subprocess.run([sys.executable, *flags, "-c", code, str(cache)], env=full, cwd=package,
                          capture_output=True, text=True, timeout=120, check=True)
    found = json.loads(done.stdout)
    assert code != CODE or found["file"] == str(package / "hotswap" / "__init__.py")
    return found


def folder_of(cache: Path) -> Path:
    return cache / f"pycache-{sys.implementation.cache_tag}"


def make_cache(cache: Path) -> None:
    """The artifact cache, as hotswap's first compile makes it."""
    claim_root(cache, FORMAT_VERSION)


def test_a_process_writes_hotswaps_bytecode_into_its_cache_and_the_next_reads_all_of_it(
        package: Path, cache: Path) -> None:
    first = start(package, cache)
    assert first["counts"]["written"] == 0 and not cache.exists()  # importing makes no cache
    make_cache(cache)
    second = start(package, cache)
    folder = folder_of(cache)
    assert second["folder"] == str(folder.resolve()) and second["loader"] == "_Loader"
    counts = second["counts"]
    assert counts["read"] == 0 and counts["compiled"] > 10
    assert counts["written"] >= counts["compiled"] - 5  # those imported while making the folder
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    pool = package / "hotswap" / "workers" / "pool.py"
    assert bytecode_path(pool, str(folder)).is_file()  # mirrored, as PYTHONPYCACHEPREFIX does
    assert not (pool.parent / "__pycache__").exists()  # nothing beside the sources
    start(package, cache)  # writes what the second left out while it made the folder
    again = start(package, cache)["counts"]
    assert again["compiled"] == again["written"] == 0
    assert again["read"] >= counts["compiled"] - 1  # the store, which making the folder imported


def test_optimized_processes_keep_bytecode_of_their_own(package: Path, cache: Path) -> None:
    make_cache(cache)
    optimized = start(package, cache, "-OO")
    assert optimized["counts"]["written"] > 10 and not optimized["doc"]
    plain = start(package, cache)
    assert plain["counts"]["read"] == 0 and plain["doc"]  # none of -OO's served here
    again = start(package, cache, "-OO")
    assert again["counts"]["compiled"] == 0 and not again["doc"]


@pytest.mark.parametrize("damage", ["source changed", "bytecode cut short", "bytecode garbled"])
def test_bytecode_that_no_longer_fits_its_source_is_compiled_again_and_rewritten(
        damage: str, package: Path, cache: Path) -> None:
    make_cache(cache)
    start(package, cache)
    start(package, cache)
    source = package / "hotswap" / "counting.py"
    pyc = bytecode_path(source, str(folder_of(cache).resolve()))
    if damage == "source changed":
        source.write_text(source.read_text() + "\nCHANGED = 1\n")
    elif damage == "bytecode cut short":
        pyc.write_bytes(pyc.read_bytes()[:40])
    else:  # its header still fits the source
        pyc.write_bytes(pyc.read_bytes()[:16] + b"\x00garbage" * 8)
    after = start(package, cache)
    assert after["counts"]["compiled"] == 1 and after["counts"]["written"] == 1
    assert after["changed"] == (1 if damage == "source changed" else None)
    assert start(package, cache)["counts"]["compiled"] == 0


@pytest.mark.parametrize("problem", OPEN_TO_OTHERS)
def test_a_folder_another_user_could_write_is_neither_read_nor_written(
        problem: str, package: Path, cache: Path) -> None:
    make_cache(cache)
    start(package, cache)
    folder = folder_of(cache)
    open_to_others(folder, problem)
    before = sorted(folder.rglob("*"))
    found = start(package, cache)
    assert found["counts"] == {"read": 0, "compiled": 0, "written": 0}
    assert found["folder"] == "None" and found["loader"] == "SourceFileLoader"
    assert sorted(folder.rglob("*")) == before


@pytest.mark.parametrize("case", ["writes bytecode", "own prefix", "off", "bytecode beside"])
def test_python_is_left_alone_where_the_cache_would_change_more_than_speed(
        case: str, package: Path, cache: Path, tmp_path: Path) -> None:
    env = {"writes bytecode": {"PYTHONDONTWRITEBYTECODE": ""},
           "own prefix": {"PYTHONPYCACHEPREFIX": str(tmp_path / "theirs")},
           "off": {"HOTSWAP_PYCACHE": "off"}}.get(case, {})
    make_cache(cache)
    if case == "bytecode beside":
        assert compileall.compile_dir(str(package), quiet=1)
    found = start(package, cache, **env)
    assert found["counts"] == {"read": 0, "compiled": 0, "written": 0}
    assert found["folder"] == "None"
    assert not folder_of(cache).exists()


REMOVED = """
import json, shutil, sys
import hotswap
from hotswap.system import own_bytecode
before = own_bytecode.counts()
shutil.rmtree(sys.argv[1])
import hotswap.cli
print(json.dumps({"before": before, "after": own_bytecode.counts()}))
"""


def test_a_cache_removed_meanwhile_is_not_made_again_by_an_import(
        package: Path, cache: Path) -> None:
    make_cache(cache)
    start(package, cache)
    found = start(package, cache, code=REMOVED)
    assert found["before"]["read"] > 10
    assert found["after"]["compiled"] > found["before"]["compiled"]  # the command line's modules
    assert found["after"]["written"] == found["before"]["written"]
    assert not cache.exists()  # its modes would be the umask's, its marker gone
