"""Benchmark rows in fresh processes: their cold environments, their launch, the compile
service the @service rows share. Used by the rows (main.py) and the service benchmark
(loadtest.py) alike."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

__all__ = ["cold_env", "row_env", "spawn_row", "stop_service", "warm_service"]


# What a compile leaves on the machine outside hotswap's cache: what a replica (or the
# compile service) has of its own
_COMPILER_CACHES = ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def cold_env(root: str) -> dict[str, str]:
    """This process's environment with inductor's, triton's and hotswap's caches in empty
    directories under ``root``: what a fresh process of a benchmark row starts with. Its
    temporary folder too: inductor precompiles its C++ header under the temporary folder,
    whatever its cache directory, and a CPU row would find the one an earlier row built."""
    os.makedirs(os.path.join(root, "tmp"), mode=0o700, exist_ok=True)
    return {**os.environ, "TMPDIR": os.path.join(root, "tmp"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"),
            "TRITON_CACHE_DIR": os.path.join(root, "triton"),
            "HOTSWAP_CACHE_DIR": os.path.join(root, "hotswap"),
            # idle workers exit after 2 s (default 300): the row measures memory after that
            "HOTSWAP_WORKER_IDLE_EXIT_S": os.environ.get("HOTSWAP_WORKER_IDLE_EXIT_S", "2")}


def row_env(row: str, cache: str, args: argparse.Namespace) -> dict[str, str]:
    """The environment of ``row``'s fresh process: cold caches under ``cache`` (``cold_env``)
    and what the row's name asks for: compile workers started as hotswap is imported in
    hotswap's rows alone (with ``args.workers`` as the default count), PyTorch's compile mode,
    the cluster (``args.cluster``), the compile service (``args.service_dir`` for a warm one;
    a new one under ``cache`` for the first process ever), the second GPU."""
    env = cold_env(cache)
    if not row.startswith("hotswap:"):
        # the harness imports hotswap, the program it stands for would not: no workers
        env["HOTSWAP_START_EARLY"] = "off"
    else:  # as the bench's caller had it (the bench itself starts none: main.run)
        env["HOTSWAP_START_EARLY"] = getattr(args, "start_early", None) or "on"
        if getattr(args, "workers", None):
            env["HOTSWAP_WORKERS"] = str(args.workers)  # the pool started early is used
    if row.startswith("pytorch:"):
        env["TORCHINDUCTOR_FX_COMPILE_MODE"] = row.split(":")[1]
    if row.endswith("@cluster"):
        env["HOTSWAP_EXECUTOR"] = args.cluster
    if "@service" in row:
        env["HOTSWAP_SERVICE"] = "on"
        env["HOTSWAP_SERVICE_DIR"] = (args.service_dir if row.endswith("@service")
                                      else os.path.join(cache, "service"))
    if row.endswith("@gpu1"):
        env["HOTSWAP_WORKER_DEVICES"] = "cuda:1"
    return env


def spawn_row(row: str, args: argparse.Namespace, *, again: str = "",
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one row in a fresh process with empty inductor, triton and hotswap caches. With
    ``again``, run it a second time and report that run: ``"warm"`` on every cache the first
    left, ``"replica"`` on its hotswap cache only (fresh inductor and triton caches: another
    replica of a service). ``env`` overrides (e.g. a HOTSWAP_CACHE_DIR shared by rows)."""
    overrides = env or {}
    label = f"{row} ({again})" if again else row
    with tempfile.TemporaryDirectory(prefix="hotswap-bench-") as cache:
        env = {**row_env(row, cache, args), **overrides}
        cmd = [sys.executable, "-m", "hotswap.tools.bench.main", "--row", row, "--model", args.model,
               "--device", args.device, "--timeout-s", str(args.timeout_s), "--interval-ms",
               str(args.interval_ms), "--floor-s", str(args.floor_s), "--caller", args.caller] + (
                   ["--threads", str(args.threads)] if args.threads else []) + (
                   ["--workers", str(args.workers)] if args.workers else []) + (
                   ["--prepare"] if args.prepare else [])
        for run in range(2 if again else 1):
            if run == 1 and again == "replica":
                fresh = cold_env(os.path.join(cache, "replica"))
                env.update({k: fresh[k] for k in _COMPILER_CACHES})
            try:
                out = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                     timeout=args.timeout_s + 120)
            except subprocess.TimeoutExpired:
                return {"row": label, "error": f"no result within {args.timeout_s + 120:g} s"}
            finally:
                if row.endswith("@service-first"):  # the service this row started
                    stop_service(env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        why = (out.stderr.strip().splitlines() or ["no output on stderr"])[-1][:200]
        return {"row": label, "error": f"exit status {out.returncode}: {why}"}
    result: dict[str, Any] = json.loads(lines[-1])
    result["row"] = label
    return result


def stop_service(env: dict[str, str]) -> None:
    """Stop the compile service of HOTSWAP_SERVICE_DIR in ``env``, if one runs."""
    subprocess.run([sys.executable, "-m", "hotswap.cli", "service", "stop"], env=env,
                   capture_output=True, timeout=60, check=False)


def warm_service(args: argparse.Namespace) -> float:
    """Start the compile service the @service rows share and have it compile a model none of
    them runs ("pointwise"): a service a process started earlier. Off every row's clock.
    The service keeps the caches (and temporary folder) of the process that started it, so
    they live beside ``args.service_dir``, not in that row's own folder, which goes when the
    row ends (with triton writing into it, on CUDA, its removal failed)."""
    t = time.monotonic()
    caches = cold_env(os.path.join(os.path.dirname(args.service_dir), "service-caches"))
    warm = spawn_row("hotswap:async@service", argparse.Namespace(**{**vars(args),
                                                                    "model": "pointwise"}),
                     env={k: caches[k] for k in (*_COMPILER_CACHES, "HOTSWAP_CACHE_DIR")})
    took = time.monotonic() - t
    print(f"  compile service in {args.service_dir}: started and warmed (a pointwise model "
          f"compiled) in {took:.1f} s{'; ' + warm['error'] if 'error' in warm else ''}",
          file=sys.stderr)
    return took
