"""Does the caller keep its cores while the compile workers are busy? Each way hotswap can lower
its workers, side by side in one run.

    .venv/bin/python scripts/priority_check.py [--workers 2] [--window-s 10] [--rounds 3]

The caller wakes every ``--period-ms`` (2 ms) and runs a small torch op (a 64x64 matmul, on
torch's intra-op threads) while ``--workers`` workers (default: one per core) spin for the
whole window. Each way of lowering them is forced through its seam (system/cgroup.py's ``FS``,
system/priority.py's ``SCHED_IDLE_IN_IDLE_GROUP``); rounds rotate their order. Per way, the
caller's lateness (how long after its due time each call began) at p50/p99/max, its calls'
own time at p99 and max, and the cores the workers got:

    caller alone                   no workers: what the machine itself does to the caller
    normal priority                workers at the caller's priority (nice 0, no SCHED_IDLE)
    autogroup + SCHED_IDLE         no cgroup (its seam pointed at an empty directory): the
                                   workers lower themselves (child.lower_priority)
    cgroup vN cpu.idle             in the pool's cgroup, not SCHED_IDLE inside
    cgroup vN cpu.idle + SCHED_IDLE  the group, and SCHED_IDLE inside too

The two cgroup rows are left out, with the reason, where no cpu cgroup can be made here.

The starvation watch (starvation.py) is held off: a worker that gets under a quarter of a
core for 2 s would be raised to the caller's priority, and the row would measure the raise,
not the way of lowering (with other processes on the machine that happens within seconds to
workers in a ``cpu.idle`` group). ``--with-watch`` keeps it; a row it raised says so. The
caller runs one intra-op thread unless ``--threads`` says otherwise: with two on two cores,
OpenMP's spin-waits made calls last seconds on a loaded machine, and the lateness of the
wake-ups drowned in them (docs/scheduling.md has that case). Timings from a machine that
others use are only indicative: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

SPIN_JOB = "priority_check:spin"


def spin(seconds: float) -> float:
    """The workers' job: keep a core busy for ``seconds`` of wall time; the CPU seconds got."""
    end = time.monotonic() + seconds
    cpu = time.process_time()
    while time.monotonic() < end:
        pass
    return time.process_time() - cpu


@dataclass
class Run:
    """One way's window: the caller's calls, and what the workers got."""

    lateness_ms: list[float] = field(default_factory=list)
    call_ms: list[float] = field(default_factory=list)
    worker_cores: float = 0.0
    raised: bool = False      # the starvation watch raised the workers meanwhile
    pool_said: str = ""       # the pool's priority_note(): which way it ran


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _caller(window_s: float, period_s: float, on_tick: Callable[[], None]) -> tuple[
        list[float], list[float]]:
    """Calls due every ``period_s`` for ``window_s``: (lateness, call time) in ms each. A
    call that starts late is not made up for: the next one is due a period after it."""
    import torch

    x = torch.randn(64, 64)
    lateness, call_ms = [], []
    start = time.monotonic()
    due = start + period_s
    next_tick = start + 1.0
    while due < start + window_s:
        now = time.monotonic()
        if now < due:
            time.sleep(due - now)
        began = time.monotonic()
        lateness.append((began - due) * 1e3)
        x @ x
        call_ms.append((time.monotonic() - began) * 1e3)
        due = max(due + period_s, time.monotonic())
        if began >= next_tick:
            on_tick()
            next_tick = began + 1.0
    return lateness, call_ms


@contextmanager
def _way(name: str) -> Iterator[tuple[int, bool]]:
    """The seams set for ``name``; yields the pool's (nice, idle)."""
    from hotswap.system import cgroup, priority

    saved = cgroup.FS, priority.SCHED_IDLE_IN_IDLE_GROUP
    with tempfile.TemporaryDirectory() as empty:
        try:
            if name == "normal priority":
                yield 0, False
            elif name == "autogroup + SCHED_IDLE":
                cgroup.FS = cgroup.CgroupFs(root=empty)  # no cgroup to be found
                yield 19, True
            else:
                priority.SCHED_IDLE_IN_IDLE_GROUP = name.endswith("+ SCHED_IDLE")
                yield 19, True
        finally:
            cgroup.FS, priority.SCHED_IDLE_IN_IDLE_GROUP = saved


