"""Benchmark: hotswap's WorkerPool vs concurrent.futures.ProcessPoolExecutor (spawn), one run.

Both pools pre-import torch and inductor in their workers. Printed side by side:
  start -> ready     first worker able to run a job (spawn + torch import)
  round trip         submit -> result of a no-op job, median over sequential calls (1 KB, 10 MB)
  throughput         no-op jobs per second, many in flight, 2 workers
  crash -> ready     a worker is SIGKILLed mid-job -> the pool can run jobs again
                     (ProcessPoolExecutor breaks for good: it is re-created)
Targets (issue): round trip (1 KB) <= 1.5x ProcessPoolExecutor's; crash recovery < 5 s.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from hotswap import WorkerCrashed, WorkerPool
from hotswap.testing.faults import echo, sigkill

WARM = ("torch", "torch._inductor.compile_fx")


def _warm() -> None:
    import torch._inductor.compile_fx  # noqa: F401


def _ppe(workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_warm)


def _median_ms(fn: Callable[[], Any], n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def bench_hotswap(args: argparse.Namespace) -> dict[str, float]:
    out: dict[str, float] = {}
    t = time.perf_counter()
    pool = WorkerPool(args.workers, warm_modules=WARM)
    pool.submit("hotswap.testing.faults:echo", 0).result()
    out["start_ready_s"] = time.perf_counter() - t
    pool.wait_ready()
    small, big = b"x" * 1024, b"x" * (10 * 2**20)
    for payload in (small, big):  # warm the path
        pool.submit("hotswap.testing.faults:echo", payload).result()
    out["rtt_1k_ms"] = _median_ms(lambda: pool.submit("hotswap.testing.faults:echo", small).result(),
                                  args.n)
    out["rtt_10m_ms"] = _median_ms(lambda: pool.submit("hotswap.testing.faults:echo", big).result(),
                                   max(5, args.n // 20))
    t = time.perf_counter()
    wait([pool.submit("hotswap.testing.faults:echo", i) for i in range(args.jobs)])
    out["jobs_per_s"] = args.jobs / (time.perf_counter() - t)
    t = time.perf_counter()
    try:
        pool.submit("hotswap.testing.faults:sigkill").result()
    except WorkerCrashed:
        pass
    pool.wait_ready()
    pool.submit("hotswap.testing.faults:echo", 0).result()
    out["crash_ready_s"] = time.perf_counter() - t
    pool.shutdown()
    return out


def bench_ppe(args: argparse.Namespace) -> dict[str, float]:
    out: dict[str, float] = {}
    t = time.perf_counter()
    ppe = _ppe(args.workers)
    ppe.submit(echo, 0).result()
    out["start_ready_s"] = time.perf_counter() - t
    # Let every worker finish its start-up so the round trips below do not race it.
    wait([ppe.submit(echo, i) for i in range(args.workers * 4)])
    small, big = b"x" * 1024, b"x" * (10 * 2**20)
    for payload in (small, big):
        ppe.submit(echo, payload).result()
    out["rtt_1k_ms"] = _median_ms(lambda: ppe.submit(echo, small).result(), args.n)
    out["rtt_10m_ms"] = _median_ms(lambda: ppe.submit(echo, big).result(), max(5, args.n // 20))
    t = time.perf_counter()
    futures: list[Future[Any]] = [ppe.submit(echo, i) for i in range(args.jobs)]
    wait(futures)
    out["jobs_per_s"] = args.jobs / (time.perf_counter() - t)
    t = time.perf_counter()
    try:
        ppe.submit(sigkill).result()
    except BrokenProcessPool:
        pass
    ppe.shutdown()
    ppe = _ppe(args.workers)
    ppe.submit(echo, 0).result()
    out["crash_ready_s"] = time.perf_counter() - t
    ppe.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--n", type=int, default=200, help="sequential round trips (1 KB)")
    parser.add_argument("--jobs", type=int, default=2000, help="jobs for the throughput row")
    args = parser.parse_args()
    hs, ppe = bench_hotswap(args), bench_ppe(args)
    rows = [
        ("worker start -> ready (torch)", "start_ready_s", "s", None),
        ("round trip, 1 KB no-op", "rtt_1k_ms", "ms", "<= 1.5x"),
        ("round trip, 10 MB no-op", "rtt_10m_ms", "ms", None),
        ("no-op throughput", "jobs_per_s", "jobs/s", None),
        ("crash -> ready again", "crash_ready_s", "s", "< 5 s"),
    ]
    print(f"{'':32}{'hotswap':>12}{'PPE(spawn)':>12}{'':8}{'ratio':>8}  target")
    for label, key, unit, target in rows:
        ratio = hs[key] / ppe[key]
        verdict = ""
        if key == "rtt_1k_ms":
            verdict = "met" if ratio <= 1.5 else "MISSED"
        elif key == "crash_ready_s":
            verdict = "met" if hs[key] < 5 else "MISSED"
        print(f"{label:<32}{hs[key]:>12.3f}{ppe[key]:>12.3f} {unit:<7}{ratio:>8.2f}x  "
              f"{target or ''} {verdict}")


if __name__ == "__main__":
    main()
