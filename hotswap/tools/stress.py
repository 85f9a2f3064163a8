"""``hotswap stress``: zoo models x modes x repetitions, with callers in threads and faults.

    for each repetition, each mode, each group of ``concurrency`` models (compiled at once):
        callers (``threads`` per model) serve ``calls`` steps, then wait for the final tier under
        a watchdog, then serve a few more; every sampled output is checked against eager
    faults (hotswap.testing) ride on compile jobs and cache reads across the whole run

One artifact cache serves the whole run (repetitions after the first start warm, which is
where corrupt-cache faults land). The report holds, per case, first-output latency, time to the
final tier, calls served per tier, max abs error vs eager, failures by reason and hangs; and
for the run, faults injected vs observed, worker restarts, peak worker RSS and leaked processes.
The run fails (``StressReport.ok``) on any wrong output, hang or leaked process.
"""

from __future__ import annotations

import collections
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

import hotswap
from hotswap import MODES, testing
from hotswap.tools.common import plain
from hotswap.tools.rss import PeakRss

__all__ = ["OBSERVED", "CaseResult", "StressReport", "run_stress"]

# Fault kind -> the counter that must move by exactly as much.
OBSERVED = {"crash": "worker_crashes", "hang": "job_timeouts", "oom": "memory_limit_kills",
            "unpicklable": "serialization_failures", "corrupt-cache": "cache_rejects"}
SINGLE_CALLER = ("training", "adds500")  # state or autograd shared across calls: one thread


@dataclass
class CaseResult:
    model: str
    mode: str
    rep: int
    first_output_s: float | None = None
    to_final_s: float | None = None
    calls: dict[str, int] = field(default_factory=dict)
    max_error: float = 0.0
    tolerance: float = 0.0
    failures: list[tuple[str, str]] = field(default_factory=list)
    hang: str | None = None
    call_errors: list[str] = field(default_factory=list)

    @property
    def wrong(self) -> bool:
        return self.max_error > self.tolerance or bool(self.call_errors)


