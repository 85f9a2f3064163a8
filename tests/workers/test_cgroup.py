"""Workers in a cpu cgroup of their own where one can be made (system/cgroup.py), else lowered
as before: on fake cgroup trees for each kernel layout, and once on this machine's."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from hotswap.system import cgroup, proctree
from hotswap.system.cgroup import GROUP_PREFIX, CgroupFs
from hotswap.system.priority import WorkerPriority
from hotswap.workers import WorkerPool
from tests.workers.jobs import cpu_cgroup

J = "tests.workers.jobs:"
V1_MOUNT = "/sys/fs/cgroup/cpu"
V2_MOUNT = "/sys/fs/cgroup/unified"


@dataclass(frozen=True)
class FakeCgroupFs(CgroupFs):
    """What the kernel does on mkdir and rmdir in cgroupfs: a new group comes with its files
    (``knobs``), and goes with them."""

    knobs: tuple[str, ...] = ()

    def mkdir(self, parent_fd: int, name: str) -> None:
        super().mkdir(parent_fd, name)
        for knob in ("cgroup.procs", *self.knobs):
            fd = os.open(f"{name}/{knob}", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=parent_fd)
            os.close(fd)

    def rmdir(self, parent_fd: int, name: str) -> None:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
        try:
            for knob in os.listdir(fd):
                os.unlink(knob, dir_fd=fd)
        finally:
            os.close(fd)
        super().rmdir(parent_fd, name)

    def make(self, path: Path) -> None:
        """A group made by someone else (the test), at ``path``."""
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            self.mkdir(fd, path.name)
        finally:
            os.close(fd)


@dataclass(frozen=True)
class Unwritable(FakeCgroupFs):
    """A cgroupfs this user may not write to (root ignores file modes, so say it as the kernel
    would to another user)."""

    def mkdir(self, parent_fd: int, name: str) -> None:
        raise PermissionError(13, "Permission denied", name)


def fake_tree(root: Path, version: int, knobs: tuple[str, ...], *, own: str = "/",
              subtree_control: str = "cpu io memory") -> FakeCgroupFs:
    """/proc/self/cgroup, /proc/self/mountinfo and the process's own cgroup, as a kernel with
    the cpu controller on cgroup ``version`` would show them."""
    (root / "proc/self").mkdir(parents=True)
    mount = V1_MOUNT if version == 1 else V2_MOUNT
    lines = f"2:cpuacct:/\n1:cpu:{own}\n0::/\n" if version == 1 else f"0::{own}\n"
    (root / "proc/self/cgroup").write_text(lines)
    (root / "proc/self/mountinfo").write_text(
        "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
        "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
        if version == 1 else
        "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n")
    own_dir = root / mount.lstrip("/") / own.lstrip("/")
    own_dir.mkdir(parents=True)
    (own_dir / "cgroup.procs").write_text("")
    if version == 2:
        (own_dir / "cgroup.subtree_control").write_text(subtree_control + "\n")
    return FakeCgroupFs(str(root), knobs)


def group_dir(fs: CgroupFs, version: int, own: str = "/") -> Path:
    mount = V1_MOUNT if version == 1 else V2_MOUNT
    return Path(fs.path(mount)) / own.lstrip("/") / f"{GROUP_PREFIX}{os.getpid()}"


@pytest.mark.parametrize(("version", "knobs", "knob", "value", "note"), [
    (2, ("cpu.idle", "cpu.weight"), "cpu.idle", "1", "cgroup v2 cpu.idle"),
    (2, ("cpu.weight",), "cpu.weight", "1", "cgroup v2 cpu.weight=1"),  # before Linux 5.15
    (1, ("cpu.idle", "cpu.shares"), "cpu.idle", "1", "cgroup v1 cpu.idle"),
    (1, ("cpu.shares",), "cpu.shares", "2", "cgroup v1 cpu.shares=2"),
])
def test_a_group_is_made_set_filled_and_removed(tmp_path: Path, version: int,
                                                knobs: tuple[str, ...], knob: str, value: str,
                                                note: str) -> None:
    fs = fake_tree(tmp_path, version, knobs, own="/user/session")
    group = cgroup.acquire(fs)
    assert group is not None and group.note == note
    path = group_dir(fs, version, "/user/session")
    assert (path / knob).read_text() == value
    assert group.add(4321) and (path / "cgroup.procs").read_text() == "4321"
    assert group.leave(4321) and (path.parent / "cgroup.procs").read_text() == "4321"
    assert cgroup.acquire(fs) is group  # the process's pools share it
    cgroup.release(group)
    assert path.is_dir()  # one pool still uses it
    cgroup.release(group)
    assert not path.exists()


def test_priority_says_which_ran(tmp_path: Path) -> None:
    fs = fake_tree(tmp_path, 1, ("cpu.idle",))
    priority = WorkerPriority(19, True, fs)
    assert priority.lower_new(4321) == (19, False)  # the group is idle: no SCHED_IDLE inside
    assert priority.note == "cgroup v1 cpu.idle"
    assert (group_dir(fs, 1) / "cgroup.procs").read_text() == "4321"
    priority.forget(4321)
    priority.close()
    assert not group_dir(fs, 1).exists()
    assert priority.note == "cgroup v1 cpu.idle"  # what ran, after the pool


def test_in_a_group_of_low_weight_workers_stay_sched_idle(tmp_path: Path) -> None:
    fs = fake_tree(tmp_path, 2, ("cpu.weight",))
    priority = WorkerPriority(19, True, fs)
    assert priority.lower_new(4321) == (19, True)
    assert priority.note == "cgroup v2 cpu.weight=1 + SCHED_IDLE"
    priority.close()


def test_niceness_alone_is_no_reason_for_a_group(tmp_path: Path) -> None:
    fs = fake_tree(tmp_path, 1, ("cpu.idle",))
    priority = WorkerPriority(19, False, fs)
    assert priority.lower_new(4321) == (19, False)
    assert "cgroup" not in priority.note and not group_dir(fs, 1).exists()


@pytest.mark.parametrize("layout", ["no cpu in subtree_control", "read-only", "no cgroup mount",
                                    "v1 cpu not mounted", "no knob"])
def test_where_no_group_can_be_made_workers_lower_themselves(tmp_path: Path, layout: str) -> None:
    version = 1 if layout.startswith("v1") or layout == "read-only" else 2
    fs = fake_tree(tmp_path, version, () if layout == "no knob" else ("cpu.idle",),
                   subtree_control="io memory" if layout == "no cpu in subtree_control" else "cpu")
    mount = Path(fs.path(V1_MOUNT if version == 1 else V2_MOUNT))
    if layout == "read-only":
        fs = Unwritable(fs.root, fs.knobs)
    elif layout in ("no cgroup mount", "v1 cpu not mounted"):
        info = Path(fs.path("/proc/self/mountinfo"))
        info.write_text("".join(line + "\n" for line in info.read_text().splitlines()
                                if "cpu" not in line and (layout != "no cgroup mount"
                                                          or "cgroup2" not in line)))
    assert cgroup.acquire(fs) is None
    assert [p.name for p in mount.iterdir() if p.name.startswith(GROUP_PREFIX)] == []
    priority = WorkerPriority(19, True, fs)
    assert priority.lower_new(4321) == (19, True)
    assert "SCHED_IDLE" in priority.note and "cgroup" not in priority.note


def test_a_group_another_user_owns_is_not_used(tmp_path: Path) -> None:
    fs = fake_tree(tmp_path, 1, ("cpu.idle",))
    theirs = group_dir(fs, 1)
    fs.make(theirs)  # by another user before us, with our pid (another pid namespace's)
    for path in (theirs, *theirs.iterdir()):
        os.chown(path, 65534, 65534)
    assert cgroup.acquire(fs) is None
    assert theirs.is_dir() and (theirs / "cpu.idle").read_text() == ""  # untouched


def test_a_file_another_user_owns_is_not_written(tmp_path: Path) -> None:
    fs = fake_tree(tmp_path, 1, ("cpu.idle",))
    group = cgroup.acquire(fs)
    assert group is not None
    procs = group_dir(fs, 1) / "cgroup.procs"
    os.chown(procs, 65534, 65534)
    assert not group.add(4321) and procs.read_text() == ""
    cgroup.release(group)


@pytest.mark.parametrize("where", ["own cgroup", "group"])
def test_symlinks_are_not_followed(tmp_path: Path, where: str) -> None:
    fs = fake_tree(tmp_path, 2, ("cpu.idle",), own="/user")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "cgroup.subtree_control").write_text("cpu\n")
    (elsewhere / "cpu.idle").write_text("")
    (elsewhere / "cgroup.procs").write_text("")
    own = Path(fs.path(V2_MOUNT)) / "user"
    if where == "own cgroup":
        for child in own.iterdir():
            child.unlink()
        own.rmdir()
        own.symlink_to(elsewhere)
    else:
        group_dir(fs, 2, "/user").symlink_to(elsewhere)
    assert cgroup.acquire(fs) is None
    assert (elsewhere / "cpu.idle").read_text() == ""


def test_groups_of_dead_owners_are_removed(tmp_path: Path) -> None:
    fs = fake_tree(tmp_path, 1, ("cpu.idle",))
    parent = group_dir(fs, 1).parent
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for pid in (dead.pid, os.getppid()):  # a dead owner, and a live one
        fs.make(parent / f"{GROUP_PREFIX}{pid}")
    group = cgroup.acquire(fs)
    assert group is not None
    names = {p.name for p in parent.iterdir() if p.name.startswith(GROUP_PREFIX)}
    assert names == {f"{GROUP_PREFIX}{os.getppid()}", f"{GROUP_PREFIX}{os.getpid()}"}
    cgroup.release(group)


def _no_group_here() -> str:
    """Why this machine's pools would not get a cgroup ("" where they would)."""
    group = cgroup.acquire()
    if group is None:
        return "no cpu cgroup this process may make a child of (the workers lower themselves)"
    cgroup.release(group)
    return ""


