"""Run a workload with profiling on and write its report.

    hotswap profile [OPTIONS] SCRIPT [ARGS...]   run a Python script (in this process) with
                                               profiling on; ARGS are the script's own
    hotswap profile --model NAME          serve a zoo model in a loop until its ladder is final
    hotswap profile report DIR            re-write the report, trace and plot of a recorded run
    hotswap profile compare A B           compare two recorded runs

Every ``hotswap.compile`` / ``backend="hotswap"`` in the workload records into ``--out`` (it
sets HOTSWAP_PROFILE_DIR). After the workload, pending tiers and the tier comparisons are
awaited (``--wait-s``), then ``--out`` gets the records, ``trace.json``, ``report.txt`` and
``latency.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
import time
from collections.abc import Iterator
from typing import Any

from hotswap.tools.common import plain

__all__ = ["add_parser"]

DEFAULT_OUT = "hotswap-profile"


def add_parser(sub: Any) -> None:
    profile = sub.add_parser(
        "profile", help="profile a script or a zoo model; report, compare",
        description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    profile.add_argument("target", nargs="?", help="SCRIPT, or 'report' / 'compare'")
    profile.add_argument("args", nargs=argparse.REMAINDER,
                         help="the script's arguments, or the run directories")
    profile.add_argument("--model", help="a zoo model instead of a script (see hotswap.tools.zoo; "
                                          "corpus:NAME for a real model of hotswap.tools.corpus)")
    profile.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    profile.add_argument("--dtype", default="float32", help="zoo model dtype (default float32)")
    profile.add_argument("--mode", default="progressive", help="hotswap mode for --model")
    profile.add_argument("--tiers", default=None, help="comma-separated tiers for --model")
    profile.add_argument("--duration-s", type=float, default=120.0,
                         help="--model: stop serving after this long (default 120)")
    profile.add_argument("--calls-after-final", type=int, default=200,
                         help="--model: calls to serve once every tier is settled (default 200)")
    profile.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default "
                                                             f"./{DEFAULT_OUT})")
    profile.add_argument("--wait-s", type=float, default=600.0,
                         help="wait this long for pending tiers after the workload (default 600)")
    profile.add_argument("--torch-profiler", action="store_true",
                         help="also record a torch.profiler trace of the workload and merge it "
                              "(trace_merged.json); heavy on long runs")
    profile.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hotswap.profiles import compare_report, read_records, write_outputs

    if args.target == "report":
        if len(args.args) != 1:
            raise SystemExit("usage: hotswap profile report DIR")
        written = write_outputs(read_records(args.args[0]), args.args[0])
        _print_written(written)
        return 0
    if args.target == "compare":
        if len(args.args) != 2:
            raise SystemExit("usage: hotswap profile compare RUN_A RUN_B")
        a, b = args.args
        print(compare_report(read_records(a), read_records(b), names=(a, b)), end="")
        return 0
    if (args.target is None) == (args.model is None):
        raise SystemExit("give a SCRIPT to run or --model NAME (not both); see --help")
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    os.environ["HOTSWAP_PROFILE_DIR"] = out
    torch_trace = os.path.join(out, "torch_trace.json") if args.torch_profiler else None
    with _torch_profiler(torch_trace):
        status = (_serve_model(args, out) if args.model is not None
                  else _run_script(args.target, args.args))
    import hotswap

    print(f"waiting up to {args.wait_s:g} s for pending tiers and comparisons ...",
          file=sys.stderr)
    hotswap.wait(None, timeout_s=args.wait_s)
    records = hotswap.runtime().finish_profile(out)
    written = write_outputs(read_records(records or out), out, torch_trace=torch_trace)
    written["records"] = records
    _print_written(written)
    return status


@contextlib.contextmanager
def _torch_profiler(path: str | None) -> Iterator[None]:
    if path is None:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        yield
    prof.export_chrome_trace(path)


def _run_script(script: str, argv: list[str]) -> int:
    if not os.path.isfile(script):
        raise SystemExit(f"no such script: {script}")
    saved = sys.argv
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
    return 0


def _serve_model(args: argparse.Namespace, out: str) -> int:
    import torch

    import hotswap
    from hotswap.tools import zoo

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    workload = zoo.make(args.model, device=device, dtype=args.dtype)
    compiled = hotswap.compile(workload.target, mode=args.mode, tiers=args.tiers,
                               profile_dir=out)
    start = time.monotonic()
    last_report = start
    final_at: int | None = None
    step = 0
    worst = 0.0
    while time.monotonic() - start < args.duration_s:
        result = workload.step(compiled, step)
        if step < 3 or step % 100 == 0:  # the eager reference is not free: sample it
            worst = max(worst, workload.error(result, step))
        step += 1
        statuses = hotswap.status(compiled)
        if final_at is None and statuses and all(s.final for s in statuses):
            final_at = step
        if final_at is not None and step - final_at >= args.calls_after_final:
            break
        if time.monotonic() - last_report >= 2.0:
            last_report = time.monotonic()
            tiers = ", ".join(f"{s.graph_id}={s.tier}" + (f" (pending {','.join(s.pending)})"
                                                           if s.pending else "")
                              for s in statuses)
            print(f"{last_report - start:6.1f} s  {step} calls  {tiers}", file=sys.stderr)
    ok = worst <= workload.tolerance
    print(f"{args.model} on {device}: {step} calls in {time.monotonic() - start:.1f} s; max abs "
          f"error vs eager {worst:.2e} ({'ok' if ok else 'ABOVE'} tolerance {workload.tolerance:g})",
          file=sys.stderr)
    return 0 if ok else 1


def _print_written(written: dict[str, str]) -> None:
    for kind, path in written.items():
        print(f"{kind:>13}: {path}")
    if "plot" not in written:
        print("         plot: skipped (matplotlib not installed: pip install 'hotswap[plot]')")
