"""``hotswap bench``: hotswap's modes vs torch.compile and PyTorch's own subprocess modes.

Every row runs in a fresh process with empty inductor, triton and hotswap caches (cold), and
every time is on the user's clock, from that process's start, with nothing left out. It
builds a zoo or corpus model and serves it until the final tier serves, with a busy caller
(a call every --interval-ms) or an idle one (--caller idle: the first call, then none):
  ready             process start -> the first call (imports, the model's construction)
  prepare           with --prepare: hotswap.prepare() (no wait) before the model is built, as
                    the README advises (the call's own time; inside ready)
  first out         process start -> the first call's output
  1st call          the first call's latency (dynamo trace + eager run, or + compile)
  compiled          process start -> the final tier serves (torch rows: the first call's end)
  largest call      the slowest call after the first one (did a compile or a swap stall a call?)
  steady            median latency once final (CPU: wall-clock median; CUDA: do_bench)
  eager             the eager model's median latency, timed after everything else
  RSS               peak of the row's process plus its compile workers, sampled every 50 ms
--warm runs each row a second time on every cache its first run left; --replica runs each
hotswap row a second time on its hotswap cache alone (fresh inductor and triton caches: one
more replica of a service).
PyTorch's modes run with the cache switches their tests use (fx_graph_cache,
autotune_local_cache and autograd cache off). ``torch:eager-backend`` (dynamo trace + eager
call) is the baseline for first output. ``machine:busy-eager`` compiles nothing: it serves the
eager model for --floor-s seconds while one spinning process per core runs at the compile
workers' priority, so its largest call is what the machine alone does to a call while a
background compile keeps its cores busy (on some VMs the host takes a busy vCPU away for
~100 ms, whatever runs on it).

Targets: first output <= 1.1x dynamo trace + eager call; async compiled code serving <= 0.9x
torch.compile's first call with an idle caller, <= 1.2x with a busy one; a replica's compiled
code <= 0.3x its cold run and <= 1.2x dynamo + eager first output; largest call <= 2x eager +
10 ms; async first call <= 0.1x PyTorch async's; dispatch overhead <= 2 us.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from hotswap.tools.rss import PeakRss

ROWS = {
    "hotswap:async": "eager at once, then the default tier",
    "hotswap:progressive": "eager, default, then max-autotune",
    "hotswap:subprocess": "first call waits for the worker",
    "hotswap:inprocess": "inductor in this process",
    "torch:default": "torch.compile()",
    "torch:max-autotune": "torch.compile(mode='max-autotune-no-cudagraphs')",
    "torch:eager-backend": "torch.compile(backend='eager'): dynamo trace + eager call",
    "pytorch:async+subprocess": "TORCHINDUCTOR_FX_COMPILE_MODE",
    "pytorch:progressive+subprocess": "TORCHINDUCTOR_FX_COMPILE_MODE",
    "machine:busy-eager": "eager calls while every core runs a spinner at the workers' priority",
}


BENCH_MODELS = ("mlp", "transformer", "matmul-relu", "convnet", "reductions", "pointwise")


def _bench_model(name: str) -> bool:
    from hotswap.tools import zoo

    return name in BENCH_MODELS or (name.startswith("corpus:") and zoo.known(name))


def build(name: str, device: str) -> tuple[Any, tuple[Any, ...]]:
    """A zoo model in inference (bf16 on CUDA, float32 on CPU) and its inputs."""
    from hotswap.tools import zoo

    if not _bench_model(name):
        raise SystemExit(f"unknown bench model {name!r}; choose from {list(BENCH_MODELS)} "
                         "or corpus:NAME")
    workload = zoo.make(name, device=device, dtype="bfloat16" if device == "cuda" else "float32")
    return workload.target, workload.inputs(0)


def _timer(fn: Any, device: str, budget_ms: float = 300.0) -> float:
    """Median latency in ms: do_bench on CUDA, torch.utils.benchmark on CPU."""
    from hotswap.profiles.bench import benchmark

    return benchmark(fn, device=device, budget_ms=budget_ms).median_ms


def _since_start() -> float:
    """Seconds since this process started (the user's clock)."""
    import psutil

    return time.time() - float(psutil.Process().create_time())


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
    compiled, is_final, spinners = _compiled(row, model, args)
    before = hotswap.counters()
    ready_s = _since_start()
    idle = args.caller == "idle" and row != "machine:busy-eager"
    sync: Any = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    with torch.no_grad():
        try:
            served = _serve(compiled, inputs, is_final, sync, args, idle=idle,
                            floor=row == "machine:busy-eager")
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
        peak_rss = rss.stop()  # its sampling thread takes the GIL: not during the steady timing
        if served.final_s is not None:
            compiled(*inputs)  # an idle caller's first compiled call (a tier's first call
            sync()             # is checked against eager): not part of the steady timing
        steady_ms = (_timer(lambda: compiled(*inputs), args.device)
                     if served.final_s is not None else None)
        # Timed last: a warm-up before the first call would be a phase the row leaves out.
        eager_ms = _timer(lambda: model(*inputs), args.device, 100.0)
    return {
        "row": row, "model": args.model, "device": args.device, "eager_ms": eager_ms,
        "caller": "idle" if idle else "busy", "prepare_s": prepare_s, "ready_s": ready_s,
        "first_call_s": served.durations[0], "first_output_s": ready_s + served.durations[0],
        "to_final_s": served.final_s, **served.calls(eager_ms),
        "steady_ms": steady_ms, "peak_rss_mib": peak_rss / 2**20,
        "timings_s": ({k: v for s in hotswap.status(compiled) for k, v in s.timings_s.items()}
                      if row.startswith("hotswap:") else {}),
        "counters": {k: v - before.get(k, 0) for k, v in hotswap.counters().items()},
    }


def _compiled(row: str, model: Any, args: argparse.Namespace
              ) -> tuple[Any, Callable[[], bool], list[subprocess.Popen[bytes]]]:
    """The row's callable, how to tell its final code serves, and CPU spinners it started."""
    import torch

    import hotswap

    if row.startswith("hotswap:"):
        mode = row.split(":")[1]
        tiers = ["default", "max-autotune-no-cudagraphs"] if mode == "progressive" else None
        compiled = hotswap.compile(model, mode=mode, tiers=tiers, workers=args.workers)

        def is_final() -> bool:
            statuses = hotswap.status(compiled)
            return bool(statuses) and all(s.final for s in statuses)

        return compiled, is_final, []
    if row == "torch:eager-backend":
        return torch.compile(model, backend="eager"), lambda: True, []
    if row.startswith("torch:"):
        torch_mode = "max-autotune-no-cudagraphs" if row.endswith("max-autotune") else None
        return torch.compile(model, mode=torch_mode), lambda: True, []
    if row == "machine:busy-eager":
        return model, lambda: False, _spinners(os.cpu_count() or 1)
    from torch._inductor import compile_fx_async

    torch._inductor.config.fx_graph_cache = False
    torch._inductor.config.autotune_local_cache = False
    torch._functorch.config.enable_autograd_cache = False
    if row.startswith("pytorch:async"):
        stats: Any = compile_fx_async._AsyncFxCompile
        stats._reset_stats()
        return torch.compile(model), lambda: bool(stats._stat_compiled_runs > 0), []
    stats = compile_fx_async._ProgressiveFxCompile
    stats._reset_stats()
    return torch.compile(model), lambda: bool(stats._stat_optimized_runs > 0), []


class _Served:
    """The calls a row served until its final code was in (or its time was up)."""

    def __init__(self) -> None:
        self.durations: list[float] = []
        self.offsets: list[float] = []  # s after the first call
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
            # when the slowest calls started (s after the first call) and took (ms): matched
            # against the stage timings, they say what stalled them
            "slowest_calls": [(round(self.offsets[i], 3), round(self.durations[i] * 1e3, 2))
                              for i in slowest],
        }


