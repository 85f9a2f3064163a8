"""`hotswap` command line. Thin: parses arguments and calls library code."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hotswap
from hotswap import settings

if TYPE_CHECKING:
    from hotswap.system.bytecode import Bytecode


def _doctor(args: argparse.Namespace) -> int:
    """Print the environment hotswap sees and time a worker's start (torch pre-import)."""
    import torch

    print(f"hotswap {hotswap.__version__}  python {platform.python_version()}  "
          f"torch {torch.__version__}")
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"device: {device}")
    try:
        import triton

        print(f"triton {triton.__version__}")
    except ImportError:
        print("triton: not installed (fine on CPU: inductor emits C++)")
    from hotswap.system.proctree import usable_cores

    cores = usable_cores()
    threads = torch.get_num_threads()
    print(f"cores this process may use: {cores}; torch intra-op threads: {threads}")
    from hotswap.system.cores import can_set_threads

    keep, settable = settings.eager_threads() == "keep", can_set_threads()
    advice = thread_advice(cores, threads, cuda, not keep and settable)
    if advice:
        print(f"  note: {advice}")
    if keep:
        print("eager answers while compile workers run: your intra-op threads "
              "(HOTSWAP_EAGER_THREADS=keep)")
    elif settable:
        print("eager answers while compile workers run: at most the cores the workers leave "
              "(HOTSWAP_EAGER_THREADS=auto)")
    else:
        print("eager answers while compile workers run: your intra-op threads (this torch's "
              "parallel runtime has no per-thread count hotswap can set)")
    from hotswap.system import bytecode

    plan = bytecode.plan(dict(os.environ))  # what the workers started below get
    source_bytes = None
    t = time.monotonic()
    nice, idle = hotswap.runtime().worker_priority  # as compile workers run
    with hotswap.WorkerPool(args.workers, nice=nice, idle=idle,
                            yield_to=settings.worker_yield()) as pool:
        ok = pool.wait_ready(timeout_s=args.timeout_s)
        pids = pool.worker_pids()
        if ok and plan.recompiles:  # what a start compiles: the sources a worker imported
            try:
                source_bytes = pool.submit(bytecode.SOURCE_BYTES_JOB, None,
                                           timeout_s=args.timeout_s).result()
            except hotswap.HotswapError:
                pass  # the line then names no cost
    if not ok:
        print(f"workers not ready after {args.timeout_s:g} s", file=sys.stderr)
        return 1
    print(f"{len(pids)} workers started and pre-imported torch in {time.monotonic() - t:.2f} s")
    rate = bytecode.compile_rate() if source_bytes else None
    for line in bytecode_lines(plan, source_bytes, rate):
        print(line)
    from hotswap.system import own_bytecode
    from hotswap.system.bytecode_fill import cores as usable_cores

    for line in filling_lines(plan, usable_cores(), own_bytecode.install(),
                              own_bytecode.counts()):
        print(line)
    # What status(...).worker_priority will say: whether the workers could get a cgroup.
    print(f"worker priority: {pool.priority_note()}")
    from hotswap.tools.fleet_check import check_executor, check_store

    fleet_ok = True
    if args.executor and args.executor != "local":
        fleet_ok &= check_executor(args.executor, args.timeout_s)
    if args.cache_url:
        fleet_ok &= check_store(args.cache_url)
    return 0 if fleet_ok else 1


def thread_advice(cores: int, threads: int, cuda: bool, lends: bool = True) -> str | None:
    """A CPU model whose intra-op threads fill every core shares them with background compiles:
    its threads wait for each other, and on a VM for a vCPU the host took (~100 ms; docs/scheduling.md).
    ``lends``: hotswap's eager answers leave running workers their cores (HOTSWAP_EAGER_THREADS)."""
    if cuda or cores < 2 or threads < cores:
        return None
    eager = ("its eager answers leave running compile workers their cores "
             "(HOTSWAP_EAGER_THREADS=auto), its compiled tiers use all of its threads"
             if lends else "its eager answers use all of its threads too "
             "(HOTSWAP_EAGER_THREADS=keep)")
    return (f"a CPU model with {threads} threads on {cores} cores shares them with hotswap's "
            f"background compiles; {eager}: if its calls stall while a tier compiles (likely "
            f"on a VM), torch.set_num_threads({cores - 1}) leaves a core free "
            f"(hotswap's docs/scheduling.md: 'CPU models that use every core')")