@dataclass
class StressReport:
    cases: list[CaseResult]
    injected: dict[str, int]
    observed: dict[str, int]
    restarts: int
    peak_worker_rss_bytes: int
    leaked: list[int]
    elapsed_s: float

    @property
    def wrong_outputs(self) -> int:
        return sum(c.wrong for c in self.cases)

    @property
    def hangs(self) -> int:
        return sum(c.hang is not None for c in self.cases)

    @property
    def ok(self) -> bool:
        return not self.wrong_outputs and not self.hangs and not self.leaked

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(wrong_outputs=self.wrong_outputs, hangs=self.hangs, ok=self.ok)
        return data

    def table(self) -> str:
        rows = [("model", "mode", "rep", "first s", "final s", "calls by tier", "max err",
                 "failures", "result")]
        for c in self.cases:
            reasons = collections.Counter(r.split(":")[0] for _, r in c.failures)
            rows.append((c.model, c.mode, str(c.rep), _fmt(c.first_output_s),
                         _fmt(c.to_final_s),
                         " ".join(f"{t}={n}" for t, n in c.calls.items()),
                         f"{c.max_error:.1e}",
                         " ".join(f"{r}x{n}" for r, n in reasons.items()) or "-",
                         "HANG" if c.hang else "WRONG" if c.wrong else "ok"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
                 for r in rows]
        faults = ", ".join(f"{k} {n} injected / {self.observed.get(OBSERVED[k], '-')} observed"
                           if k in OBSERVED else f"{k} {n} injected"
                           for k, n in sorted(self.injected.items())) or "none"
        lines += ["", f"cases: {len(self.cases)}, wrong outputs: {self.wrong_outputs}, hangs: "
                      f"{self.hangs}, leaked processes: {len(self.leaked)}",
                  f"faults: {faults} (injected total {sum(self.injected.values())})",
                  f"worker restarts: {self.restarts}, peak worker RSS: "
                  f"{self.peak_worker_rss_bytes / 2**20:.0f} MiB, elapsed {self.elapsed_s:.1f} s",
                  "result: " + ("PASS" if self.ok else "FAIL")]
        return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _run_case(model: str, mode: str, rep: int, *, device: str, dtype: str, threads: int,
              calls: int, workers: int | None, job_timeout_s: float, case_timeout_s: float,
              cache_dir: str) -> CaseResult:
    import hotswap
    from hotswap.tools import zoo

    workload = zoo.make(model, device=device, dtype=dtype)
    result = CaseResult(model, mode, rep, tolerance=workload.tolerance)
    compiled = hotswap.compile(workload.target, mode=mode, workers=workers, cache_dir=cache_dir,
                               timeout_s=job_timeout_s)
    lock = threading.Lock()
    step_counter = iter(range(10**9))

    def serve(n: int) -> None:
        for _ in range(n):
            with lock:
                step = next(step_counter)
            tiers = [s.tier for s in hotswap.status(compiled)]
            start = time.monotonic()
            try:
                out = workload.step(compiled, step)
            except Exception as e:  # hotswap must never surface a background failure
                with lock:
                    result.call_errors.append(f"{type(e).__name__}: {e}")
                return
            elapsed = time.monotonic() - start
            # Before the first call there is no graph yet: what served it is known after.
            tiers = tiers or [s.tier for s in hotswap.status(compiled)] or ["eager"]
            error = workload.error(out, step) if step < 3 or step % 5 == 0 else 0.0
            with lock:
                if result.first_output_s is None:
                    result.first_output_s = elapsed
                tier = "+".join(sorted(set(tiers)))
                result.calls[tier] = result.calls.get(tier, 0) + 1
                result.max_error = max(result.max_error, error)

    callers = 1 if model in SINGLE_CALLER else threads
    started = time.monotonic()
    if not _join_all([threading.Thread(target=serve, args=(calls,), daemon=True)
                      for _ in range(callers)], case_timeout_s):
        result.hang = "a call did not return"
        return result
    statuses = hotswap.wait(compiled, timeout_s=max(1.0, case_timeout_s
                                                    - (time.monotonic() - started)))
    if not statuses or not all(s.final for s in statuses):
        result.hang = f"not final after {case_timeout_s:g} s: {statuses}"
        return result
    result.to_final_s = time.monotonic() - started
    result.failures = [f for s in statuses for f in s.failures]
    if not _join_all([threading.Thread(target=serve, args=(3,), daemon=True)], 60.0):
        result.hang = "a call on the final tier did not return"
    return result


def _join_all(threads: list[threading.Thread], timeout_s: float) -> bool:
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


def _leaked_processes(grace_s: float = 5.0) -> list[int]:
    """Terminate the shared pools, then list any child process still alive after ``grace_s``."""
    hotswap.shutdown()
    deadline = time.monotonic() + grace_s
    while True:
        alive = [p.pid for p in psutil.Process().children(recursive=True)
                 if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _check_matrix(models: list[str], modes: list[str], **counts: int) -> None:
    from hotswap.tools import zoo

    unknown = sorted(m for m in set(models) if not zoo.known(m)) + sorted(set(modes) - set(MODES))
    if unknown:
        raise ValueError(f"unknown model(s) or mode(s) {unknown}; models: {sorted(zoo.MODELS)}, "
                         f"modes: {list(MODES)}")
    for name, value in counts.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def run_stress(models: list[str], modes: list[str], *, reps: int = 1, concurrency: int = 1,
               threads: int = 1, calls: int = 12, faults: testing.FaultPlan | None = None,
               device: str = "cpu", dtype: str = "float32", workers: int | None = None,
               job_timeout_s: float = 60.0, case_timeout_s: float = 600.0,
               progress: Callable[[str], None] | None = None) -> StressReport:
    """Run the matrix; see the module docstring. ``progress`` gets one line per case."""
    import torch

    import hotswap

    _check_matrix(models, modes, reps=reps, concurrency=concurrency, threads=threads,
                  calls=calls)
    if faults and faults.rates.get("oom") and not os.environ.get("HOTSWAP_WORKER_RSS_LIMIT_BYTES"):
        os.environ["HOTSWAP_WORKER_RSS_LIMIT_BYTES"] = str(4 << 30)  # before pools start
    plan = faults or testing.FaultPlan({})
    start = time.monotonic()
    before = hotswap.counters()
    cases: list[CaseResult] = []
    total = reps * len(modes) * len(models)
    rss = PeakRss(lambda: hotswap.runtime().worker_pids(), interval_s=0.2, each=True,
                  name="hotswap-stress-rss")
    restarts_before = _restarts()
    with tempfile.TemporaryDirectory(prefix="hotswap-stress-") as cache_dir, testing.inject(plan):
        for rep in range(1, reps + 1):
            for mode in modes:
                for i in range(0, len(models), concurrency):
                    group = models[i:i + concurrency]
                    torch._dynamo.reset()  # a new backend per case; no recompile limit hit
                    results: list[CaseResult] = []

                    def one(model: str, mode: str = mode, rep: int = rep,
                            results: list[CaseResult] = results) -> None:
                        results.append(_run_case(
                            model, mode, rep, device=device, dtype=dtype, threads=threads,
                            calls=calls, workers=workers, job_timeout_s=job_timeout_s,
                            case_timeout_s=case_timeout_s, cache_dir=cache_dir))

                    runners = [threading.Thread(target=one, args=(m,), daemon=True)
                               for m in group]
                    finished = _join_all(runners, case_timeout_s + 120)
                    for model in group:
                        if not any(r.model == model for r in results):
                            results.append(CaseResult(model, mode, rep,
                                                      hang="the case did not finish"))
                    for r in sorted(results, key=lambda r: group.index(r.model)):
                        cases.append(r)
                        if progress is not None:
                            verdict = "HANG" if r.hang else "WRONG" if r.wrong else "ok"
                            progress(f"[{len(cases):4d}/{total}] {r.model}/{r.mode} rep {r.rep}: "
                                     f"{verdict}  first {_fmt(r.first_output_s)} s, final "
                                     f"{_fmt(r.to_final_s)} s, faults so far "
                                     f"{sum(plan.injected.values())}")
                    if not finished:
                        break
    restarts = _restarts() - restarts_before
    after = hotswap.counters()
    peak = rss.stop()
    leaked = _leaked_processes()
    return StressReport(cases, dict(plan.injected),
                        {name: after[name] - before.get(name, 0) for name in OBSERVED.values()},
                        restarts, peak, leaked, time.monotonic() - start)


def _restarts() -> int:
    return hotswap.runtime().restarts


def parse_faults(spec: str, *, seed: int = 0, slow_s: float = 0.2) -> testing.FaultPlan:
    """``"crash=0.1,hang=0.02,corrupt-cache=0.5"`` -> FaultPlan (a bare kind means rate 0.1)."""
    rates: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        kind, _, rate = part.partition("=")
        try:
            rates[kind.strip()] = float(rate) if rate else 0.1
        except ValueError as e:
            raise ValueError(f"--inject wants KIND=RATE pairs such as crash=0.1, got {part!r}") from e
    return testing.FaultPlan(rates, seed=seed, slow_s=slow_s)


def add_parser(sub: Any) -> None:
    import argparse

    from hotswap.tools import zoo

    stress = sub.add_parser("stress", help="zoo models x modes x concurrency x injected faults",
                            description=plain(__doc__),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    stress.add_argument("--models", default=",".join(zoo.MODELS),
                        help=f"comma list (default: all of {','.join(zoo.MODELS)}); "
                             "corpus:NAME for a real model of hotswap.tools.corpus")
    stress.add_argument("--modes", default=",".join(MODES), help="comma list (default: all four)")
    stress.add_argument("--reps", type=int, default=1, help="repetitions (default 1)")
    stress.add_argument("--concurrency", type=int, default=1,
                        help="models compiled at once (default 1)")
    stress.add_argument("--threads", type=int, default=1,
                        help="caller threads per model (default 1; training and adds500 use 1)")
    stress.add_argument("--calls", type=int, default=12,
                        help="calls per caller before waiting for the final tier (default 12)")
    stress.add_argument("--inject", default="",
                        help="faults as KIND=RATE,...; kinds: " + ", ".join(testing.FAULT_KINDS)
                             + " (rates per compile job; corrupt-cache per cache read)")
    stress.add_argument("--seed", type=int, default=0, help="fault draw seed (default 0)")
    stress.add_argument("--slow-s", type=float, default=0.2,
                        help="delay of a 'slow' fault (default 0.2)")
    stress.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    stress.add_argument("--dtype", default="float32")
    stress.add_argument("--workers", type=int, default=None, help="pool size (default: auto)")
    stress.add_argument("--job-timeout-s", type=float, default=60.0,
                        help="compile job timeout, which ends 'hang' faults (default 60)")
    stress.add_argument("--case-timeout-s", type=float, default=600.0,
                        help="watchdog per case (default 600)")
    stress.add_argument("--json", default=None, help="also write the report as JSON to this file")
    stress.set_defaults(func=_cli)


def _cli(args: Any) -> int:
    import json
    import sys

    report = run_stress(
        [m.strip() for m in args.models.split(",") if m.strip()],
        [m.strip() for m in args.modes.split(",") if m.strip()],
        reps=args.reps, concurrency=args.concurrency, threads=args.threads, calls=args.calls,
        faults=parse_faults(args.inject, seed=args.seed, slow_s=args.slow_s),
        device=args.device, dtype=args.dtype, workers=args.workers,
        job_timeout_s=args.job_timeout_s, case_timeout_s=args.case_timeout_s,
        progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(report.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=2)
    return 0 if report.ok else 1