def _serve(compiled: Any, inputs: Any, is_final: Callable[[], bool], sync: Callable[[], Any],
           args: argparse.Namespace, *, idle: bool, floor: bool) -> _Served:
    """Call as the row's caller does (busy: every ``interval_ms``; idle: once) until the final
    code serves or the row's time is up."""
    served = _Served()
    start = time.perf_counter()
    deadline = start + (args.floor_s if floor else args.timeout_s)
    try:
        while time.perf_counter() < deadline:
            if not idle or not served.durations:
                t = time.perf_counter()
                compiled(*inputs)
                sync()
                served.durations.append(time.perf_counter() - t)
                served.offsets.append(t - start)
            if is_final():
                served.final_s = _since_start()
                break
            time.sleep(args.interval_ms / 1e3 if not idle else 0.01)
    finally:
        served.served_s = time.perf_counter() - start
    return served


def _spinners(count: int) -> list[subprocess.Popen[bytes]]:
    """``count`` processes that spin at the priority hotswap's compile workers run at (same
    niceness, session niceness and ``SCHED_IDLE`` settings)."""
    from hotswap.orchestrator.runtime import worker_priority

    nice, idle = worker_priority()
    code = (f"from hotswap.workers.child import lower_priority\n"
            f"lower_priority({nice}, {idle})\nwhile True: pass")
    return [subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
            for _ in range(count)]


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


