"""Load beside a caller, placed as hotswap's compile workers are: what the machine itself
does to a caller's calls while a background compile keeps the cores busy.

    spinners = Spinners(os.cpu_count())   # one spinning process per core, where workers run
    ...                                   # time the caller's calls
    spinners.stop()

``hotswap bench``'s ``machine:busy-eager`` row serves the eager model beside them: the floor a
compiled row's largest call is read against.
"""

from __future__ import annotations

import subprocess
import sys

__all__ = ["Spinners"]

_SPIN = """
import sys
from hotswap.workers.child import lower_priority
nice, idle = sys.stdin.readline().split()  # once the pool's side has placed us (priority.py)
lower_priority(int(nice), idle == "True")
while True:
    pass
"""


class Spinners:
    """``count`` processes that spin where hotswap's compile workers run: in the workers' cpu
    group where one can be made, else lowered as a worker lowers itself (priority.py), each
    in a session of its own, as a worker is. ``stop()`` ends them and releases the group."""

    def __init__(self, count: int) -> None:
        import hotswap
        from hotswap.system.priority import WorkerPriority

        self.priority = WorkerPriority(*hotswap.runtime().worker_priority)
        self.procs: list[subprocess.Popen[str]] = []
        for _ in range(count):
            proc = subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.PIPE,
                                    text=True, start_new_session=True)
            self.procs.append(proc)
            nice, idle = self.priority.lower_new(proc.pid)
            assert proc.stdin is not None
            proc.stdin.write(f"{nice} {idle}\n")
            proc.stdin.flush()

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        self.priority.close()
