"""`hotswap` command line. Thin: parses arguments and calls library code."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import hotswap


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
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = torch.get_num_threads()
    print(f"cores this process may use: {cores}; torch intra-op threads: {threads}")
    advice = thread_advice(cores or 1, threads, cuda)
    if advice:
        print(f"  note: {advice}")
    t = time.monotonic()
    with hotswap.WorkerPool(args.workers) as pool:
        ok = pool.wait_ready(timeout_s=args.timeout_s)
        pids = pool.worker_pids()
    if not ok:
        print(f"workers not ready after {args.timeout_s:g} s", file=sys.stderr)
        return 1
    print(f"{len(pids)} workers started and pre-imported torch in {time.monotonic() - t:.2f} s")
    return 0


def thread_advice(cores: int, threads: int, cuda: bool) -> str | None:
    """A CPU model whose intra-op threads fill every core shares them with background compiles:
    its threads wait for each other, and on a VM for a vCPU the host took (~100 ms; docs/scheduling.md)."""
    if cuda or cores < 2 or threads < cores:
        return None
    return (f"a CPU model with {threads} threads on {cores} cores shares them with hotswap's "
            f"background compiles; if its calls stall while a tier compiles (likely on a VM), "
            f"torch.set_num_threads({cores - 1}) leaves a core free "
            f"(hotswap's docs/scheduling.md: 'CPU models that use every core')")


def _cache(args: argparse.Namespace) -> int:
    """ls, verify, clear or stats on the artifact cache (no torch import needed)."""
    from hotswap.cache import ArtifactCache

    # The stamp only matters for loading; listing and checking signatures ignore it.
    cache = ArtifactCache(args.cache_dir)
    if args.action == "ls":
        entries = cache.entries()
        for e in entries:
            used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.used_s))
            print(f"{e.key[:16]}  {e.tier or '-':<28} {e.size_bytes / 1024:10.1f} KiB  used {used}")
        print(f"{len(entries)} entries in {cache.root}")
    elif args.action == "verify":
        bad = cache.verify()
        for key, reason in bad:
            print(f"removed {key[:16]}: {reason}")
        print(f"{len(cache.entries())} entries verified, {len(bad)} removed")
        return 1 if bad else 0
    elif args.action == "clear":
        print(f"removed {cache.clear()} entries from {cache.root}")
    else:
        for name, value in cache.stats().items():
            print(f"{name}: {value}")
    return 0


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
    doctor.add_argument("--workers", type=_positive_int, default=1,
                        help="workers to start (default 1)")
    doctor.add_argument("--timeout-s", type=float, default=120.0,
                        help="give up after this many seconds (default 120)")
    doctor.set_defaults(func=_doctor)
    cache = sub.add_parser("cache", help="inspect or clean the artifact cache")
    cache.add_argument("action", choices=["ls", "verify", "clear", "stats"],
                       help="ls: entries, most recently used first; verify: check every "
                            "signature and checksum, remove bad entries (exit 1 if any); "
                            "clear: remove all; stats: totals")
    cache.add_argument("--cache-dir", default=None,
                       help="default: HOTSWAP_CACHE_DIR, else ~/.cache/hotswap")
    cache.set_defaults(func=_cache)
    from hotswap.tools import bench, corpus_cmd, profile_cmd, stress

    profile_cmd.add_parser(sub)
    stress.add_parser(sub)
    bench.add_parser(sub)
    corpus_cmd.add_parser(sub)
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
