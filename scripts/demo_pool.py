"""hotswap demo: the crash-proof compile worker pool.

Starts a pool of pre-warmed workers (each imports torch and inductor before its first job),
runs jobs that succeed, crash, hang and blow up, and shows that every future resolves, the
broken workers are replaced, and the pool keeps serving. No `if __name__ == "__main__":`
guard on purpose: hotswap workers never re-run the user's script.
"""

import time

from hotswap import HotswapError, WorkerPool

F = "hotswap.testing.faults:"

t0 = time.monotonic()
pool = WorkerPool(2, rss_limit_bytes=1 * 2**30)
pool.wait_ready(timeout_s=120)
ready_s = [w.ready_s - w.started_s for w in pool.workers_info() if w.ready_s is not None]
print(f"{len(ready_s)} workers ready in {time.monotonic() - t0:.2f} s "
      f"(start -> torch+inductor imported: {', '.join(f'{s:.2f} s' for s in ready_s)})")

pool.subscribe(lambda e: print(f"    stage {e.name:<18} {e.elapsed_s * 1e3:6.2f} ms  (pid {e.pid})"))
jobs = [
    ("echo", {"weights": "stay home"}, None),
    ("staged", ["lower", "codegen", "compile"], None),
    ("raise_error", "inductor said no", None),
    ("segfault", None, None),
    ("hang", None, 1.0),
    ("allocate", 2 * 2**30, 30.0),
    ("echo", "still serving", None),
]
for name, payload, timeout_s in jobs:
    t = time.monotonic()
    future = pool.submit(F + name, payload, timeout_s=timeout_s)
    try:
        outcome = f"result {future.result()!r}"
    except HotswapError as e:
        outcome = f"{type(e).__name__}: {e}"
    print(f"{name:<12} {time.monotonic() - t:6.2f} s  {outcome}")

print(f"workers replaced: {pool.restarts}; live workers: {pool.worker_pids()}")
pool.shutdown()
print("shut down cleanly; no worker left behind")
