"""What runs inside one ``hotswap bench`` row's process (bench.py spawns it, cold): build the
model, compile it the row's way, serve it with the row's caller until the final tier serves,
and print one JSON record of the user's clock (from this process's start)."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

from hotswap.testing.load import Spinners
from hotswap.tools.lateness import LatenessProbe
from hotswap.tools.rss import PeakRss

__all__ = ["BENCH_MODELS", "build", "dispatch_overhead", "is_bench_model", "run_row", "wrap_row"]

BENCH_MODELS = ("mlp", "transformer", "matmul-relu", "convnet", "reductions", "pointwise")


def is_bench_model(name: str) -> bool:
    from hotswap.tools import zoo

    return name in BENCH_MODELS or (name.startswith("corpus:") and zoo.known(name))


def bench_models(text: str) -> list[str]:
    """The models of a ``--models`` comma list; SystemExit naming the unknown ones."""
    models = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in models if not is_bench_model(m)]
    if bad:
        raise SystemExit(f"unknown bench models {bad}; choose from {list(BENCH_MODELS)} or "
                         "corpus:NAME (hotswap.tools.corpus)")
    return models


def build(name: str, device: str) -> tuple[Any, tuple[Any, ...]]:
    """A zoo model in inference (bf16 on CUDA, float32 on CPU) and its inputs."""
    from hotswap.tools import zoo

    if not is_bench_model(name):
        raise SystemExit(f"unknown bench model {name!r}; choose from {list(BENCH_MODELS)} "
                         "or corpus:NAME")
    workload = zoo.make(name, device=device, dtype="bfloat16" if device == "cuda" else "float32")
    return workload.target, workload.inputs(0)


def _timer(fn: Any, device: str, budget_ms: float = 300.0) -> float:
    """Median latency in ms: do_bench on CUDA, torch.utils.benchmark on CPU."""
    from hotswap.profiles.bench import benchmark

    return benchmark(fn, device=device, budget_ms=budget_ms).median_ms


def _started_unix_s() -> float:
    import psutil

    return float(psutil.Process().create_time())


def _since_start() -> float:
    """Seconds since this process started (the user's clock)."""
    return time.time() - _started_unix_s()


def run_row(args: argparse.Namespace) -> dict[str, Any]:
    """Runs inside the row's own process. Times are from the process's start."""
    import torch

    row = args.row
    if args.threads:
        torch.set_num_threads(args.threads)
    import hotswap

    prepare_s = None
    if args.prepare and row.startswith("hotswap:") and not row.endswith("inprocess"):
        t = time.monotonic()  # its own column: as the README advises, first thing, no wait
        hotswap.prepare(workers=args.workers, devices=[args.device])
        prepare_s = time.monotonic() - t
    model, inputs = build(args.model, args.device)
    rss = PeakRss(lambda: [os.getpid()], name="hotswap-bench-rss")
    compiled, is_final, spinners = wrap_row(row, model, args)
    before = hotswap.counters()
    ready_s = _since_start()
    idle = args.caller == "idle" and row != "machine:busy-eager"
    sync: Any = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    # From the first call on: the serving process's stalls, whoever holds the GIL
    probe = LatenessProbe(clock_origin=time.perf_counter() - _since_start())
    with torch.no_grad():
        try:
            served = _serve(compiled, inputs, is_final, sync, args, idle=idle,
                            floor=row == "machine:busy-eager", probe=probe)
        finally:
            spinners.stop()
            probe.stop()
        peak_rss = rss.stop()  # its sampling thread takes the GIL: not during the steady timing
        if served.final_s is not None:
            compiled(*inputs)  # an idle caller's first compiled call (a tier's first call
            sync()             # is checked against eager): not part of the steady timing
        steady_ms = (_timer(lambda: compiled(*inputs), args.device)
                     if served.final_s is not None else None)
        # Timed last: a warm-up before the first call would be a phase the row leaves out.
        eager_ms = _timer(lambda: model(*inputs), args.device, 100.0)
    memory: dict[str, float] = {}
    if served.final_s is not None:
        memory = memory_parts()
        if row.startswith("hotswap:"):  # once the idle workers have gone (runtime.py)
            _wait_workers_gone(hotswap.runtime().worker_pids(), timeout_s=30.0)
            memory["idle_total_mib"] = memory_parts()["steady_total_mib"]
    statuses = hotswap.status(compiled) if row.startswith("hotswap:") else []
    return {
        "row": row, "model": args.model, "device": args.device, "eager_ms": eager_ms,
        "caller": "idle" if idle else "busy", "prepare_s": prepare_s, "ready_s": ready_s,
        "first_call_s": served.durations[0], "first_output_s": ready_s + served.durations[0],
        "to_final_s": served.final_s, **served.calls(eager_ms),
        # hotswap rows: process start -> every graph serves compiled code (any tier)
        "to_compiled_s": _compiled_at[0] if _compiled_at else served.final_s,
        # process start -> every graph serves the tier it ends on (None: one ends on eager)
        "to_stays_s": _stays_s(row, served.final_s),
        "steady_ms": steady_ms, "peak_rss_mib": peak_rss / 2**20, **memory,
        # the caller's own first call (dynamo's trace, CUDA's start) apart from what follows
        **probe.summary(since_s=ready_s + served.durations[0]).as_dict(),
        "probe_first_call_max_ms": probe.summary(until_s=ready_s + served.durations[0]).max_ms,
        "timings_s": {k: v for s in statuses for k, v in s.timings_s.items()},
        "counters": {k: v - before.get(k, 0) for k, v in hotswap.counters().items()},
        "tiers": [s.tier for s in statuses],
        "waiting": [[note, at_s] for note, at_s in _waiting.items()],
        # to place a profile's spans (HOTSWAP_PROFILE_DIR, monotonic) on the user's clock
        "pid": os.getpid(), "started_unix_s": _started_unix_s(),
    }


def _wait_workers_gone(pids: list[int], *, timeout_s: float) -> None:
    """Wait until the compile workers ``pids`` have exited and no pool runs a worker. A pool
    stopped for idleness leaves the runtime's list before its workers have exited (it is
    taken out under a lock, then shut down): an empty list alone does not mean they are
    gone."""
    import psutil

    import hotswap

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass

    def alive(proc: psutil.Process) -> bool:
        try:  # (not waited for here: the pool that started it reaps it)
            return bool(proc.status() != psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout_s
    while ((hotswap.runtime().worker_pids() or any(alive(p) for p in procs))
           and time.monotonic() < deadline):
        time.sleep(0.2)


def memory_parts() -> dict[str, float]:
    """Resident memory once the final tier serves, by part: this (serving) process, the
    processes it started (hotswap's compile workers; PyTorch's subprocess compiler) and what
    they started in turn (inductor's compile pool, a C++ compiler)."""
    import psutil

    from hotswap.system.proctree import tree_rss_bytes

    def rss(proc: psutil.Process) -> int:
        try:
            return int(proc.memory_info().rss)
        except psutil.Error:
            return 0

    me = psutil.Process()
    serving = rss(me) / 2**20
    workers = sum(rss(child) for child in me.children()) / 2**20
    # the whole tree, less what was counted above (read a moment earlier)
    theirs = max(0.0, tree_rss_bytes(me.pid) / 2**20 - serving - workers)
    return {"steady_serving_mib": serving, "steady_workers_mib": workers,
            "steady_their_children_mib": theirs, "steady_total_mib": serving + workers + theirs}


# When a hotswap row's graphs all served compiled code first (one row per process), and the
# tiers they served last and since when: once final, when each began serving the tier it
# stays on (a lower tier that arrives after it, kept, changes nothing the caller sees).
_compiled_at: list[float] = []
_serving: list[Any] = [(), None]
# Why a hotswap row's tiers waited, where hotswap said (``GraphStatus.waiting``: e.g. its
# workers starved by the caller and raised to its priority), each once, when first seen.
_waiting: dict[str, float] = {}


def _stays_s(row: str, final_s: float | None) -> float | None:
    """When every graph began serving the tier it ends on: a torch row's final time; None
    where a hotswap row never got final or a graph ends on eager."""
    if not row.startswith("hotswap:"):
        return final_s
    tiers, since = _serving
    return since if final_s is not None and tiers and "eager" not in tiers else None


def wrap_row(row: str, model: Any, args: argparse.Namespace
             ) -> tuple[Any, Callable[[], bool], Spinners]:
    """The row's callable, how to tell its final code serves, and CPU spinners it started."""
    import torch

    import hotswap

    if row.startswith("hotswap:"):
        mode = row.split(":")[1].split("@")[0]  # "@cluster", "@gpu1": bench.py's env
        tiers = ["default", "max-autotune-no-cudagraphs"] if mode == "progressive" else None
        compiled = hotswap.compile(model, mode=mode, tiers=tiers, workers=args.workers)

        def is_final() -> bool:
            statuses = hotswap.status(compiled)
            now = _since_start()  # one clock reading for both: equal where one poll saw both
            if not _compiled_at and statuses and all(s.tier != "eager" for s in statuses):
                _compiled_at.append(now)  # every graph serves compiled code
            for s in statuses:
                if s.waiting:
                    _waiting.setdefault(s.waiting, now)
            tiers = tuple(s.tier for s in statuses)
            if tiers != _serving[0]:
                _serving[:] = [tiers, now]
            return bool(statuses) and all(s.final for s in statuses)

        return compiled, is_final, Spinners(0)
    if row == "torch:eager-backend":
        return torch.compile(model, backend="eager"), lambda: True, Spinners(0)
    if row.startswith("torch:"):
        torch_mode = "max-autotune-no-cudagraphs" if row.endswith("max-autotune") else None
        return torch.compile(model, mode=torch_mode), lambda: True, Spinners(0)
    if row == "machine:busy-eager":
        return model, lambda: False, Spinners(os.cpu_count() or 1)
    from torch._inductor import compile_fx_async

    torch._inductor.config.fx_graph_cache = False
    torch._inductor.config.autotune_local_cache = False
    torch._functorch.config.enable_autograd_cache = False
    if row.startswith("pytorch:async"):
        stats: Any = compile_fx_async._AsyncFxCompile
        stats._reset_stats()
        return torch.compile(model), lambda: bool(stats._stat_compiled_runs > 0), Spinners(0)
    stats = compile_fx_async._ProgressiveFxCompile
    stats._reset_stats()
    return torch.compile(model), lambda: bool(stats._stat_optimized_runs > 0), Spinners(0)


# Calls a busy caller makes once the final tier serves (an idle one makes one), in the row's
# largest call and p99 like those before.
AFTER_FINAL_CALLS = 100


class _Served:
    """The calls a row served until its final code was in (or its time was up), and the
    final code's first ones."""

    def __init__(self) -> None:
        self.durations: list[float] = []
        self.offsets: list[float] = []  # when each call started, s since process start
        self.final_s: float | None = None
        self.served_s = 0.0

    def calls(self, eager_ms: float) -> dict[str, Any]:
        later = sorted(self.durations[1:])
        limit_s = (2 * eager_ms + 10) / 1e3
        slowest = sorted(range(1, len(self.durations)), key=self.durations.__getitem__)[-5:][::-1]
        return {
            "largest_call_ms": max(later, default=0.0) * 1e3, "calls": len(self.durations),
            "served_s": self.served_s,
            "p99_call_ms": later[int(0.99 * (len(later) - 1))] * 1e3 if later else 0.0,
            "calls_over_limit": sum(d > limit_s for d in later),
            # when the slowest calls started (s since process start, as the probe's worst
            # wakes and a profile's spans) and took (ms): matched, they say what stalled them
            "slowest_calls": [(round(self.offsets[i], 3), round(self.durations[i] * 1e3, 2))
                              for i in slowest],
        }


def _serve(compiled: Any, inputs: Any, is_final: Callable[[], bool], sync: Callable[[], Any],
           args: argparse.Namespace, *, idle: bool, floor: bool,
           probe: LatenessProbe | None = None) -> _Served:
    """Call as the row's caller does (busy: every ``interval_ms``; idle: once) until the final
    code serves or the row's time is up. ``probe`` is told of each call in progress, and
    notes the threads' frames in a call slower than twice the median of the calls before the
    tenth, plus 10 ms (the limit of eager's, roughly: those calls run eager in hotswap's rows)."""
    served = _Served()
    start = time.perf_counter()
    origin = start - _since_start()
    deadline = start + (args.floor_s if floor else args.timeout_s)
    calling: list[float | None] = [None]

    def call() -> None:
        calling[0] = t = time.perf_counter()
        compiled(*inputs)
        sync()
        calling[0] = None
        served.durations.append(time.perf_counter() - t)
        served.offsets.append(t - origin)
        if probe is not None and len(served.durations) == 10:
            early = sorted(served.durations[1:])
            probe.watch_calls(lambda: calling[0], 2 * early[len(early) // 2] + 0.010)

    try:
        while time.perf_counter() < deadline:
            if not idle or not served.durations:
                call()
            if is_final():
                served.final_s = _since_start()
                break
            time.sleep(args.interval_ms / 1e3 if not idle else 0.01)
        if served.final_s is not None:
            # The final tier's first calls count too: its first user call pays what a load
            # left for it (the loop used to end at the swap, and missed it).
            for _ in range(1 if idle else AFTER_FINAL_CALLS):
                call()
                time.sleep(args.interval_ms / 1e3 if not idle else 0.0)
    finally:
        served.served_s = time.perf_counter() - start
    return served




def dispatch_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """ns per call through GraphRunner over calling the loaded artifact directly."""
    import timeit

    import torch

    import hotswap

    backend = hotswap.backend(mode="async", workers=args.workers)
    compiled = torch.compile(lambda a: a + 1, backend=backend)
    x = torch.zeros(1)
    compiled(x)
    hotswap.wait(backend, timeout_s=300)
    compiled(x)  # graduates the artifact from its first-call probation
    runner = backend.runners[0]
    direct = runner.serving
    n = 200_000
    via = min(timeit.repeat(lambda: runner(x), number=n, repeat=5)) / n
    raw = min(timeit.repeat(lambda: direct(x), number=n, repeat=5)) / n
    return {"row": "hotswap:dispatch", "runner_ns": via * 1e9, "direct_ns": raw * 1e9,
            "overhead_ns": (via - raw) * 1e9}
