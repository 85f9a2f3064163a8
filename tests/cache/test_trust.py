"""Nobody else's bytes run as hotswap's code: a cache folder, key, lock or entry that another
user could have written is not used, links inside the cache are never followed, and nothing
outside the cache is written or removed.

The attacker is another uid (a child process that drops to ``ATTACKER``); the tests need root
to make one, as CI has."""

from __future__ import annotations

import os
import pickle
import shutil
import stat
import subprocess
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hotswap
from hotswap.cache import ArtifactCache
from hotswap.cache.store import seal
from hotswap.cache.trust import UntrustedPath
from hotswap.engine.loading.artifacts import pack_entry
from hotswap.engine.shipping.keys import environment_stamp
from hotswap.engine.sources.cache_access import CacheAccess

ATTACKER = 4242
KEY = "ab" * 32

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")


def attack(fn: Callable[[], None]) -> None:
    """Run ``fn`` in a forked child that has become uid/gid ``ATTACKER`` (it may only do
    what that user could: no privilege is left once it calls ``setuid``)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            os.setgroups([])
            os.setgid(ATTACKER)
            os.setuid(ATTACKER)
            fn()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the attacker's own steps failed"


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder every user may write, sticky like /tmp (pytest's own tmp_path is private)."""
    path = Path(tempfile.mkdtemp(prefix="hotswap-shared-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def tree(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every path under ``root``: (owner, mode, contents of files) — to see that nothing
    changed."""
    found = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        data = path.read_bytes() if stat.S_ISREG(st.st_mode) else b""
        found[str(path.relative_to(root))] = (st.st_uid, st.st_mode, data)
    return found


class _Boom:
    """Leaves a mark when unpickled: what an attacker signs into an entry's probes."""

    def __init__(self, mark: Path) -> None:
        self.mark = str(mark)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.mark}",))


def plant_resigned_cache(root: Path, mark: Path) -> None:
    """As the attacker: make ``root`` a cache of their own (marker, their key) holding a
    valid entry under ``KEY`` that they signed, whose probes run code when unpickled (the
    format before probes were plain values)."""

    def plant() -> None:
        (root / "entries" / KEY[:2]).mkdir(parents=True)
        (root / "HOTSWAP_CACHE").write_text("hotswap artifact cache")
        secret = b"k" * 32
        (root / "secret.key").write_bytes(secret)
        (root / "secret.key").chmod(0o600)
        payload = pack_entry(b"artifact", {}, {"vec_isa": pickle.dumps(_Boom(mark))})
        head, mac = seal(secret, KEY, payload, tier="default", origin="",
                         stamp=environment_stamp())
        (root / "entries" / KEY[:2] / f"{KEY}.hsa").write_bytes(head + payload + mac)

    attack(plant)


@pytest.fixture
def foreign_cache(shared: Path) -> Iterator[Path]:
    """A cache another user made first in a shared folder, holding an entry they signed whose
    probes would leave ``shared/ran`` when unpickled; the test must leave it as it was."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another uid")
    root, mark = shared / "cache", shared / "ran"
    plant_resigned_cache(root, mark)
    before = tree(root)
    yield root
    assert tree(root) == before and not mark.exists()


def test_a_cache_folder_another_user_made_is_refused_before_anything_is_read(
        foreign_cache: Path) -> None:
    with pytest.raises(UntrustedPath, match=f"belongs to uid {ATTACKER}"):
        ArtifactCache(foreign_cache, stamp=environment_stamp())
    with pytest.raises(UntrustedPath, match=f"belongs to uid {ATTACKER}"):
        ArtifactCache(foreign_cache, read_only=True)


def test_a_model_compiles_beside_a_foreign_cache_and_writes_nothing_into_it(
        foreign_cache: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
    x = torch.randn(4, 8)
    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(model, mode="subprocess", workers=1,
                                   cache_dir=str(foreign_cache))
        torch.testing.assert_close(compiled(x), model(x))
    [status] = hotswap.status(compiled)
    assert status.tier == "default" and status.path == "worker"
    assert f"belongs to uid {ATTACKER}" in status.cache and "HOTSWAP_CACHE_DIR" in status.cache
    assert d["worker_compiles"] == 1 and d["cache_hits"] == 0


@pytest.mark.parametrize("mode", [0o770, 0o757, 0o777])
def test_a_cache_folder_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "cache"
    ArtifactCache(root, stamp={"t": 1}).put(KEY, b"x")
    root.chmod(mode)
    before = tree(root)
    with pytest.raises(UntrustedPath, match="chmod go-w"):
        ArtifactCache(root, stamp={"t": 1})
    assert tree(root) == before


def test_a_folder_above_the_cache_that_others_may_write_without_the_sticky_bit_is_refused(
        tmp_path: Path) -> None:
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(UntrustedPath, match="without the sticky bit"):
        ArtifactCache(open_to_all / "cache", stamp={"t": 1})
    open_to_all.chmod(0o1777)  # sticky, like /tmp: only the owner may rename the cache away
    ArtifactCache(open_to_all / "cache", stamp={"t": 1}).put(KEY, b"x")


def test_folders_made_on_the_way_to_a_new_cache_are_private_whatever_the_umask(
        tmp_path: Path) -> None:
    old = os.umask(0o002)  # user-private groups: mkdir(parents=True) would make them 0775
    try:
        cache = ArtifactCache(tmp_path / "a" / "b" / "cache", stamp={"t": 1})
        cache.put(KEY, b"x")
    finally:
        os.umask(old)
    for folder in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "cache"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


@as_root
@pytest.mark.parametrize("how", ["foreign owner", "readable by others", "a link"])
def test_a_key_that_is_not_ours_alone_is_refused(tmp_path: Path, how: str) -> None:
    root = tmp_path / "cache"
    ArtifactCache(root, stamp={"t": 1}).put(KEY, b"x")
    key = root / "secret.key"
    if how == "foreign owner":
        os.chown(key, ATTACKER, ATTACKER)
    elif how == "readable by others":
        key.chmod(0o644)
    else:
        elsewhere = tmp_path / "elsewhere.key"
        elsewhere.write_bytes(key.read_bytes())
        elsewhere.chmod(0o600)
        key.unlink()
        key.symlink_to(elsewhere)
    with pytest.raises(UntrustedPath, match=r"secret\.key"):
        ArtifactCache(root, stamp={"t": 1})


def test_a_cache_reached_through_a_link_of_ours_is_used(tmp_path: Path) -> None:
    """~/.cache may point to another disk: a link to the root itself is followed."""
    real = tmp_path / "disk" / "hotswap"
    ArtifactCache(real, stamp={"t": 1}).put(KEY, b"x")
    (tmp_path / "link").symlink_to(real)
    assert ArtifactCache(tmp_path / "link", stamp={"t": 1}).get(KEY) == b"x"


@pytest.mark.parametrize("linked", ["locks", "owner"])
def test_lock_files_that_are_links_are_never_written_through(tmp_path: Path,
                                                             linked: str) -> None:
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    victim = victim_dir / f"{KEY}.owner"
    victim.write_text("precious")
    access = CacheAccess(str(tmp_path / "cache"), None)
    access.keys(torch.fx.symbolic_trace(torch.nn.ReLU()), (), False, [])  # opens the cache
    locks = tmp_path / "cache" / "locks"
    if linked == "locks":
        locks.symlink_to(victim_dir)
    else:
        locks.mkdir()
        (locks / f"{KEY}.owner").symlink_to(victim)
    assert access.claim(KEY)  # compiles all the same (unclaimed, or claimed without an owner)
    access.release(KEY)
    assert victim.read_text() == "precious" and sorted(os.listdir(victim_dir)) == [victim.name]


def test_links_inside_the_cache_are_refused_not_followed(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache", stamp={"t": 1})
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / f"{KEY}.hsa").write_bytes(b"not ours")
    (tmp_path / "cache" / "entries" / KEY[:2]).symlink_to(outside)
    with pytest.raises(UntrustedPath, match="symlink"):
        cache.get(KEY)
    with pytest.raises(UntrustedPath, match="symlink"):
        cache.put(KEY, b"x")
    assert cache.clear() == 0 and (outside / f"{KEY}.hsa").read_bytes() == b"not ours"


@as_root
def test_another_users_scratch_folder_in_a_shared_tmp_is_not_removed() -> None:
    """Workers' scratch folders of dead pools are swept from the temporary folder; one that
    another user owns, named like ours, is theirs."""
    from hotswap.workers import scratch

    pid = _dead_pid()
    theirs = Path(tempfile.mkdtemp(prefix=f"hotswap-w{pid}-0-"))
    mine = Path(tempfile.mkdtemp(prefix=f"hotswap-w{pid}-1-"))
    os.chown(theirs, ATTACKER, ATTACKER)
    try:
        scratch.sweep()
        assert theirs.is_dir() and not mine.exists()
    finally:
        shutil.rmtree(theirs, ignore_errors=True)
        shutil.rmtree(mine, ignore_errors=True)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_link_on_the_way_to_the_cache_counts_as_a_folder_above_it(tmp_path: Path) -> None:
    """``open/link/cache`` where ``open`` is writable by all without the sticky bit: anyone
    could point ``link`` elsewhere, so the cache is refused; reached through a link in a
    folder of ours, it is used by its real path (a later change of the link changes
    nothing)."""
    mine = tmp_path / "mine" / "real"
    mine.mkdir(parents=True)
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    (open_to_all / "link").symlink_to(mine)
    with pytest.raises(UntrustedPath, match="without the sticky bit"):
        ArtifactCache(open_to_all / "link" / "cache", stamp={"t": 1})
    assert not (mine / "cache").exists()
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "link").symlink_to(mine)
    cache = ArtifactCache(tmp_path / "ours" / "link" / "cache", stamp={"t": 1})
    assert cache.root == mine / "cache"
