"""The lateness probe: a GIL held by another thread shows as one late wake, at its time."""

from __future__ import annotations

import threading
import time

import pytest

from hotswap.tools.lateness import LatenessProbe


def test_a_gil_hold_is_one_late_wake_at_its_time() -> None:
    origin = time.perf_counter()
    probe = LatenessProbe(clock_origin=origin)
    time.sleep(0.2)
    held_at = time.perf_counter() - origin
    t = time.perf_counter()
    compile("x = 1\n" * 100_000, "<held>", "exec")  # one C call: the GIL is not released
    held_ms = (time.perf_counter() - t) * 1e3
    time.sleep(1.2)
    probe.stop()
    seen = probe.summary()
    assert held_ms > 20, "the hold is too short to tell apart from the switch interval"
    assert seen.max_ms >= 0.8 * held_ms
    at, ms = seen.worst[0]
    assert ms == round(seen.max_ms, 2) and held_at <= at <= held_at + held_ms / 1e3 + 0.05
    # apart from the hold, the wakes were on time: one stall, one entry
    assert seen.p50_ms < 5 and all(late < 0.5 * held_ms for _, late in seen.worst[1:])
    assert seen.wakes > 500
    # a window that leaves the hold out does not see it
    after = probe.summary(since_s=held_at + held_ms / 1e3 + 0.05)
    assert 0 < after.wakes < seen.wakes and after.max_ms < 0.5 * held_ms


def test_stop_before_any_wake_and_the_thread_ends() -> None:
    probe = LatenessProbe(interval_s=10)
    probe.stop()
    seen = probe.summary()
    assert seen.wakes == 0 and seen.worst == ()
    assert not any(t.name == "hotswap-lateness" for t in threading.enumerate())


def test_the_collectors_collections_are_timed_in_the_window() -> None:
    # A full collection holds the GIL over every tracked object: the warm-up's imports set
    # one off in a serving process (129 ms on the 2-core box, the late wake beside it).
    import gc

    origin = time.perf_counter()
    probe = LatenessProbe(clock_origin=origin)
    time.sleep(0.05)
    at = time.perf_counter() - origin
    gc.collect()  # generation 2
    after = time.perf_counter() - origin
    time.sleep(0.05)
    probe.stop()
    seen = probe.summary()
    assert seen.gc_collections >= 1
    assert any(at - 0.001 <= t <= after and g == 2 and ms > 0  # times rounded to 1 ms
               for t, ms, g in seen.gc_worst), (at, after, seen.gc_worst)
    assert [ms for _, ms, _ in seen.gc_worst] == sorted((ms for _, ms, _ in seen.gc_worst),
                                                         reverse=True)
    assert probe.summary(since_s=after + 0.01).gc_collections < seen.gc_collections
    assert probe._collected not in gc.callbacks  # stop() takes the callback back
    assert seen.as_dict()["gc_worst"][0] == list(seen.gc_worst[0])


def test_the_probe_lists_the_sources_compiled_while_it_runs() -> None:
    probe = LatenessProbe()
    compile("x = 1\n" + "# padding\n" * 300, "big_module.py", "exec")  # about 3 KB
    compile("y = 2\n", "small.py", "exec")  # under 1 KB: not listed
    probe.stop()
    compile("z = 3\n" + "# padding\n" * 300, "after.py", "exec")  # stopped: not listed
    seen = probe.summary()
    assert seen.compiles == 1 and seen.compiles_largest[0][2] == "big_module.py"
    assert seen.compiled_kb == pytest.approx(len("x = 1\n" + "# padding\n" * 300) / 1024, abs=0.1)


def _hold(done: threading.Event) -> None:
    compile("x = 1\n" * 100_000, "<held>", "exec")  # the GIL held for the whole compile
    done.wait(5)  # still in this function as the probe wakes


def test_a_late_wake_notes_the_frames_of_the_thread_that_held_the_gil() -> None:
    probe = LatenessProbe()
    time.sleep(0.05)
    done = threading.Event()
    holder = threading.Thread(target=_hold, args=(done,), name="holder")
    holder.start()
    time.sleep(0.3)
    probe.stop()
    done.set()
    holder.join()
    notes = probe.summary().snapshots
    late = [n for n in notes if n[1] == "late wake"]
    assert late and late[0][2] == max(n[2] for n in notes) > 20  # longest first
    threads = dict(late[0][3])
    assert threads["holder"].startswith("_hold (test_lateness.py:")
    assert "hotswap-lateness" not in threads  # the probe's own thread is left out
    assert probe.summary().as_dict()["stall_stacks"][0][3] == [list(t) for t in late[0][3]]


def test_a_call_past_its_limit_is_noted_once_with_the_callers_frames() -> None:
    probe = LatenessProbe()
    calling: list[float | None] = [None]
    probe.watch_calls(lambda: calling[0], 0.02)
    calling[0] = time.perf_counter()  # a call of 100 ms
    time.sleep(0.1)
    calling[0] = None
    calling[0] = time.perf_counter()  # one of 5 ms: under the limit
    time.sleep(0.005)
    calling[0] = None
    time.sleep(0.02)
    probe.stop()
    slow = [n for n in probe.summary().snapshots if n[1] == "slow call"]
    assert len(slow) == 1 and 20 <= slow[0][2] < 60
    assert dict(slow[0][3])["MainThread"].startswith(
        "test_a_call_past_its_limit_is_noted_once_with_the_callers_frames (test_lateness.py:")


def test_once_full_the_probe_keeps_its_longest_notes(monkeypatch: pytest.MonkeyPatch) -> None:
    from hotswap.tools import lateness

    monkeypatch.setattr(lateness, "SNAPSHOTS", 2)
    probe = LatenessProbe(interval_s=10)
    probe.stop()
    for ms in (5, 9, 7, 6):
        probe._note(time.perf_counter(), "late wake", ms / 1e3)
    assert sorted(n[2] for n in probe.summary().snapshots) == [7, 9]