def cold_env(root: str) -> dict[str, str]:
    """This process's environment with inductor's, triton's and hotswap's caches in empty
    directories under ``root``: what a fresh process of a benchmark row starts with."""
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"),
            "TRITON_CACHE_DIR": os.path.join(root, "triton"),
            "HOTSWAP_CACHE_DIR": os.path.join(root, "hotswap")}


def spawn_row(row: str, args: argparse.Namespace, *, again: str = "",
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one row in a fresh process with empty inductor, triton and hotswap caches. With
    ``again``, run it a second time and report that run: ``"warm"`` on every cache the first
    left, ``"replica"`` on its hotswap cache only (fresh inductor and triton caches: another
    replica of a service). ``env`` overrides (e.g. a HOTSWAP_CACHE_DIR shared by rows)."""
    overrides = env or {}
    label = f"{row} ({again})" if again else row
    with tempfile.TemporaryDirectory(prefix="hotswap-bench-") as cache:
        env = {**cold_env(cache), **overrides}
        if row.startswith("pytorch:"):
            env["TORCHINDUCTOR_FX_COMPILE_MODE"] = row.split(":")[1]
        cmd = [sys.executable, "-m", "hotswap.tools.bench", "--row", row, "--model", args.model,
               "--device", args.device, "--timeout-s", str(args.timeout_s), "--interval-ms",
               str(args.interval_ms), "--floor-s", str(args.floor_s), "--caller", args.caller] + (
                   ["--threads", str(args.threads)] if args.threads else []) + (
                   ["--workers", str(args.workers)] if args.workers else []) + (
                   ["--prepare"] if args.prepare else [])
        for run in range(2 if again else 1):
            if run == 1 and again == "replica":
                fresh = cold_env(os.path.join(cache, "replica"))
                env.update({k: fresh[k] for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")})
            try:
                out = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                     timeout=args.timeout_s + 120)
            except subprocess.TimeoutExpired:
                return {"row": label, "error": f"no result within {args.timeout_s + 120:g} s"}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"row": label, "error": (out.stderr.strip().splitlines() or ["?"])[-1][:200]}
    result: dict[str, Any] = json.loads(lines[-1])
    result["row"] = label
    return result


def _timed_row(row: str, args: argparse.Namespace, *, again: str = "") -> dict[str, Any]:
    label = f"{row} ({again})" if again else row
    print(f"  running {label} ...", end="", flush=True)
    start = time.monotonic()
    result = spawn_row(row, args, again=again)
    print(f" {time.monotonic() - start:.0f} s{' (failed)' if 'error' in result else ''}",
          flush=True)
    return result


def _fmt(value: Any, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def report(results: list[dict[str, Any]], dispatch: dict[str, Any] | None) -> list[str]:
    """The table and the targets, as lines (printed, and written into BENCHMARKS.md). Every
    time is from the row's process start; ``ready`` is when it made its first call (imports
    and the model's construction), ``prepare`` a ``hotswap.prepare()`` call inside that."""
    by_row = {r["row"]: r for r in results}
    lines = [f"{'row':<34}{'ready s':>8}{'prepare s':>10}{'first out s':>12}{'1st call s':>11}"
             f"{'compiled s':>11}{'largest ms':>11}{'steady ms':>10}{'eager ms':>9}"
             f"{'RSS MiB':>8}"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['row']:<34}  failed: {r['error']}")
            continue
        lines.append(f"{r['row']:<34}{_fmt(r['ready_s']):>8}{_fmt(r.get('prepare_s')):>10}"
                     f"{_fmt(r['first_output_s']):>12}{_fmt(r['first_call_s'], 1, 3):>11}"
                     f"{_fmt(r['to_final_s']):>11}{_fmt(r['largest_call_ms'], 1, 1):>11}"
                     f"{_fmt(r['steady_ms'], 1, 3):>10}{_fmt(r['eager_ms'], 1, 3):>9}"
                     f"{_fmt(r.get('peak_rss_mib'), 1, 0):>8}")

    def ratio_line(label: str, a: str, a_key: str, b: str, b_key: str, target: float) -> None:
        va, vb = by_row.get(a, {}).get(a_key), by_row.get(b, {}).get(b_key)
        if a not in by_row or b not in by_row:
            return  # a row this run did not ask for
        if va is None or vb is None:
            lines.append(f"  {label}: not measured (a row failed or never reached its tier)")
            return
        ratio = va / vb
        lines.append(f"  {label}: {va:.3f} / {vb:.3f} = {ratio:.3f}x (target <= {target}x) "
                     f"{'met' if ratio <= target else 'MISSED'}")

    caller = next((r.get("caller") for r in results  # the torch rows' first call blocks
                   if "error" not in r and r["row"].startswith("hotswap:")), "busy")
    lines += ["", f"targets ({caller} caller; times from process start)"]
    for row in ("hotswap:async", "hotswap:progressive"):
        ratio_line(f"{row} first output vs dynamo trace + eager call", row, "first_output_s",
                   "torch:eager-backend", "first_output_s", 1.1)
    ratio_line("async compiled serving vs torch.compile's first call", "hotswap:async",
               "to_final_s", "torch:default", "to_final_s", 0.9 if caller == "idle" else 1.2)
    ratio_line("progressive final tier vs in-process max-autotune", "hotswap:progressive",
               "to_final_s", "torch:max-autotune", "to_final_s", 1.2)
    for again in ("replica", "warm"):
        for row in ("hotswap:async", "hotswap:progressive"):
            ratio_line(f"{row} {again} compiled serving vs its cold run", f"{row} ({again})",
                       "to_final_s", row, "to_final_s", 0.3)
            ratio_line(f"{row} {again} compiled serving vs dynamo trace + eager call",
                       f"{row} ({again})", "to_final_s", "torch:eager-backend",
                       "first_output_s", 1.2)
    ratio_line("async first call vs PyTorch async's first call", "hotswap:async",
               "first_call_s", "pytorch:async+subprocess", "first_call_s", 0.1)
    for row in ("async", "progressive"):
        ratio_line(f"{row}: hotswap time to final vs PyTorch's {row}+subprocess",
                   f"hotswap:{row}", "to_final_s", f"pytorch:{row}+subprocess", "to_final_s", 1.0)
    for row in ("hotswap:async", "hotswap:progressive", "machine:busy-eager"):
        found = by_row.get(row)
        if found and "error" not in found and found.get("calls", 0) > 1:
            r = found
            limit = 2 * r["eager_ms"] + 10
            over = (f" (p99 {r['p99_call_ms']:.1f} ms; {r['calls_over_limit']} of "
                    f"{r['calls'] - 1} calls over in {r['served_s']:.0f} s)"
                    if "served_s" in r else "")
            floor = by_row.get("machine:busy-eager", {}).get("largest_call_ms")
            verdict = ("the machine alone, no compile" if row == "machine:busy-eager"
                       else "met" if r["largest_call_ms"] <= limit else "MISSED" + (
                           f" (the machine alone, every core busy: {floor:.1f} ms)"
                           if floor is not None and floor > limit else ""))
            lines.append(f"  {row} largest call {r['largest_call_ms']:.1f} ms{over} vs 2x eager "
                         f"+ 10 ms = {limit:.1f} ms: {verdict}")
    if dispatch is not None:
        over = dispatch["overhead_ns"] / 1e3
        lines.append(f"  dispatch overhead: {dispatch['runner_ns']:.0f} ns via hotswap vs "
                     f"{dispatch['direct_ns']:.0f} ns direct = {over:.2f} us (target <= 2 us) "
                     f"{'met' if over <= 2 else 'MISSED'}")
    return lines


QUICK = {"models": "matmul-relu", "timeout_s": 45.0,
         "rows": "hotswap:async,hotswap:progressive,torch:eager-backend,torch:default,"
                 "torch:max-autotune,pytorch:async+subprocess,pytorch:progressive+subprocess"}


def machine() -> dict[str, str]:
    import platform

    import torch

    info = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
            "torch": torch.__version__, "cpus": str(os.cpu_count())}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        info["device"] = platform.processor() or platform.machine()
    return info


