"""A compile job never starves: workers below the caller's priority that get no CPU are raised
(or, where the OS refuses, their job starts over on a worker at normal priority)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from hotswap.system import proctree
from hotswap.system.starvation import (
    CROWDED_BY,
    POLL_S,
    STARVED_AFTER_S,
    STARVED_SHARE,
    YIELD_TO,
    CpuWatch,
    Found,
    MachineLoad,
)
from hotswap.testing.load import Spinners
from hotswap.workers import WorkerPool
from hotswap.workers.future import JobFuture
from hotswap.workers.inbox import MAX_OVERTAKEN, Inbox, Job, PoolConfig
from hotswap.workers.watchdog import Watchdog
from tests.workers import jobs

J = "tests.workers.jobs:"


@contextlib.contextmanager
def busy_cores() -> Iterator[None]:
    """Every core kept busy at normal priority, as a caller's intra-op threads would. Skips
    where this kernel does not starve a worker lowered as hotswap lowers them against them
    (seen on Linux 6.18 where no cpu cgroup could be made: a SCHED_IDLE process in its own
    session of niceness 19 got 0.5 s of CPU in 0.68 s beside two spinners), since then there
    is no starvation to act on. The probe's share is read from outside: a starved probe
    (0.0 to 0.02 of a core in a cpu.idle group) could not report it in any useful time.

    Where starvation is complete, anything a lowered worker does while this holds is raised
    first, so what a worker does at its lowered priority is asked before or after."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(os.cpu_count() or 1)]
    probe = Spinners(1)  # one more, placed as a worker is
    try:
        share = _cpu_share(probe.procs[0].pid, 1.0)
        note = probe.priority.note
        probe.stop()
        if share > STARVED_SHARE:
            pytest.skip(f"this kernel gave a worker at hotswap's priority ({note}) "
                        f"{share:.0%} of a core beside busy cores: no starvation to raise "
                        "(workers/starvation.py)")
        yield
    finally:
        probe.stop()
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def test_a_starved_job_is_raised_then_lowered_again(caplog: pytest.LogCaptureFixture) -> None:
    with WorkerPool(1, warm_modules=(), nice=19, idle=True) as pool:
        assert pool.wait_ready(60)
        lowered = pool.submit(J + "lowered").result(timeout=90)
        assert jobs.is_idle(lowered, os.getpid())
        caplog.clear()  # what the busy spell did, alone
        with busy_cores():
            pid, how = pool.submit(J + "burn", 1.0).result(timeout=90)
        hints = [r.getMessage() for r in caplog.records if "compile workers got" in r.getMessage()]
        if not hints:
            _not_starved(how)
        assert how == _raised()  # it finished raised
        assert pool.restarts == 0  # raised in place, not restarted
        # The hint, once: what starved the job and what was done about it.
        [hint] = hints
        assert "raised them to the caller's priority until their job ends" in hint
        # Lowered again once its job ended.
        assert pool.submit(J + "lowered").result(timeout=90) == lowered
        assert pool.submit(J + "pid").result(timeout=90) == pid