def test_a_pools_workers_run_in_its_cgroup_until_shutdown() -> None:
    why = _no_group_here()
    if why:
        pytest.skip(why)
    name = f"{GROUP_PREFIX}{os.getpid()}"
    with WorkerPool(2, warm_modules=(), nice=19, idle=True) as pool:
        assert pool.wait_ready(60)
        pids = pool.worker_pids()
        for pid in pids:
            assert cpu_cgroup(pid).endswith("/" + name)
        assert pool.submit(J + "pid").result(timeout=60) in pids
        assert pool.priority_note().startswith("cgroup v")
        path = _group_path()
        assert os.path.isdir(path)
    assert not os.path.exists(path)
    assert pool.priority_note().startswith("cgroup v")


def _group_path() -> str:
    """The directory of this process's group, which a pool holds now."""
    group = cgroup.acquire()
    assert group is not None
    cgroup.release(group)
    return group.path


def test_a_starved_worker_leaves_the_group_while_raised() -> None:
    why = _no_group_here()
    if why:
        pytest.skip(why)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    priority = WorkerPriority(19, True)
    try:
        nice, idle = priority.lower_new(worker.pid)
        proctree.set_tree_priority(worker.pid, nice=nice, idle=idle)  # as a worker does
        lowered = cpu_cgroup(worker.pid), os.getpriority(os.PRIO_PROCESS, worker.pid), \
            os.sched_getscheduler(worker.pid)
        assert lowered[0].endswith(f"/{GROUP_PREFIX}{os.getpid()}") and lowered[1] == 19
        path = _group_path()
        assert priority.raise_tree(worker.pid)  # as root: the OS lets us
        assert cpu_cgroup(worker.pid) == cpu_cgroup(os.getpid())
        assert os.getpriority(os.PRIO_PROCESS, worker.pid) == 0
        assert os.sched_getscheduler(worker.pid) == os.SCHED_OTHER
        priority.lower_tree(worker.pid)
        assert (cpu_cgroup(worker.pid), os.getpriority(os.PRIO_PROCESS, worker.pid),
                os.sched_getscheduler(worker.pid)) == lowered
    finally:
        worker.kill()
        worker.wait()
        priority.forget(worker.pid)
        priority.close()
    assert not os.path.exists(path)


@pytest.mark.parametrize(("version", "files", "expected"), [
    (2, {"cpu.max": "400000 100000\n"}, 4.0),
    (2, {"cpu.max": "max 100000\n"}, None),
    (1, {"cpu.cfs_quota_us": "250000\n", "cpu.cfs_period_us": "100000\n"}, 2.5),
    (1, {"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"}, None),
    (2, {}, None),  # no cpu.max: the controller is not on for this group
])
def test_the_quota_of_the_processs_own_group_in_cores(
        tmp_path: Path, version: int, files: dict[str, str], expected: float | None) -> None:
    fs = fake_tree(tmp_path, version, (), own="/pod")
    own_dir = Path(fs.path(V1_MOUNT if version == 1 else V2_MOUNT)) / "pod"
    for name, text in files.items():
        (own_dir / name).write_text(text)
    assert cgroup.quota_cores(fs) == expected