def write_markdown(path: str, device: str, sections: list[tuple[str, list[str]]],
                   info: dict[str, str], command: str, tool: str = "hotswap bench") -> None:
    """Replace (or append) this device's ``tool`` section of ``path``."""
    begin, end = f"<!-- {tool}: {device} -->", f"<!-- end {tool}: {device} -->"
    body = [begin, f"### `{tool}` on {info.get('device')} ({device}), {info['date']}", "",
            "torch " + info["torch"] + (f", triton {info['triton']}" if "triton" in info else "")
            + f", Python {info['python']}, {info['cpus']} CPUs. Command: `{command}`", ""]
    for title, lines in sections:
        body += [f"{title}:", "", "```", *lines, "```", ""]
    body.append(end)
    text = "# Benchmarks\n"
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + "\n".join(body) + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(body) + "\n"
    with open(path, "w") as f:
        f.write(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="mlp",
                        help=f"comma list of zoo models (default mlp); one of {list(BENCH_MODELS)}, "
                             "or corpus:NAME for a real model of hotswap.tools.corpus")
    parser.add_argument("--rows", default=",".join(ROWS),
                        help="comma list of rows (default all): " + ", ".join(ROWS))
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--workers", type=int, default=None,
                        help="hotswap pool size (default: hotswap's, one per two cores)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per row (default 300)")
    parser.add_argument("--caller", choices=("busy", "idle"), default="busy",
                        help="busy (default): a call every --interval-ms until the final tier "
                             "serves; idle: the first call, then none until it serves")
    parser.add_argument("--interval-ms", type=float, default=5.0,
                        help="pause between a busy caller's calls (default 5)")
    parser.add_argument("--prepare", action="store_true",
                        help="hotswap rows call hotswap.prepare() (no wait) before building the "
                             "model, as the README advises (its own column, inside 'ready')")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads in each row's process (default: torch's, "
                             "one per core)")
    parser.add_argument("--floor-s", type=float, default=20.0,
                        help="how long the machine:busy-eager row serves (default 20)")
    parser.add_argument("--warm", action="store_true",
                        help="also run each hotswap and torch row a second time on the caches "
                             "its first run left (rows marked 'warm')")
    parser.add_argument("--replica", action="store_true",
                        help="also run each hotswap row a second time on its hotswap cache "
                             "with fresh inductor and triton caches (rows marked 'replica')")
    parser.add_argument("--quick", action="store_true",
                        help="the GPU-in-10-minutes preset: " + ", ".join(
                            f"{k}={v}" for k, v in QUICK.items()))
    parser.add_argument("--no-dispatch", dest="dispatch", action="store_false",
                        help="skip the dispatch-overhead measurement (a process of its own)")
    parser.add_argument("--json", default=None, help="also write all results to this file")
    parser.add_argument("--write-md", default=None, metavar="PATH",
                        help="write the tables into PATH (e.g. BENCHMARKS.md), replacing the "
                             "earlier section of this device and caller (and --threads)")
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.device is None:
        args.device = "cuda" if _cuda() else "cpu"
    if args.row == "hotswap:dispatch":
        print(json.dumps(dispatch_overhead(args)))
        return 0
    if args.row:
        print(json.dumps(run_row(args)))
        return 0
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {args.threads}")
    if args.workers is not None and args.workers < 1:
        raise SystemExit(f"--workers must be >= 1, got {args.workers}")
    if args.floor_s <= 0:
        raise SystemExit(f"--floor-s must be > 0, got {args.floor_s:g}")
    if args.quick:
        args.models, args.rows, args.timeout_s = QUICK["models"], QUICK["rows"], QUICK["timeout_s"]
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; choose from {list(ROWS)}")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if not _bench_model(m)]
    if bad:
        raise SystemExit(f"unknown bench models {bad}; choose from {list(BENCH_MODELS)} or "
                         "corpus:NAME (hotswap.tools.corpus)")
    everything: dict[str, Any] = {"machine": machine(), "rows": [], "dispatch": {}}
    sections: list[tuple[str, list[str]]] = []
    for model in models:
        args.model = model
        print(f"\n== {model} on {args.device} (each row a fresh process, cold caches) ==")
        results = []
        for row in rows:
            results.append(_timed_row(row, args))
            if args.warm and row.split(":")[0] in ("hotswap", "torch"):
                results.append(_timed_row(row, args, again="warm"))
            if args.replica and row.startswith("hotswap:") and not row.endswith("inprocess"):
                results.append(_timed_row(row, args, again="replica"))
        dispatch = spawn_row("hotswap:dispatch", args) if args.dispatch else {"error": "skipped"}
        lines = report(results, dispatch if "error" not in dispatch else None)
        print("\n" + "\n".join(lines))
        sections.append((f"{model} ({args.device})", lines))
        everything["rows"] += results
        everything["dispatch"][model] = dispatch
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=2)
    if args.write_md:
        command = "hotswap bench " + " ".join(
            a for a in sys.argv[1:] if not a.startswith("--write-md") and a != args.write_md)
        # a run with its own thread count keeps a section of its own beside the default one
        section = (f"{args.device}, {args.caller} caller from process start"
                   + (f", threads={args.threads}" if args.threads else ""))
        write_markdown(args.write_md, section, sections, everything["machine"],
                       command.replace("hotswap bench bench", "hotswap bench"))
        print(f"\nwrote the {section} section of {args.write_md}")
    return 0


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("bench", help="hotswap's modes vs torch.compile and PyTorch's modes",
                            description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hotswap bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