def test_where_the_os_refuses_the_job_restarts_at_normal_priority(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    real = proctree.set_tree_priority

    def refuse_raising(pid: int, *, nice: int, idle: bool) -> bool:
        if not idle and nice == 0:
            return False  # as for a user without CAP_SYS_NICE
        return real(pid, nice=nice, idle=idle)

    monkeypatch.setattr(proctree, "set_tree_priority", refuse_raising)
    with WorkerPool(1, warm_modules=(), nice=19, idle=True) as pool:
        assert pool.wait_ready(60)
        first = pool.submit(J + "pid").result(timeout=90)
        caplog.clear()  # what the busy spell did, alone
        with busy_cores():
            pid, how = pool.submit(J + "burn", 1.0).result(timeout=120)
        if "compile workers got" not in caplog.text:
            _not_starved(how)
        assert pid != first and how == _raised()
    assert "the OS refused to raise their priority" in caplog.text


def test_a_worker_starving_at_its_start_is_raised_for_a_caller_waiting_on_it(
        caplog: pytest.LogCaptureFixture) -> None:
    """``prepare(wait=True)`` on a machine whose cores are all busy: the starting worker is
    raised, and lowered again once it is ready (no job waits for it)."""
    with busy_cores(), WorkerPool(1, warm_modules=(), nice=19, idle=True) as pool:
        assert pool.wait_ready(60)
        if "compile workers got" not in caplog.text:
            pytest.skip("the starting worker was not starved this time: nothing to raise")
        [worker] = pool.worker_pids()
        assert jobs.is_idle(jobs.lowered_pid(worker), os.getpid())


def test_an_idle_caller_leaves_the_workers_low() -> None:
    with WorkerPool(1, warm_modules=(), nice=19, idle=True) as pool:
        assert pool.wait_ready(60)
        lowered = pool.submit(J + "lowered").result(timeout=90)
        [worker] = pool.worker_pids()
        busy_before = _busy_cpu_s() - proctree.tree_cpu_s(worker)
        start = time.monotonic()
        _, how = pool.submit(J + "burn", 3.0).result(timeout=90)
        others = (_busy_cpu_s() - proctree.tree_cpu_s(worker) - busy_before) / (
            time.monotonic() - start)
        if how != lowered and others > 0.5:
            # In a cpu.idle cgroup (priority.py) a worker gets only what every other process
            # leaves, not only what the caller leaves: here others were busy, and bursts of
            # theirs starved the worker now and then (1.3 to 1.6 cores on 2 seen raise it).
            pytest.skip(f"other processes used {others:.1f} cores while the job ran")
        assert how == lowered and jobs.is_idle(how, os.getpid()) and pool.cpu_note() == ""


class _Machine:
    """A scripted 2-core machine for ``MachineLoad``: each ``tick`` adds ``dt`` seconds of
    busy and idle core time and of this process's own CPU time."""

    def __init__(self) -> None:
        self.busy = self.idle = self.own = 0.0

    def load(self) -> MachineLoad:
        return MachineLoad(lambda: (self.busy, self.idle), lambda: self.own)

    def tick(self, dt: float, *, idle: float, own: float) -> None:
        self.busy += (2.0 - idle) * dt
        self.idle += idle * dt
        self.own += own * dt


def _run(load: MachineLoad, machine: _Machine, seconds: float, shares: dict[int, float], *,
         idle: float, own: float, start: float = 100.0) -> float:
    """Poll ``load`` every POLL_S for ``seconds``, the workers getting ``shares``; the time
    of the last poll."""
    used = dict.fromkeys(shares, 0.0)
    now = start
    while True:
        load.sample(now, used)
        if now - start >= seconds - 1e-9:
            return now
        now += POLL_S
        machine.tick(POLL_S, idle=idle, own=own)
        used = {pid: cpu + shares[pid] * POLL_S for pid, cpu in used.items()}


@pytest.mark.parametrize(("share", "idle", "own", "crowded"), [
    (0.4, 0.0, 0.5, True),    # others use 2 - 0.5 - 0.4 = 1.1 cores, nothing idle: crowded out
    (0.4, 0.3, 0.5, False),   # idle time it did not take: not CPU-bound, nothing to raise
    (0.4, 0.0, 1.5, False),   # the caller's own threads took the cores (the starved rule's)
    (0.6, 0.0, 0.2, False),   # a fair share beside the others
])
def test_a_worker_is_crowded_out_only_by_other_processes_on_saturated_cores(
        share: float, idle: float, own: float, crowded: bool) -> None:
    machine = _Machine()
    load = machine.load()
    _run(load, machine, STARVED_AFTER_S, {7: share}, idle=idle, own=own)
    got = load.crowded(7)
    if not crowded:
        assert got is None
        return
    assert got is not None
    assert got[0] == pytest.approx(share) and got[2] == pytest.approx(own)
    assert got[1] == pytest.approx(2.0 - idle - own - share) and got[1] >= CROWDED_BY


def test_crowding_is_judged_over_a_whole_window_and_counts_every_worker_as_ours() -> None:
    machine = _Machine()
    load = machine.load()
    # Not a whole window yet: nothing is judged.
    last = _run(load, machine, STARVED_AFTER_S - POLL_S, {7: 0.0}, idle=0.0, own=0.0)
    assert load.crowded(7) is None
    # A worker that joined mid-window is not judged until it has a whole window.
    last = _run(load, machine, 2 * POLL_S, {7: 0.0, 8: 0.0}, idle=0.0, own=0.0,
                start=last + POLL_S)
    assert load.crowded(7) is not None and load.crowded(8) is None
    # Two workers of the pool split the cores with the caller: neither crowds the other out.
    machine = _Machine()
    load = machine.load()
    _run(load, machine, 2 * STARVED_AFTER_S, {7: 0.4, 8: 1.0}, idle=0.0, own=0.6)
    assert load.window(7) == pytest.approx((0.4, 0.0, 0.0, 0.6)) and load.crowded(7) is None
    # A worker that started within the window counts from nothing: all its CPU is the
    # pool's (its first poll found it 0.3 s into its start).
    machine = _Machine()
    load = machine.load()
    for step in range(round(STARVED_AFTER_S / POLL_S) + 1):
        workers = {7: 0.4 * POLL_S * step}
        if step >= 2:
            workers[8] = 0.3 + 1.0 * POLL_S * (step - 2)
        load.sample(100.0 + step * POLL_S, workers)
        machine.tick(POLL_S, idle=0.0, own=0.6)
    # busy 2 cores, the caller 0.6, worker 7 0.4, worker 8 (0.3 + 1.0) / 2 s = 0.65: others
    # 0.35, under CROWDED_BY (counted from its first poll instead: 0.5, and 7 "crowded out").
    assert load.window(7) == pytest.approx((0.4, 0.0, 0.35, 0.6)) and load.crowded(7) is None
    # A worker that exits (or is killed) stays the pool's work in the window: the others are
    # not charged for it, and a new worker given its pid is not paired with its samples.
    machine = _Machine()
    load = machine.load()
    last = _run(load, machine, 2 * STARVED_AFTER_S, {7: 0.4, 8: 1.0}, idle=0.0, own=0.6)
    load.forget(8)
    window = load.window(7)
    assert window is not None and window[2] == pytest.approx(0.0, abs=1e-9)
    assert load.crowded(7) is None and load.window(8) is None
    load.sample(last + POLL_S, {7: 0.4 * (2 * STARVED_AFTER_S + POLL_S), 8: 0.0})
    assert load.window(8) is None  # the new worker 8 has no whole window of its own yet
    # Between two jobs (one poll not watched), a worker's window starts again; so it does
    # after polls stopped (no job anywhere) for longer than three polls.
    for gap, watched in ((POLL_S, {}), (4 * POLL_S, {7: 0.0})):
        machine = _Machine()
        load = machine.load()
        last = _run(load, machine, STARVED_AFTER_S, {7: 0.0}, idle=0.0, own=0.0)
        assert load.crowded(7) is not None
        machine.tick(gap, idle=0.0, own=0.0)
        load.sample(last + gap, watched)
        assert load.crowded(7) is None
        machine.tick(POLL_S, idle=0.0, own=0.0)
        _run(load, machine, STARVED_AFTER_S - 2 * POLL_S, {7: 0.0}, idle=0.0, own=0.0,
             start=last + gap + POLL_S)
        assert load.crowded(7) is None


def test_a_job_that_ended_in_the_window_counts_as_the_callers_work() -> None:
    """Worker 8 used 1.1 cores until its last sample, half the window; then the caller took
    that core. Counted to its last sample, the others used 0.1 cores; left out, 0.65 (its
    time would be theirs) and worker 7 would look crowded out."""
    machine = _Machine()
    load = machine.load()
    used = {7: 0.0, 8: 0.0}
    steps = round(STARVED_AFTER_S / POLL_S)
    for step in range(steps + 1):
        load.sample(100.0 + step * POLL_S, used if step <= steps // 2 else {7: used[7]})
        first_half = step < steps // 2
        machine.tick(POLL_S, idle=0.0, own=0.4 if first_half else 1.5)
        used = {7: used[7] + 0.4 * POLL_S, 8: used[8] + (1.1 if first_half else 0.0) * POLL_S}
    assert load.window(7) == pytest.approx((0.4, 0.0, 0.1, 0.95))
    assert load.crowded(7) is None


def _watch(machine: _Machine, share: float, *, idle: float, own: float,
           monkeypatch: pytest.MonkeyPatch, yield_to: str = "caller"
           ) -> tuple[CpuWatch, list[Found]]:
    """A CpuWatch of lowered workers polled over a window: one worker getting ``share``."""
    cpu = CpuWatch(19, True, yield_to)
    if cpu.load is not None:
        cpu.load = machine.load()
    used = {"cpu": 0.0}
    monkeypatch.setattr(proctree, "trees_cpu_s", lambda pids: dict.fromkeys(pids, used["cpu"]))
    found: list[Found] = []
    now = 100.0
    while now <= 100.0 + STARVED_AFTER_S + 1e-9:
        found = cpu.starved(now, {4242}, {4242})
        now += POLL_S
        machine.tick(POLL_S, idle=idle, own=own)
        used["cpu"] += share * POLL_S
    return cpu, found


def test_a_crowded_out_worker_is_raised_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Through the watchdog, as the manager runs it: raised, the note and the log line say
    what crowded it out and over how long."""
    cpu, found = _watch(_Machine(), 0.4, idle=0.0, own=0.5, monkeypatch=monkeypatch)
    [(pid, share, over_s, crowded_by)] = found
    assert pid == 4242 and share == pytest.approx(0.4) and over_s == STARVED_AFTER_S
    assert crowded_by == pytest.approx((1.1, 0.5))
    raised: list[int] = []
    monkeypatch.setattr(cpu.priority, "raise_tree", lambda pid: raised.append(pid) or True)
    monkeypatch.setattr(cpu, "starved", lambda now, needed, watched: found)
    watchdog = Watchdog(PoolConfig(1, None, None, [], 1.0, 60.0, nice=19, idle=True), cpu)
    worker = SimpleNamespace(pid=pid, job=object(), ready=True, kill_reason=None,
                             started_s=0.0, deadline_s=None)
    monkeypatch.setattr(proctree, "stopped", lambda pid: None)
    assert watchdog.overdue([worker], False, 200.0) == []  # type: ignore[list-item]
    assert raised == [pid] and cpu.is_raised(pid)
    expected = ("compile workers got 40% of a core for 2.0 s while other processes kept the "
                "cores busy (1.1 cores; this process 0.5); raised them to the caller's priority "
                "until their job ends, to share the cores with that work")
    assert expected in cpu.note and expected in caplog.text
    # Raised, it is not found crowded again on the next poll.
    monkeypatch.undo()
    monkeypatch.setattr(proctree, "trees_cpu_s", lambda pids: dict.fromkeys(pids, 0.8))
    assert cpu.starved(100.0 + STARVED_AFTER_S + POLL_S, {4242}, {4242}) == []
    # yield_to="all" (the compile service's workers) leaves it: 0.4 of a core is no starvation.
    everyone, found = _watch(_Machine(), 0.4, idle=0.0, own=0.5, monkeypatch=monkeypatch,
                             yield_to="all")
    assert everyone.load is None and found == []


def test_a_starved_worker_is_raised_as_starved_whoever_starves_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a quarter of a core, the starved rule decides (its job starts over where the OS
    will not raise it), in both ways and whether or not others crowd the cores."""
    for way in YIELD_TO:
        for own in (1.9, 0.2):
            _, found = _watch(_Machine(), 0.1, idle=0.0, own=own, monkeypatch=monkeypatch,
                              yield_to=way)
            assert [(f.pid, f.crowded_by) for f in found] == [(4242, None)]


def test_a_crowded_out_worker_the_os_will_not_raise_keeps_its_job(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Unlike a starved one, whose job starts over on a worker at normal priority: it still
    gets a share, and restarting would lose its work. Put back where it was (a refused raise
    may have moved it out of the idle group), and the watch stops asking."""
    cpu, [found] = _watch(_Machine(), 0.4, idle=0.0, own=0.5, monkeypatch=monkeypatch)
    lowered: list[int] = []
    monkeypatch.setattr(cpu.priority, "raise_tree", lambda pid: False)
    monkeypatch.setattr(cpu.priority, "lower_tree", lambda pid: lowered.append(pid))
    assert cpu.raise_worker(found)  # keep it: not killed
    assert lowered == [found.pid] and not cpu.is_raised(found.pid)
    assert not cpu.priority.normal_start and cpu.load is None
    assert "they stay lowered" in cpu.note


def test_once_workers_start_at_normal_priority_crowding_is_not_watched(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, [found] = _watch(_Machine(), 0.1, idle=0.0, own=0.5, monkeypatch=monkeypatch)
    monkeypatch.setattr(cpu.priority, "raise_tree", lambda pid: False)
    assert not cpu.raise_worker(found)  # starved and refused: its job starts over
    assert cpu.priority.normal_start and cpu.load is None
    assert "restarting the job on a worker at normal priority" in cpu.note


def test_machine_load_counts_other_processes_and_not_this_ones_workers() -> None:
    """On the real machine: spinners outside this process's tree crowd a sleeping worker out;
    the same spinners as this process's watched workers do not."""
    load = MachineLoad.here()
    assert load is not None
    cores = len(os.sched_getaffinity(0))
    spin = "import time\nend = time.monotonic() + 30.0\nwhile time.monotonic() < end: pass\n"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    orphans = []
    try:
        for _ in range(cores):  # another process's, once their launcher exits
            launched = subprocess.run(
                [sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen("
                 f"[sys.executable, '-c', {spin!r}], start_new_session=True, "
                 "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"],
                capture_output=True, text=True, check=True)
            orphans.append(psutil.Process(int(launched.stdout)))
        before, start = sum(sum(p.cpu_times()[:2]) for p in orphans), time.monotonic()
        mine = MachineLoad.here()  # the same polls, the spinners watched as its workers
        assert mine is not None
        windows = _sampled((load, mine), sleeper.pid, orphans)
        spun = (sum(sum(p.cpu_times()[:2]) for p in orphans) - before) / (
            time.monotonic() - start)  # cores: they spin at a steady rate
        [theirs, ours] = windows
        assert theirs is not None and ours is not None
        # The sleeper got nothing, the cores had no idle time to give it, and the spinners
        # (most of the cores; whatever else runs on the machine adds to it) count as others'.
        assert theirs[0] < 0.05 and theirs[1] < 0.45 and theirs[2] >= 0.9 * spun
        assert load.crowded(sleeper.pid) is not None
        # Watched as this process's workers, the same spinners are not others'.
        assert ours[2] == pytest.approx(theirs[2] - spun, abs=0.25)
    finally:
        sleeper.kill()
        sleeper.wait()
        for orphan in orphans:
            with contextlib.suppress(psutil.Error):
                orphan.kill()


def test_the_trees_cpu_time_from_one_pass_is_each_trees_own() -> None:
    """trees_cpu_s (one read of /proc per poll) agrees with psutil's view of each tree: a
    spinning grandchild counts in its grandparent's tree, and a pid that is gone is 0."""
    spin = "import time\nend = time.monotonic() + 1.0\nwhile time.monotonic() < end: pass\n"
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run("
                               f"[sys.executable, '-c', {spin!r}])"])
    try:
        time.sleep(0.8)
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        both = proctree.trees_cpu_s({parent.pid, os.getpid(), gone.pid})
        alone = sum(sum(p.cpu_times()[:4]) for p in  # user, system and waited children's
                    [psutil.Process(parent.pid), *psutil.Process(parent.pid).children(True)])
        assert both[gone.pid] == 0.0 and both[parent.pid] >= 0.3
        assert both[parent.pid] == pytest.approx(alone, abs=0.1)
        assert both[os.getpid()] >= both[parent.pid]  # the parent is in this process's tree
    finally:
        parent.kill()
        parent.wait()


def _sampled(loads: tuple[MachineLoad, MachineLoad], pid: int, orphans: list[psutil.Process]
             ) -> list[tuple[float, float, float, float] | None]:
    """The window of worker ``pid`` after real polls over STARVED_AFTER_S, in both loads:
    the first watches ``pid`` alone, the second the ``orphans`` too."""
    start = time.monotonic()
    while True:
        now = time.monotonic()
        cpu = {p.pid: sum(p.cpu_times()[:2]) for p in [psutil.Process(pid), *orphans]}
        loads[0].sample(now, {pid: cpu[pid]})
        loads[1].sample(now, cpu)
        if now - start >= STARVED_AFTER_S:
            return [load.window(pid) for load in loads]
        time.sleep(POLL_S)


def _not_starved(how: tuple[int, int, str]) -> None:
    """The worker got its job done without being starved, so there was nothing to raise:
    busy_cores's probe was near the line, and the load of other processes moved (on 2 cores a
    worker in a cpu.idle group got 0.2 to 0.3 of a core beside two spinners whenever the
    kernel put both on one core)."""
    assert how != _raised()
    pytest.skip("the worker was not starved this time: nothing to raise")


def _cpu_share(pid: int, seconds: float) -> float:
    """Cores' worth of CPU ``pid`` got over the next ``seconds``."""
    proc = psutil.Process(pid)
    before, start = sum(proc.cpu_times()[:2]), time.monotonic()
    time.sleep(seconds)
    return float(sum(proc.cpu_times()[:2]) - before) / (time.monotonic() - start)


def _raised() -> tuple[int, int, str]:
    """How a raised worker runs (``jobs.lowered``): as the caller, in the caller's cgroup."""
    return os.SCHED_OTHER, 0, jobs.cpu_cgroup()


def _busy_cpu_s() -> float:
    """CPU seconds every process of the machine has used (all cores, idle time excluded)."""
    times = psutil.cpu_times()
    return float(sum(getattr(times, name, 0.0)
                     for name in ("user", "nice", "system", "irq", "softirq")))


def test_a_raised_worker_that_lowered_itself_again_is_raised_again_and_forgotten_at_exit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A starting worker raised before it read its INIT lowers itself on reading it: still
    starved, it is raised again (not left low for good). A raised worker that exits before
    its job or readiness ended is forgotten, so its note goes and a reused pid starts afresh."""
    cpu = CpuWatch(19, True)
    raised: list[int] = []
    monkeypatch.setattr(cpu.priority, "raise_tree", lambda pid: raised.append(pid) or True)
    config = PoolConfig(1, None, None, [], 1.0, 60.0, nice=19, idle=True)
    watchdog = Watchdog(config, cpu)
    starting = SimpleNamespace(pid=os.getpid(), job=None, ready=False, kill_reason=None,
                               started_s=9.0, deadline_s=None)
    monkeypatch.setattr(cpu, "starved", lambda now, needed, watched: [
        Found(os.getpid(), 0.0, STARVED_AFTER_S, None)])
    for now in (10.0, 11.0):
        assert watchdog.overdue([starting], True, now) == []  # type: ignore[list-item]
    assert raised == [os.getpid(), os.getpid()] and cpu.is_raised(os.getpid())
    assert "raised them" in cpu.note
    cpu.forget(os.getpid())
    assert not cpu.is_raised(os.getpid()) and cpu.note == ""


def test_a_measurement_goes_ahead_of_queued_jobs_at_the_workers_priority(
        tmp_path: Path) -> None:
    """WorkerPool's ``measures``: a job that times code goes ahead of the jobs queued before
    it (not of an earlier measurement), and runs lowered, as every job does."""
    log, go = tmp_path / "order", tmp_path / "go"
    with WorkerPool(1, warm_modules=(), nice=19, idle=True, measures=[J + "measured"]) as pool:
        assert pool.wait_ready(60)
        lowered = pool.submit(J + "lowered").result(timeout=90)
        held = pool.submit(J + "hold", str(go))
        futures = {label: pool.submit(J + ("measured" if label[0] == "m" else "note"),
                                      (str(log), label))
                   for label in ("n1", "m1", "n2", "m2")}
        go.touch()
        held.result(timeout=90)
        how = {label: future.result(timeout=90) for label, future in futures.items()}
        assert log.read_text().split() == ["m1", "m2", "n1", "n2"]
        assert set(how.values()) == {lowered} and jobs.is_idle(lowered, os.getpid())


def _queue(*names: str) -> list[str]:
    """``names`` enqueued in turn (those starting with "m" are measurements): the order they
    would run in."""
    inbox = Inbox()
    measures = frozenset(n for n in names if n.startswith("m"))
    try:
        for i, name in enumerate(names):
            inbox.enqueue(Job(i, name, b"", None, JobFuture(name, i)), measures)
        return [job.name for job in inbox.jobs]
    finally:
        inbox.close_wake_pipe()


def test_measurements_queue_after_each_other_ahead_of_the_rest() -> None:
    assert _queue("c1", "m1", "c2", "m2") == ["m1", "m2", "c1", "c2"]
    # A job put back at the front (a starved worker's, restarted) keeps that place, and a
    # later measurement still queues after the earlier one.
    inbox = Inbox()
    try:
        inbox.jobs.append(Job(0, "m1", b"", None, JobFuture("m1", 0)))
        inbox.jobs.appendleft(Job(1, "c1", b"", None, JobFuture("c1", 1)))
        inbox.enqueue(Job(2, "m2", b"", None, JobFuture("m2", 2)), frozenset({"m1", "m2"}))
        assert [job.name for job in inbox.jobs] == ["c1", "m1", "m2"]
    finally:
        inbox.close_wake_pipe()


def test_a_job_passed_by_enough_measurements_keeps_its_place() -> None:
    names = ["c1", *(f"m{i}" for i in range(MAX_OVERTAKEN + 2))]
    order = _queue(*names)
    assert order == [*names[1:MAX_OVERTAKEN + 1], "c1", *names[MAX_OVERTAKEN + 1:]]


def test_the_local_pool_and_the_service_queue_benchmark_jobs_as_measurements() -> None:
    from hotswap.executors import local
    from hotswap.executors.base import BENCH_JOB, MEASURE_PICKLED, MEASURES
    from hotswap.service import server

    assert set(MEASURES) == {BENCH_JOB, MEASURE_PICKLED}
    pool = local._start_pool(1)
    try:
        assert pool.measures == frozenset(MEASURES)
    finally:
        pool.shutdown()
    assert server.runner_for(BENCH_JOB) == MEASURE_PICKLED
    assert server.runner_for("hotswap.jobs.compile:compile_graph") == server.RUN_PICKLED


def test_local_workers_yield_to_their_caller_and_the_services_to_every_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whom lowered workers yield to: the local pool's, to the process they compile for
    (HOTSWAP_WORKER_YIELD, default "caller"); the compile service's, whose callers are other
    processes, to all."""
    from hotswap.executors import local
    from hotswap.service import server
    from hotswap.service.place import Place

    monkeypatch.delenv("HOTSWAP_WORKER_YIELD", raising=False)
    for setting, expected in ((None, "caller"), ("all", "all"), ("caller", "caller")):
        if setting is not None:
            monkeypatch.setenv("HOTSWAP_WORKER_YIELD", setting)
        pools = local.LocalPools()
        try:
            pool = pools.pool(local.key(1, ()))
            assert pool._config.yield_to == expected
            assert (pool._manager is not None
                    and (pool._manager.cpu.load is not None) == (expected == "caller"))
            assert pool.wait_ready(60)
            note = pool.priority_note()
            assert note != "" and note.endswith(
                "; raised while other processes crowd them out") == (expected == "caller")
        finally:
            pools.shutdown()
    folder = tmp_path / "svc"
    folder.mkdir(mode=0o700)
    service = server.Service(Place(folder, "stamp"), idle_exit_s=10.0)
    assert service._pools._yield_to == "all"
    with pytest.raises(ValueError, match="yield_to must be one of 'caller', 'all'"):
        WorkerPool(1, yield_to="everyone")
