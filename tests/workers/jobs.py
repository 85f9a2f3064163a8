"""Test-only jobs. Workers import them through the sys.path the pool forwards to them."""

from __future__ import annotations

import os
import sys
from typing import Any

from hotswap.testing.faults import FailsToUnpickle


def getenv(name: str) -> str | None:
    return os.environ.get(name)


def loaded(modules: list[str]) -> dict[str, bool]:
    return {m: m in sys.modules for m in modules}


def result_fails_to_unpickle(_: Any = None) -> FailsToUnpickle:
    return FailsToUnpickle()


def pid(_: Any = None) -> int:
    return os.getpid()


def niceness(_: Any = None) -> int:
    return os.nice(0)


def sched_policy(_: Any = None) -> int:
    return os.sched_getscheduler(0)


def cpu_cgroup(pid: int | None = None) -> str:
    """The cgroup of ``pid`` (this process by default) in the hierarchy that has the cpu
    controller: cgroup v1's where it is mounted, else v2's."""
    with open(f"/proc/{pid or 'self'}/cgroup") as f:
        lines = [line.split(":", 2) for line in f.read().splitlines()]
    v1 = [path for _, controllers, path in lines if "cpu" in controllers.split(",")]
    return v1[0] if v1 else next(path for _, controllers, path in lines if controllers == "")


def lowered(_: Any = None) -> tuple[int, int, str]:
    """How this worker is kept below its caller: (scheduling policy, niceness, cpu cgroup)."""
    return os.sched_getscheduler(0), os.nice(0), cpu_cgroup()


def lowered_pid(pid: int) -> tuple[int, int, str]:
    """``lowered`` of process ``pid``, read from outside (a starved worker could not answer)."""
    return os.sched_getscheduler(pid), os.getpriority(os.PRIO_PROCESS, pid), cpu_cgroup(pid)


def is_idle(how: tuple[int, int, str], caller_pid: int) -> bool:
    """Whether a worker that reported ``how`` (``lowered``) gets only the CPU nothing else
    wants, as a pool's ``idle=True`` asks: in its caller's cgroup for workers (system/cgroup.py,
    ``cpu.idle=1`` where the kernel has it), or under SCHED_IDLE."""
    policy, _, group = how
    return group.endswith(f"/hotswap-workers-{caller_pid}") or policy == os.SCHED_IDLE


def autogroup_nice(_: Any = None) -> int | None:
    """The niceness of this process's autogroup (None where the kernel has no autogroups)."""
    try:
        with open("/proc/self/autogroup") as f:
            return int(f.read().split("nice")[1])
    except (OSError, IndexError, ValueError):
        return None


warmed: list[str] = []


def warm_slowly(_: Any = None) -> None:
    """A warm-up step that takes a while."""
    import time

    time.sleep(1.0)
    warmed.append("slow")


def warm_quickly(_: Any = None) -> None:
    warmed.append("quick")


def warm_failing(_: Any = None) -> None:
    raise RuntimeError("this warm-up step fails")


def warm_blocked(_: Any = None) -> None:
    """A warm-up step that lasts, in a worker whose environment names WARM_BLOCK, until the
    file it names exists."""
    import time

    path = os.environ.get("WARM_BLOCK")
    while path and not os.path.exists(path):
        time.sleep(0.05)


def warm_when_idle(_: Any = None) -> None:
    warmed.append("idle")


warm_when_idle.idle_s = 1.5  # type: ignore[attr-defined]


def warm_steps(_: Any = None) -> list[str]:
    return list(warmed)


def burn(cpu_s: float) -> tuple[int, tuple[int, int, str]]:
    """Use ``cpu_s`` seconds of this process's CPU; returns (pid, ``lowered()`` at the end)."""
    import time

    end = time.process_time() + cpu_s
    while time.process_time() < end:
        pass
    return os.getpid(), lowered()


def temp_dirs(_: Any = None) -> tuple[str, str | None]:
    """(this worker's Python temporary directory, the TMPDIR its child processes get)."""
    import tempfile

    return tempfile.gettempdir(), os.environ.get("TMPDIR")


def leave_compiler_temp(marker: str) -> None:
    """As a compile killed mid-build: a child process (the compiler) has written a temporary
    file in $TMPDIR; its path goes to ``marker``; then hang until killed."""
    import subprocess
    import time

    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "ccKILLED.s")
    subprocess.Popen(["sh", "-c", 'echo partial > "$0"; exec sleep 600', path])
    while not os.path.exists(path):
        time.sleep(0.01)
    with open(marker, "w") as f:
        f.write(path)
    time.sleep(600)


def run_compiler(cpu_s: float) -> int:
    """As inductor building a kernel: a child process (the C++ compiler) that keeps a core busy
    for ``cpu_s`` seconds, waited for. Stopping the worker does not stop its children."""
    import subprocess

    spin = f"import time\nend = time.monotonic() + {cpu_s}\nwhile time.monotonic() < end: pass"
    return subprocess.run([sys.executable, "-c", spin], check=False).returncode


def hold(path: str) -> None:
    """Keep this worker busy until ``path`` exists."""
    import time

    while not os.path.exists(path):
        time.sleep(0.01)


def note(args: tuple[str, str]) -> tuple[int, int, str]:
    """Append ``label`` to the file ``path`` (args: path, label); ``lowered()``."""
    path, label = args
    with open(path, "a") as f:
        f.write(label + "\n")
    return lowered()


measured = note  # the same job, under a name a pool lists in its ``measures``