def _measure(name: str, workers: int, window_s: float, period_s: float) -> Run:
    from hotswap.system import proctree
    from hotswap.workers import WorkerPool

    if name == "caller alone":
        lateness, call_ms = _caller(window_s, period_s, lambda: None)
        return Run(lateness, call_ms)
    with _way(name) as (nice, idle), WorkerPool(workers, warm_modules=(), nice=nice,
                                                idle=idle) as pool:
        if not pool.wait_ready(60):
            raise RuntimeError(f"{name}: workers not ready in 60 s")
        pids = pool.worker_pids()
        futures = [pool.submit(SPIN_JOB, window_s + 1.0) for _ in range(workers)]
        time.sleep(0.3)  # every worker spinning before the window opens
        cpu_before = sum(proctree.tree_cpu_s(pid) for pid in pids)
        notes: list[str] = []
        began = time.monotonic()
        lateness, call_ms = _caller(window_s, period_s,
                                    lambda: notes.append(pool.cpu_note()))
        cores = (sum(proctree.tree_cpu_s(pid) for pid in pids) - cpu_before) / (
            time.monotonic() - began)
        for future in futures:
            future.result(timeout=60)
        raised = any("raised them" in n or "restarting" in n for n in notes)
        return Run(lateness, call_ms, cores, raised, pool.priority_note())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--window-s", type=float, default=10.0, help="per way and round")
    parser.add_argument("--period-ms", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads of the caller")
    parser.add_argument("--with-watch", action="store_true",
                        help="let the starvation watch raise starved workers")
    args = parser.parse_args()

    import torch

    from hotswap.system import cgroup, starvation

    torch.set_num_threads(args.threads)
    if not args.with_watch:
        starvation.STARVED_AFTER_S = float("inf")
    ways = ["caller alone", "normal priority", "autogroup + SCHED_IDLE"]
    group = cgroup.acquire()
    if group is None:
        print("no cgroup rows: no cpu cgroup this process may make a child of")
    else:
        base = group.note
        cgroup.release(group)
        ways += [base, f"{base} + SCHED_IDLE"]
    print(f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}, "
          f"{args.workers} spinning workers, a call every {args.period_ms:g} ms, "
          f"{args.window_s:g} s per way, {args.rounds} round(s); load average "
          f"{os.getloadavg()[0]:.2f} at start")
    results: dict[str, list[Run]] = {w: [] for w in ways}
    for round_index in range(args.rounds):
        order = ways[round_index % len(ways):] + ways[:round_index % len(ways)]
        for way in order:
            results[way].append(_measure(way, args.workers, args.window_s, args.period_ms / 1e3))
    print(f"{'workers lowered by':32} {'calls':>6} {'late p50':>9} {'p99':>8} {'max':>8} "
          f"{'call p99':>9} {'max':>8} {'worker cores':>13}")
    for way, runs in results.items():
        lateness = [v for r in runs for v in r.lateness_ms]
        call_ms = [v for r in runs for v in r.call_ms]
        cores = sum(r.worker_cores for r in runs) / len(runs)
        raised = sum(r.raised for r in runs)
        notes = f"  raised in {raised}/{len(runs)}" if raised else ""
        said = {r.pool_said for r in runs} - {"", way}
        notes += f"  (the pool said: {'; '.join(sorted(said))})" if said else ""
        print(f"{way:32} {len(lateness):6d} {_percentile(lateness, 0.5):7.3f}ms "
              f"{_percentile(lateness, 0.99):6.2f}ms {max(lateness):6.2f}ms "
              f"{_percentile(call_ms, 0.99):7.3f}ms {max(call_ms):6.2f}ms {cores:13.2f}{notes}")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
