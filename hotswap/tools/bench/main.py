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
  largest call      the slowest call after the first one, up to and with the final code's first
                    100 calls (an idle caller: its first one): did a compile, a swap or the
                    final code's first call stall a call?
  probe lateness    (in the targets) how late a thread in the serving process that wakes every
                    millisecond woke after the first call, and during it: how long anything
                    held the GIL or the CPU (tools/lateness.py). --json keeps each row's worst
                    wakes and slowest calls in seconds from process start; with
                    HOTSWAP_PROFILE_DIR set, scripts/stall_timeline.py puts them beside the stages
  steady            median latency once final (CPU: wall-clock median; CUDA: do_bench)
  eager             the eager model's median latency, timed after everything else
  RSS               peak of the row's process plus its compile workers, sampled every 50 ms
  final MiB         resident memory once the final tier serves: the serving process, the
                    processes it started (compile workers, idle now) and theirs
  idle MiB          the same once idle workers have exited (rows run with
                    HOTSWAP_WORKER_IDLE_EXIT_S=2 unless set; the default is 300 s)
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
code <= 0.3x its cold run and <= 1.2x dynamo + eager first output; a warm restart (--warm)
compiled <= 0.9x torch.compile's warm first call, its first output <= 1.05x dynamo + eager's
warm (its rows' largest calls too); largest call <= 2x eager + 10 ms; async first call <=
0.1x PyTorch async's; dispatch overhead <= 2 us; memory once the idle workers exit <= 1.3x
torch.compile's once compiled; async compiled on a cluster <= 1.0x
torch.compile's first call; the first process ever, starting the compile service
(@service-first), compiled <= 0.9x torch.compile's first call, and a process with the service
warm (@service: started and given another model to compile before the rows) <= 0.7x;
progressive autotuned on cuda:1 reaches its final tier <= 1.0x in-process max-autotune. The
@cluster rows use --cluster (default: a one-worker LocalCluster on this machine, started and
warmed before the rows: on one box it competes for the caller's cores, a simulation of a
compile machine). The table and the targets go to stdout, progress to stderr; --check makes a
missed target exit 1.

--service runs the service benchmark instead (hotswap.tools.bench.loadtest): per variant a
FastAPI server on uvicorn in a fresh process with cold caches, an httpx client sending
--rate requests/s from the moment it is launched for --duration-s, open loop (requests sent
before it listens are refused). Per variant: the time to its first answer from launch;
p50/p99/max per --window-s window; when p99 settled (from that window on every window
answered all its requests with p99 <= 1.1x the final p99, that of the last 3 windows); and
per model serve-MODEL.png (latency over time) and serve-MODEL.json (every request) in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from hotswap.tools.bench.loadtest import DEFAULT_VARIANTS, VARIANTS
from hotswap.tools.bench.report import machine, missed, report, write_markdown
from hotswap.tools.bench.row import BENCH_MODELS, bench_models, dispatch_overhead, run_row
from hotswap.tools.bench.spawn import spawn_row, stop_service, warm_service
from hotswap.tools.common import cuda_available, standalone, subcommand

ROWS = {
    "hotswap:async": "eager at once, then the default tier",
    "hotswap:progressive": "eager, default, then max-autotune",
    "hotswap:async@cluster": "async, compiled on a Dask cluster (--cluster)",
    "hotswap:async@service": "async, compiled by the machine's compile service, running and "
                             "warm (it compiled another model first)",
    "hotswap:async@service-first": "async, the first process ever: it starts the compile "
                                   "service, which compiles its graph",
    "hotswap:progressive@service": "progressive, compiled by the machine's compile service, "
                                   "running and warm",
    "hotswap:progressive@gpu1": "progressive, workers compile and autotune on cuda:1",
    "hotswap:subprocess": "first call waits for the worker",
    "hotswap:inprocess": "inductor in this process",
    "torch:default": "torch.compile()",
    "torch:max-autotune": "torch.compile(mode='max-autotune-no-cudagraphs')",
    "torch:eager-backend": "torch.compile(backend='eager'): dynamo trace + eager call",
    "pytorch:async+subprocess": "TORCHINDUCTOR_FX_COMPILE_MODE",
    "pytorch:progressive+subprocess": "TORCHINDUCTOR_FX_COMPILE_MODE",
    "machine:busy-eager": "eager calls while every core runs a spinner at the workers' priority",
}


def _local_cluster() -> tuple[Any, str, float]:
    """A one-worker Dask cluster on this machine, warmed (torch imported, a first compile's
    set-up paid) before any row starts: a fleet's cluster runs before a replica starts. On
    one box it shares the caller's cores: a simulation of a compile machine, not one."""
    from hotswap.fleet import LocalCluster

    start = time.monotonic()
    cluster = LocalCluster(1)
    took = time.monotonic() - start
    print(f"  Dask cluster {cluster.scheduler_address}: 1 worker, started and warmed in "
          f"{took:.1f} s (before the rows, on no row's clock)", file=sys.stderr)
    return cluster, cluster.scheduler_address, took


def _timed_row(row: str, args: argparse.Namespace, *, again: str = "") -> dict[str, Any]:
    label = f"{row} ({again})" if again else row
    print(f"  running {label} ...", end="", flush=True, file=sys.stderr)
    start = time.monotonic()
    result = spawn_row(row, args, again=again)
    print(f" {time.monotonic() - start:.0f} s{' (failed)' if 'error' in result else ''}",
          flush=True, file=sys.stderr)
    return result


# --quick, by device. CUDA: hotswap's serving modes and torch's on a tiny matmul+relu, under
# 10 minutes on an H200.
# CPU (every row a fresh process importing torch, ~3 s, and compiling mlp, ~10 s on 2 cores):
# the baselines and hotswap's two serving modes, no dispatch row (~13 s more), ~90 s, with one
# intra-op thread fewer than cores (unless --threads says): with every core the caller's, its
# spinning OpenMP threads starve the gate's measurements (docs/scheduling.md), and on the
# 2-core box progressive was not final within the 60 s per row (141 s in all, against 88 s).
QUICK = {
    "cuda": {"models": "matmul-relu", "timeout_s": 45.0, "dispatch": True,
             "rows": "hotswap:async,hotswap:progressive,torch:eager-backend,torch:default,"
                     "torch:max-autotune,pytorch:async+subprocess,pytorch:progressive+subprocess"},
    "cpu": {"models": "mlp", "timeout_s": 60.0, "dispatch": False, "spare_core": True,
            "rows": "torch:eager-backend,torch:default,hotswap:async,hotswap:progressive"},
}


def quick_preset(device: str) -> dict[str, Any]:
    """The --quick preset for ``device`` ("cuda", "cuda:N" or "cpu")."""
    return QUICK["cuda" if device.startswith("cuda") else "cpu"]


def _describe(preset: dict[str, Any]) -> str:
    return (f"{preset['models']}, rows {preset['rows'].replace(',', ', ')}, "
            f"{preset['timeout_s']:g} s per row"
            + ("" if preset["dispatch"] else ", no dispatch row")
            + (", one intra-op thread fewer than cores" if preset.get("spare_core") else ""))


def spare_core_threads() -> int:
    """One intra-op thread fewer than the cores this process may use (at least one)."""
    from hotswap.system.proctree import usable_cores

    return max(1, usable_cores() - 1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="mlp",
                        help=f"comma list of zoo models (default mlp); one of {list(BENCH_MODELS)}, "
                             "or corpus:NAME for a real model of hotswap.tools.corpus")
    parser.add_argument("--rows", default=",".join(r for r in ROWS if "@" not in r),
                        help="comma list of rows (default all but the @ ones, which need the "
                             "fleet extra or a second GPU): " + ", ".join(ROWS))
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
                        help="a preset by device. On CUDA, under 10 minutes on an H200: "
                             f"{_describe(QUICK['cuda'])}. On the CPU, the baselines and the "
                             "two serving modes in under 2 minutes on 2 cores: "
                             f"{_describe(QUICK['cpu'])}")
    parser.add_argument("--no-dispatch", dest="dispatch", action="store_false",
                        help="skip the dispatch-overhead measurement (a process of its own)")
    parser.add_argument("--json", default=None, help="also write all results to this file")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a target it measured was missed or a row failed "
                             "(for CI); targets of rows not run are not checked")
    parser.add_argument("--write-md", default=None, metavar="PATH",
                        help="write the tables into PATH (e.g. BENCHMARKS.md), replacing the "
                             "earlier section of this device and caller (and --threads)")
    parser.add_argument("--cluster", default="local",
                        help="the @cluster rows' Dask scheduler (dask://host:port), or 'local' "
                             "(default): one LocalCluster worker process on this machine, "
                             "started and warmed before the rows, off every row's clock")
    service = parser.add_argument_group(
        "the service benchmark (--service)",
        "A real HTTP inference server (FastAPI on uvicorn) per variant, each a fresh process\n"
        "with cold caches, driven by an httpx client at a fixed rate from the moment it is\n"
        "launched: every request's latency, p50/p99/max per window, when p99 settles, a plot.\n"
        "--models, --device, --workers and --threads apply to it too; the rows' other flags\n"
        "do not. Needs the serve-bench extra (pip install -e '.[serve-bench]').")
    service.add_argument("--service", action="store_true",
                         help="run the service benchmark instead of the rows")
    service.add_argument("--variants", default=DEFAULT_VARIANTS,
                         help=f"comma list (default {DEFAULT_VARIANTS}): "
                              + "; ".join(f"{k}: {v}" for k, v in VARIANTS.items()))
    service.add_argument("--rate", type=float, default=20.0,
                         help="requests per second, sent whether or not earlier ones were "
                              "answered (open loop; default 20)")
    service.add_argument("--duration-s", type=float, default=120.0,
                         help="how long each server is driven, from its launch (default 120)")
    service.add_argument("--window-s", type=float, default=10.0,
                         help="the windows of p50/p99/max and of the settle time (default 10)")
    service.add_argument("--out", default="hotswap-serve-bench", metavar="DIR",
                         help="where serve-MODEL.json (every request), serve-MODEL.png "
                              "(latency over time) and each server's log go (default "
                              "./hotswap-serve-bench)")
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if not args.row:
        # This harness compiles nothing; each row's process is the program measured, and
        # starts its workers as hotswap's defaults say, or as the caller set them (row_env).
        args.start_early = os.environ.get("HOTSWAP_START_EARLY")
        os.environ["HOTSWAP_START_EARLY"] = "off"  # before torch is imported (service/early.py)
    if args.device is None:
        args.device = "cuda" if cuda_available() else "cpu"
    if args.service:
        from hotswap.tools.bench import loadtest

        return loadtest.run(args)
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
        preset = quick_preset(args.device)
        args.models, args.rows, args.timeout_s = preset["models"], preset["rows"], preset["timeout_s"]
        args.dispatch = args.dispatch and preset["dispatch"]
        if preset.get("spare_core") and args.threads is None:
            args.threads = spare_core_threads()
            print(f"--quick on the CPU: {args.threads} intra-op thread(s) per row, one fewer "
                  "than cores (--threads to choose)", file=sys.stderr)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; choose from {list(ROWS)}")
    models = bench_models(args.models)
    everything: dict[str, Any] = {"machine": machine(), "rows": [], "dispatch": {}}
    cluster = None
    if any(r.endswith("@cluster") for r in rows) and args.cluster == "local":
        cluster, args.cluster, everything["cluster_start_s"] = _local_cluster()
    service = None
    if any(r.endswith("@service") for r in rows):
        service = tempfile.TemporaryDirectory(prefix="hotswap-bench-service-")
        args.service_dir = os.path.join(service.name, "service")
        everything["service_start_s"] = warm_service(args)
    sections: list[tuple[str, list[str]]] = []
    for model in models:
        args.model = model
        print(f"\n== {model} on {args.device} (each row a fresh process, cold caches) ==",
              file=sys.stderr)
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
    if cluster is not None:
        cluster.close()
    if service is not None:
        stop_service({**os.environ, "HOTSWAP_SERVICE_DIR": args.service_dir})
        service.cleanup()
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
        print(f"\nwrote the {section} section of {args.write_md}", file=sys.stderr)
    misses = [line for _, lines in sections for line in missed(lines)]
    if args.check and misses:
        print(f"\nhotswap bench --check: {len(misses)} target(s) missed or row(s) failed:\n  "
              + "\n  ".join(misses), file=sys.stderr)
        return 1
    return 0


def add_parser(sub: Any) -> None:
    subcommand(sub, "bench", "hotswap's modes vs torch.compile and PyTorch's modes", __doc__,
               add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    return standalone("hotswap bench", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
