"""Memory of several serving processes on one machine: with the compile service, the workers'
memory is paid once; with each process's own pool (HOTSWAP_SERVICE=off), once per process.

    python scripts/four_processes.py [--processes 4] [--model mlp] [--device cpu] [--logs DIR]

Per way: N processes start at once (fresh caches each, a shared fresh service folder), compile
the model with hotswap.compile(mode="async") and call it until the compiled tier serves; then,
with every one of them serving and the service's workers all started and idle, the resident
memory of the serving processes, of the compile service's process tree and of the processes'
own workers is summed (psutil RSS; pages shared between processes count in each). Also one
serving process alone with the service warm, the base of the target: total <= N x one serving
process alone + one service.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import psutil

# This harness compiles nothing; its children are the programs measured (started with hotswap's
# default: their workers, or the service, start as they import hotswap).
os.environ["HOTSWAP_START_EARLY"] = "off"
from hotswap.system.proctree import descendants

CHILD = r"""
import sys, time
import torch
import hotswap
from hotswap.tools import zoo

work = zoo.make(sys.argv[1], device=sys.argv[2])
compiled = hotswap.compile(work.target, mode="async")
deadline = time.monotonic() + 600
with torch.no_grad():
    while time.monotonic() < deadline:
        compiled(*work.inputs(0))
        if all(s.final and s.tier != "eager" for s in hotswap.status(compiled)):
            break
        time.sleep(0.01)
print("SERVING", flush=True)
sys.stdin.read()  # serve (idle) until the parent closes our stdin
"""

MIB = 1024 * 1024


def _rss(pid: int) -> int:
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:  # gone meanwhile
        return 0


def _wait_service_settled(env: dict[str, str], timeout_s: float = 180.0) -> None:
    """Until the service's workers are all started, ready and idle (the same for 3 s): it keeps
    workers warm with no job, started one after another, so a process served by the first can
    be measured while the second still starts, which would count a part of the service."""
    deadline, seen, since = time.monotonic() + timeout_s, None, time.monotonic()
    while time.monotonic() < deadline:
        out = subprocess.run([sys.executable, "-m", "hotswap.cli", "service", "status", "--json"],
                             env=env, capture_output=True, text=True, timeout=60, check=False)
        try:
            status = json.loads(out.stdout)
        except ValueError:
            status = {}
        workers = status.get("workers", []) if status.get("running") else []
        now = (len(workers), bool(workers) and all(w["ready"] and not w["busy"]
                                                   for w in workers))
        if now != seen:
            seen, since = now, time.monotonic()
        elif now[1] and time.monotonic() - since >= 3.0:
            return
        time.sleep(0.5)
    raise SystemExit(f"the compile service's workers did not settle in {timeout_s:g} s: {seen}")


def _run(n: int, model: str, device: str, service: str, root: str,
         logs: str | None = None) -> dict[str, float]:
    env_base = {**os.environ, "HOTSWAP_SERVICE": service, "HOTSWAP_START_EARLY": "on",
                "HOTSWAP_SERVICE_DIR": os.path.join(root, "service")}
    procs = []
    for i in range(n):
        own = os.path.join(root, f"p{i}")
        os.makedirs(os.path.join(own, "tmp"), exist_ok=True)
        env = {**env_base, "TMPDIR": os.path.join(own, "tmp"),
               "TORCHINDUCTOR_CACHE_DIR": os.path.join(own, "inductor"),
               "TRITON_CACHE_DIR": os.path.join(own, "triton"),
               "HOTSWAP_CACHE_DIR": os.path.join(own, "hotswap")}
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD, model, device], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    try:
        for p in procs:
            line = p.stdout.readline() if p.stdout is not None else ""
            if "SERVING" not in line:
                raise SystemExit(f"a process did not reach its compiled tier: {line!r}")
        if service == "on":
            _wait_service_settled(env_base)
        time.sleep(2.0)
        # The service (python -m hotswap.service --dir ...) and its workers: a child of the
        # process that started it, counted apart from that process's own workers.
        in_service: set[int] = set()
        itself = 0  # the service's own process, apart from its workers: what grows with clients
        for proc in psutil.process_iter(["cmdline"]):
            cmd = " ".join(proc.info["cmdline"] or [])
            if "hotswap.service" in cmd and os.path.join(root, "service") in cmd:
                in_service |= {proc.pid, *(d.pid for d in descendants(proc.pid))}
                itself += _rss(proc.pid)
        service_rss = sum(_rss(pid) for pid in in_service)
        serving = sum(_rss(p.pid) for p in procs)
        workers = sum(_rss(d.pid) for p in procs for d in descendants(p.pid)
                      if d.pid not in in_service)
        return {"serving": serving / MIB, "own workers": workers / MIB,
                "service": service_rss / MIB, "total": (serving + workers + service_rss) / MIB,
                "service processes": float(len(in_service)), "service itself": itself / MIB}
    finally:
        for p in procs:
            if p.stdin:
                p.stdin.close()
        for p in procs:
            p.wait(timeout=60)
        subprocess.run([sys.executable, "-m", "hotswap.cli", "service", "stop"], env=env_base,
                       capture_output=True, timeout=60, check=False)
        if logs is not None:  # the service's log: when and why it started each worker
            os.makedirs(logs, exist_ok=True)
            for log in glob.glob(os.path.join(root, "service", "*.log")):
                shutil.copy(log, os.path.join(logs, f"{n}-{service}-{os.path.basename(log)}"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--logs", help="a folder to copy the compile service's logs into")
    args = parser.parse_args()
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="hotswap-four-") as root:
        rows["one process, service"] = _run(1, args.model, args.device, "on", root, args.logs)
    for label, service in ((f"{args.processes} processes, service", "on"),
                           (f"{args.processes} processes, own pools", "off")):
        with tempfile.TemporaryDirectory(prefix="hotswap-four-") as root:
            rows[label] = _run(args.processes, args.model, args.device, service, root,
                               args.logs)
    print(f"{'MiB (RSS)':<28}{'serving':>10}{'own workers':>13}{'service':>10}{'total':>10}"
          f"{'service processes':>19}{'service itself':>16}")
    for label, r in rows.items():
        print(f"{label:<28}{r['serving']:>10.0f}{r['own workers']:>13.0f}{r['service']:>10.0f}"
              f"{r['total']:>10.0f}{r['service processes']:>19.0f}{r['service itself']:>16.0f}")
    one = rows["one process, service"]
    limit = args.processes * one["serving"] + one["service"]
    total = rows[f"{args.processes} processes, service"]["total"]
    print(f"target: {args.processes} processes with the service {total:.0f} MiB <= "
          f"{args.processes} x one serving process {one['serving']:.0f} + one service "
          f"{one['service']:.0f} = {limit:.0f} MiB: {'met' if total <= limit else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