def bytecode_lines(plan: Bytecode, source_bytes: int | None, rate: float | None) -> list[str]:
    """Whether every start compiles Python sources here and what that costs (``source_bytes``
    a worker imports, at ``rate`` bytes a second), and whether hotswap's bytecode cache
    serves its workers."""
    from hotswap.system.bytecode import usage

    if plan.recompiles is None:
        lines = ["bytecode: fresh processes read torch's bytecode (nothing compiled at start)"]
    else:
        cost = (f": ~{source_bytes / rate:.1f} s a start ({_size(source_bytes)} of source a "
                f"worker imports, compiled here at {_size(rate)}/s)" if source_bytes and rate
                else "")
        lines = [f"bytecode: every fresh process compiles Python sources here "
                 f"({plan.recompiles}){cost}"]
    setting = f"hotswap's bytecode cache (HOTSWAP_PYCACHE={plan.setting})"
    if plan.folder is None:
        return [*lines, f"  {setting}: {plan.note}"]
    files, size = usage(plan.folder)
    lines.append(f"  {setting}: in use by its workers and service, {plan.folder} "
                 f"({_size(size)} in {files} files)")
    if plan.recompiles is not None:
        lines.append(f"  note: your own process compiles them at every start too; "
                     f"PYTHONPYCACHEPREFIX={plan.folder} gives it hotswap's bytecode, or "
                     f"compile the environment's once where it is built (python -m compileall)")
    return lines


def filling_lines(plan: Bytecode, cores: int, own_folder: Path | None,
                  own: dict[str, int]) -> list[str]:
    """How the bytecode cache gets filled on this machine (a filler on ``cores`` of them, or
    the workers as they import), and whether this process read hotswap's own modules there
    (``own_folder``, ``own``: own_bytecode.install() and counts())."""
    from hotswap.system.bytecode import MIN_CPUS
    from hotswap.system.bytecode_fill import processes

    lines = []
    if plan.folder is not None:
        lines.append(
            f"  a first process fills it in {processes(cores)} processes "
            f"at once ({cores} usable cores)" if cores >= MIN_CPUS else
            f"  filled by the workers as they import ({cores} usable cores; in parallel from "
            f"{MIN_CPUS})")
    if own_folder is not None:
        lines.append(f"  hotswap's own modules in this process: {own['read']} read from "
                     f"{own_folder}, {own['compiled']} compiled from source")
    return lines


def _size(n: float | None) -> str:
    """Bytes as people read them (1 KiB = 1024 bytes)."""
    if n is None:
        return "no limit"
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _cache(args: argparse.Namespace) -> int:
    """ls, verify, clear or stats on the artifact cache (no torch import needed). A cache
    that does not exist is reported empty, not created; ls, stats and verify write nothing;
    clear and ``verify --remove`` touch only a folder with hotswap's marker, and only its
    entries (clear: and its folders of compiled Python). A folder that is not a cache, or
    that another user could write, is refused."""
    from hotswap.cache import ArtifactCache
    from hotswap.cache.root import default_cache_dir

    if args.url:  # the fleet store: the same commands, on Redis
        from hotswap.fleet.store import FleetStore, load_fleet_key

        return _cache_commands(args, FleetStore(args.url, load_fleet_key(), None))
    root = args.cache_dir or str(default_cache_dir())
    if not os.path.exists(root) or (os.path.isdir(root) and not os.listdir(root)):
        out: dict[str, object] = {"root": root, "exists": os.path.exists(root), "entries": 0}
        print(json.dumps(out) if args.json else f"no artifact cache at {root} (nothing to "
                                                  f"{args.action})")
        return 0
    # The stamp only matters for loading; listing and checking signatures ignore it.
    writes = args.action == "clear" or args.remove
    return _cache_commands(args, ArtifactCache(root, create=False, read_only=not writes))


