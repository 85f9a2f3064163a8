"""A cpu cgroup for the compile workers, where this process may make one.

    acquire()        -> WorkerGroup | None   ``hotswap-workers-<this pid>``, a child of this
                                             process's cgroup: one per process, shared by
                                             its pools
    WorkerGroup.add(pid)                     a worker (all its threads) into the group
    WorkerGroup.leave(pid)                   back into the caller's own cgroup: a starved
                                             worker raised to the caller's priority
    release(group)                           the last pool out removes the group

Why a group: a worker leads a session of its own (workers/process.py), and with autogroup
scheduling the CPU is shared between sessions before niceness or ``SCHED_IDLE`` count inside
one. On Linux 6.18 a ``SCHED_IDLE`` process in its own session of niceness 19 still got 0.5 s
of CPU in 0.68 s beside two busy processes of another session (tests/workers/
test_starvation.py): across sessions it competed with the caller as an equal. A cgroup with
``cpu.idle=1`` is idle as a whole: whatever else runs beside it on a core is served first
(scripts/priority_check.py measures the caller's lateness both ways).

Where (what the kernel allows; everything else falls back to priority.lower_priority):

- cgroup v1: the hierarchy the ``cpu`` controller is mounted on (alone or with ``cpuacct``),
  a child of this process's cgroup in it. v1 lets a cgroup hold processes and children alike.
- cgroup v2: a child of this process's cgroup, where ``cpu`` is already enabled in that
  cgroup's ``cgroup.subtree_control``. The "no internal processes" rule lets only the root
  cgroup both hold processes and enable controllers for its children, so this works for a
  process in the root cgroup (in a container's cgroup namespace "/" is not the real root,
  and the kernel refuses). We never enable a controller ourselves: it would change how the
  whole machine, or the container, shares its CPU.

The knob: ``cpu.idle=1`` where the kernel has it (5.15 on), else ``cpu.weight=1`` (v2) or
``cpu.shares=2`` (v1), the lowest weights each takes.

Trust: no symlink is followed below the cgroup mount (every directory is opened relative to
the one above it with ``O_NOFOLLOW``), and a group or a file in it that another uid owns is
not used. A group of our name that exists already is used only when it is ours (left by a
dead process of the same pid). A group whose owner pid is dead is removed by the next
process that makes one, so a caller killed with SIGKILL leaves nothing for long (the kernel
refuses to remove a group that still holds a process, which keeps us off a live one).

Everything is best effort: any OSError means no group (or the worker stays out of it), and
the workers lower themselves as before. Nothing here raises.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from dataclasses import dataclass

__all__ = ["FS", "GROUP_PREFIX", "CgroupFs", "WorkerGroup", "acquire", "quota_cores", "release"]

GROUP_PREFIX = "hotswap-workers-"
# How long release() retries the removal of a group whose last workers are still exiting
# (killed ones leave it at the end of their exit, a moment after the pool has reaped them).
_REMOVE_WAIT_S = 1.0
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class CgroupFs:
    """Where the kernel's files are, and the two calls whose effect only cgroupfs has.

    ``root`` prefixes every path read (``/proc/self/cgroup``, ``/proc/self/mountinfo``, the
    mount points they name). Tests point it at a directory that imitates them, and override
    ``mkdir``/``rmdir`` to do what the kernel does: fill a new group with its files, and
    remove a group with them."""

    root: str = "/"

    def path(self, absolute: str) -> str:
        return os.path.join(self.root, absolute.lstrip("/"))

    def read(self, absolute: str) -> str:
        with open(self.path(absolute)) as f:
            return f.read()

    def mkdir(self, parent_fd: int, name: str) -> None:
        os.mkdir(name, 0o755, dir_fd=parent_fd)

    def rmdir(self, parent_fd: int, name: str) -> None:
        os.rmdir(name, dir_fd=parent_fd)


FS = CgroupFs()  # the real one; tests and scripts/priority_check.py replace it


@dataclass(eq=False)
class WorkerGroup:
    """One process's group for its compile workers. Its methods never raise."""

    fs: CgroupFs
    version: int         # 1 or 2
    knob: str            # "cpu.idle", "cpu.weight" or "cpu.shares"
    name: str            # hotswap-workers-<pid>
    parent_path: str     # the owner's own cgroup directory (under fs.root)
    parent_fd: int
    fd: int
    users: int = 0       # pools of this process that hold it

    @property
    def path(self) -> str:
        return os.path.join(self.parent_path, self.name)

    @property
    def note(self) -> str:
        """What ``status`` says the workers run under, e.g. "cgroup v1 cpu.idle"."""
        value = {"cpu.idle": "", "cpu.weight": "=1", "cpu.shares": "=2"}[self.knob]
        return f"cgroup v{self.version} {self.knob}{value}"

    def add(self, pid: int) -> bool:
        """Move ``pid`` (every thread of it) into the group; False where the kernel refused."""
        return _write(self.fd, "cgroup.procs", str(pid))

    def leave(self, pid: int) -> bool:
        """Move ``pid`` back into the owner's own cgroup."""
        return _write(self.parent_fd, "cgroup.procs", str(pid))