def _cache_commands(args: argparse.Namespace, cache: Any) -> int:
    """ls, verify, clear or stats on an ``ArtifactCache`` or a ``FleetStore``."""
    from hotswap.cache import VERDICT_TIER

    if args.verdicts and args.action not in ("ls", "clear"):
        print(f"hotswap cache: --verdicts goes with ls or clear, not {args.action}",
              file=sys.stderr)
        return 2
    if args.remove and args.action != "verify":
        print(f"hotswap cache: --remove goes with verify, not {args.action}", file=sys.stderr)
        return 2
    if args.action == "ls":
        entries = [e for e in cache.entries() if not args.verdicts or e.tier == VERDICT_TIER]
        if args.json:
            print(json.dumps([dataclasses.asdict(e) for e in entries]))
            return 0
        for e in entries:
            used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.used_s))
            print(f"{e.key[:16]}  {e.tier or '-':<28} {_size(e.size_bytes):>11}  used {used}  "
                  f"{e.origin}".rstrip())
        print(f"{len(entries)} entries in {cache.root}")
    elif args.action == "verify":
        bad = cache.verify(remove=args.remove)
        if args.json:
            print(json.dumps({"bad": [{"key": k, "reason": r} for k, r in bad],
                              "removed": len(bad) if args.remove else 0,
                              "entries": len(cache.entries())}))
            return 1 if bad else 0
        for key, reason in bad:
            print(f"{'removed' if args.remove else 'bad'} {key[:16]}: {reason}")
        what = (f"{len(bad)} removed" if args.remove else
                f"{len(bad)} bad" + (" (hotswap removes each when it next reads it; "
                                     "--remove: now)" if bad else ""))
        print(f"{len(cache.entries())} entries verified, {what}")
        return 1 if bad else 0
    elif args.action == "clear":
        removed = cache.clear(VERDICT_TIER if args.verdicts else None)
        what = "gate verdicts" if args.verdicts else "entries"
        side = {} if args.verdicts else _clear_compiled_python(cache)
        print(json.dumps({"removed": removed, **side}) if args.json
              else f"removed {removed} {what} from {cache.root}" + (
                  f", and {_size(side['python_bytes'])} of compiled Python "
                  f"({side['python_files']} files)" if side.get("python_files") else ""))
    else:
        stats = {**cache.stats(), **_compiled_python(cache)}
        if args.json:
            print(json.dumps(stats))
            return 0
        limit = (f"of {_size(stats['max_bytes'])}" if stats["max_bytes"]
                 else "(no limit; HOTSWAP_CACHE_MAX_BYTES sets one)")
        print(f"root: {stats['root']}\nentries: {stats['entries']}\n"
              f"size: {_size(stats['bytes'])} {limit}")
        if "shared_bytes" in stats:  # a local cache: what entries share is stored once
            files = stats["shared_files"]
            print(f"  entries' own bytes: {_size(stats['entry_bytes'])}\n"
                  f"  shared, stored once: {_size(stats['shared_bytes'])} in {files} "
                  f"file{'' if files == 1 else 's'} (inductor's precompiled headers)")
        if stats.get("python_files"):
            print(f"compiled Python: {_size(stats['python_bytes'])} in {stats['python_files']} "
                  f"files ({', '.join(stats['python_folders'])}; outside the size limit, "
                  "removed by clear)")
    return 0


def _compiled_python(cache: Any) -> dict[str, Any]:
    """What a local cache's folders of compiled Python hold (bytecode.side_folders): Python
    bytecode and inductor's templates, which the size limit does not bound; {} for the fleet
    store, which has none."""
    from hotswap.system.bytecode import side_folders, usage

    root = getattr(cache, "root", None)
    if not isinstance(root, Path):
        return {}
    folders = side_folders(root)
    counts = [usage(f) for f in folders]
    return {"python_files": sum(n for n, _ in counts), "python_bytes": sum(b for _, b in counts),
            "python_folders": [f.name for f in folders]}


def _clear_compiled_python(cache: Any) -> dict[str, Any]:
    """Empty a local cache's folders of compiled Python (``_compiled_python``); a folder that
    is not this user's alone is left, with a message."""
    from hotswap.cache.trust import UntrustedPath
    from hotswap.system.bytecode import clear_folder, side_folders

    root = getattr(cache, "root", None)
    if not isinstance(root, Path):
        return {}
    files = size = 0
    for folder in side_folders(root):
        try:
            n, b = clear_folder(folder)
        except (UntrustedPath, OSError) as e:
            print(f"hotswap cache: left {folder}: {e}", file=sys.stderr)
            continue
        files, size = files + n, size + b
    return {"python_files": files, "python_bytes": size}


def _service(args: argparse.Namespace) -> int:
    """start, stop or status of this user's compile service for this build (no torch import).
    Exit 0: it runs (start, status) or was stopped or not running (stop); 1: it is not
    running, or cannot be used (the reason is printed)."""
    from hotswap.service import control
    from hotswap.service.place import authkey, find_place

    try:
        place = find_place(create=args.action == "start")
        if args.action == "start":
            status: dict[str, Any] | None = control.ensure(place, keep=True)
        elif args.action == "stop":
            status = control.stop(place)
        else:
            status = control.probe(place, authkey(place, create=False))
    except FileNotFoundError:
        status = None
    except (PermissionError, control.NotAnswering, control.OtherBuild,
            control.StartFailed) as e:
        print(json.dumps({"running": False, "refused": str(e)}) if args.json
              else f"compile service not usable: {e}")
        return 1
    if args.json:
        print(json.dumps({"running": status is not None and args.action != "stop",
                          **(status or {})}))
    elif status is None:
        print("no compile service running for this build"
              + (" (nothing to stop)" if args.action == "stop" else ""))
    elif args.action == "stop":
        print(f"stopped the compile service {status['stamp']} (pid {status['pid']}; it had "
              f"served {status['jobs_served']} jobs)")
    else:
        workers = status["workers"]
        print(f"compile service {status['stamp']} (pid {status['pid']}) in {status['dir']}\n"
              f"uptime: {status['uptime_s']:.0f} s; exits after {status['idle_exit_s']:g} s "
              f"without a job" + ("" if status.get("first_job_within_s") is None else
                                  f", or {status['first_job_within_s']:g} s after its start "
                                  "if no first job comes (started as hotswap was imported; "
                                  "`hotswap service start` lifts that)") + "\n"
              f"workers: {len(workers)} ({sum(w['ready'] for w in workers)} ready, "
              f"{sum(w.get('warm', False) for w in workers)} warm, "
              f"{sum(w['busy'] for w in workers)} busy)\n"
              f"jobs: {status['jobs_served']} served, {status['jobs_failed']} failed, "
              f"{status['jobs_cancelled']} cancelled, {status['jobs_running']} running\n"
              f"memory: {_size(status['rss_bytes'])} (the service and its workers)")
    return 0 if status is not None or args.action == "stop" else 1


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hotswap", description="torch.compile that never blocks.")
    parser.add_argument("--version", action="version", version=f"hotswap {hotswap.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="check the environment and time a worker start")
    doctor.add_argument("--executor", default=settings.executor(),
                        help="also check this Dask cluster (dask://host:port; default "
                             "HOTSWAP_EXECUTOR): reachable, its workers' builds match this one")
    doctor.add_argument("--cache-url", default=settings.cache_url(),
                        help="also check this fleet store (redis://host:port/db; default "
                             "HOTSWAP_CACHE_URL): the key file, a round trip, a claim")
    doctor.add_argument("--workers", type=_positive_int, default=1,
                        help="workers to start (default 1)")
    doctor.add_argument("--timeout-s", type=float, default=120.0,
                        help="give up after this many seconds (default 120)")
    doctor.set_defaults(func=_doctor)
    cache = sub.add_parser("cache", help="inspect or clean the artifact cache")
    cache.add_argument("action", choices=["ls", "verify", "clear", "stats"],
                       help="ls: entries, most recently used first; verify: check every "
                            "signature and checksum (exit 1 if any is bad; --remove: remove "
                            "those); clear: remove all entries and the compiled Python kept "
                            "beside them (bytecode, inductor's templates); stats: totals. "
                            "ls, stats and "
                            "verify write nothing; clear works only on a folder hotswap "
                            "made a cache (its HOTSWAP_CACHE marker)")
    cache.add_argument("--cache-dir", default=None,
                       help="default: HOTSWAP_CACHE_DIR, else ~/.cache/hotswap")
    cache.add_argument("--url", default=None,
                       help="work on the fleet store at this Redis URL instead (needs "
                            "HOTSWAP_CACHE_KEY_FILE: entries are checked with its key)")
    cache.add_argument("--json", action="store_true", help="print JSON instead of text")
    cache.add_argument("--verdicts", action="store_true",
                       help="ls/clear the benchmark gate's stored verdicts alone (each: the "
                            "tier kept out, its measured gain and confidence); clearing them "
                            "makes the next process measure those tiers again")
    cache.add_argument("--remove", action="store_true",
                       help="with verify: remove the entries that fail")
    cache.set_defaults(func=_cache)
    service = sub.add_parser("service", help="start, stop or show this user's compile service")
    service.add_argument("action", choices=["start", "stop", "status"],
                         help="start: start it unless it runs (HOTSWAP_SERVICE=on starts it "
                              "on demand too); stop: stop it now (its jobs fail over to "
                              "their callers' local pools); status: its build stamp, workers, "
                              "jobs served, uptime and memory")
    service.add_argument("--json", action="store_true", help="print JSON instead of text")
    service.set_defaults(func=_service)
    from hotswap.tools import corpus_cmd, gate_audit, profile_cmd, stress
    from hotswap.tools.bench import fleet as fleet_bench
    from hotswap.tools.bench import main as bench

    profile_cmd.add_parser(sub)
    stress.add_parser(sub)
    bench.add_parser(sub)
    corpus_cmd.add_parser(sub)
    gate_audit.add_parser(sub)
    fleet_bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit status: the command's; 2 for a usage error (argparse's, or a ValueError or OSError
    from checking what was asked: a bad number, a cache path that is a file), with a message
    and no traceback."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, OSError) as e:
        print(f"hotswap {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