_groups: dict[tuple[CgroupFs, int], WorkerGroup] = {}
_lock = threading.Lock()


def acquire(fs: CgroupFs | None = None) -> WorkerGroup | None:
    """This process's worker group, made on first use (and stale ones of dead owners
    removed); None where no cpu cgroup is ours to make. Pair with ``release``."""
    fs = fs or FS
    key = (fs, os.getpid())
    with _lock:
        group = _groups.get(key)
        if group is None:
            group = _make(fs, os.getpid())
            if group is None:
                return None
            _groups[key] = group
        group.users += 1
        return group


def release(group: WorkerGroup) -> None:
    """A pool is done with ``group``; the last one removes it (its workers have exited)."""
    # Under the lock: a pool starting meanwhile must not get the group this removes.
    with _lock:
        group.users -= 1
        if group.users > 0:
            return
        _groups.pop((group.fs, os.getpid()), None)
        deadline = time.monotonic() + _REMOVE_WAIT_S
        while True:
            try:
                group.fs.rmdir(group.parent_fd, group.name)
                break
            except FileNotFoundError:
                break
            except OSError:  # EBUSY: a killed worker's process is still leaving it
                if time.monotonic() >= deadline:
                    break  # left for the next process's sweep (its owner is dead by then)
                time.sleep(0.02)
        for fd in (group.fd, group.parent_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def _make(fs: CgroupFs, owner_pid: int) -> WorkerGroup | None:
    try:
        found = _own_cpu_cgroup(fs)
    except (OSError, ValueError, IndexError):  # unreadable, or lines we do not understand
        return None
    if found is None:
        return None
    version, mount_point, relative = found
    try:
        parent_fd = _open_below(fs.path(mount_point), relative)
    except OSError:
        return None
    name = f"{GROUP_PREFIX}{owner_pid}"
    parent_path = os.path.join(fs.path(mount_point), relative)
    try:
        if version == 2 and "cpu" not in _read_at(parent_fd, "cgroup.subtree_control").split():
            raise OSError("cpu is not enabled for this cgroup's children")
        _sweep(fs, parent_fd, owner_pid)
        made = False
        try:
            fs.mkdir(parent_fd, name)
            made = True
        except FileExistsError:
            pass  # a dead process's of our pid, or ours from an earlier pool: checked below
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                raise PermissionError(f"{name} belongs to another user")
            knob = _set_knob(fd, version)
        except OSError:
            os.close(fd)
            if made:
                with contextlib.suppress(OSError):
                    fs.rmdir(parent_fd, name)
            raise
    except OSError:
        os.close(parent_fd)
        return None
    return WorkerGroup(fs, version, knob, name, parent_path, parent_fd, fd)


def quota_cores(fs: CgroupFs | None = None) -> float | None:
    """The CPU time this process's own cpu cgroup may use, in cores (v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``); None where it has no quota or none can
    be read (a quota on a group above it is not looked at)."""
    fs = fs or FS
    try:
        found = _own_cpu_cgroup(fs)
        if found is None:
            return None
        version, mount_point, relative = found
        folder = os.path.join(mount_point, relative)
        if version == 2:
            quota, period = fs.read(os.path.join(folder, "cpu.max")).split()[:2]
        else:
            quota = fs.read(os.path.join(folder, "cpu.cfs_quota_us")).strip()
            period = fs.read(os.path.join(folder, "cpu.cfs_period_us")).strip()
        if quota in ("max", "-1"):
            return None
        return int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _own_cpu_cgroup(fs: CgroupFs) -> tuple[int, str, str] | None:
    """(version, mount point, this process's cgroup relative to it) of the hierarchy that has
    the cpu controller: v1's where it is mounted, else v2's."""
    memberships: dict[str, str] = {}  # "cpu" or "" (v2) -> path in that hierarchy
    for line in fs.read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            memberships[""] = path
        elif "cpu" in controllers.split(","):
            memberships["cpu"] = path
    v2_mount = None
    for line in fs.read("/proc/self/mountinfo").splitlines():
        fields = line.split()
        dash = fields.index("-")
        root, mount_point = _unescape(fields[3]), _unescape(fields[4])
        fstype, options = fields[dash + 1], fields[dash + 3].split(",")
        if fstype == "cgroup" and "cpu" in options and "cpu" in memberships:
            relative = _relative(memberships["cpu"], root)
            if relative is not None:
                return 1, mount_point, relative
        elif fstype == "cgroup2" and "" in memberships and v2_mount is None:
            relative = _relative(memberships[""], root)
            if relative is not None:
                v2_mount = (2, mount_point, relative)
    if "cpu" in memberships:
        return None  # cpu is a v1 controller here, on no mount of ours: v2 cannot have it
    return v2_mount


def _relative(path: str, mount_root: str) -> str | None:
    """``path`` below a mount of ``mount_root`` (a mount may show part of a hierarchy)."""
    path, mount_root = os.path.normpath(path), os.path.normpath(mount_root)
    if mount_root == "/":
        return path.lstrip("/")
    if path == mount_root:
        return ""
    if path.startswith(mount_root + "/"):
        return path[len(mount_root) + 1:]
    return None


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes (\040 ...)
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def _open_below(mount_point: str, relative: str) -> int:
    """An fd of ``mount_point/relative``, opened one component at a time, following no
    symlink below the mount point."""
    fd = os.open(mount_point, _DIR_FLAGS)
    try:
        for part in [p for p in relative.split("/") if p]:
            if part == "..":
                raise OSError(f"'..' in a cgroup path: {relative!r}")
            below = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = below
    except BaseException:
        os.close(fd)
        raise
    return fd


def _sweep(fs: CgroupFs, parent_fd: int, owner_pid: int) -> None:
    """Remove the groups of dead owners (of our uid) beside ours; busy ones stay."""
    for name in os.listdir(parent_fd):
        pid = name[len(GROUP_PREFIX):]
        if not name.startswith(GROUP_PREFIX) or not pid.isdigit() or int(pid) == owner_pid:
            continue
        if _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            if st.st_uid == os.geteuid() and (st.st_mode & 0o170000) == 0o040000:
                fs.rmdir(parent_fd, name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's: alive
    return True


def _set_knob(fd: int, version: int) -> str:
    try:
        _write_or_raise(fd, "cpu.idle", "1")
        return "cpu.idle"
    except FileNotFoundError:
        pass  # before Linux 5.15
    knob, value = ("cpu.weight", "1") if version == 2 else ("cpu.shares", "2")
    _write_or_raise(fd, knob, value)
    return knob


def _open_owned(dir_fd: int, name: str, flags: int) -> int:
    fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            raise PermissionError(f"{name} belongs to another user")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_or_raise(dir_fd: int, name: str, value: str) -> None:
    fd = _open_owned(dir_fd, name, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _write(dir_fd: int, name: str, value: str) -> bool:
    try:
        _write_or_raise(dir_fd, name, value)
    except OSError:
        return False
    return True


def _read_at(dir_fd: int, name: str) -> str:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    with os.fdopen(fd) as f:
        return f.read()
