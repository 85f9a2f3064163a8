"""What the in-process path costs the caller, next to the worker path, on one graph.

    scripts/bench_paths [--model transformer] [--device cpu] [--seconds 90] [--interval-ms 2]

A graph that cannot go to a worker compiles in the call that meets it, in the caller's
process; here the same graph is sent down both paths (the in-process row answers the coordinator's
request step with a reason, as a graph that cannot travel does). Each
row is a fresh process with empty inductor and hotswap caches; the caller serves one call
every --interval-ms from its first call until the default tier serves, then 50 more. Printed
per row: the path status() reports, time from process start to compiled code serving, the
first call (on the in-process path it waits for the compile, as with plain torch.compile),
the largest call after it, the p99 of calls while eager served, and eager's median call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any


def _row(path: str, args: argparse.Namespace) -> dict[str, Any]:
    import psutil
    import torch

    import hotswap
    from hotswap.tools import zoo

    workload = zoo.make(args.model, device=args.device)
    model, inputs = workload.target, workload.inputs(0)

    if path == "inprocess":
        # The same graph, sent down the path a graph that cannot travel takes: its inputs
        # are said not to be portable, with a reason, as they are for such a graph.
        from hotswap.engine.shipping import request

        request.portable_inputs = lambda gm, inputs: "forced by bench_paths"  # type: ignore

    compiled = hotswap.compile(model, mode="async", tiers=["default"])
    calls: list[tuple[float, float, str]] = []
    done_at = None
    with torch.no_grad():
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            tier = hotswap.status(compiled)[0].tier if calls else "eager"
            start = time.perf_counter()
            compiled(*inputs)
            if args.device == "cuda":
                torch.cuda.synchronize()
            calls.append((start, time.perf_counter() - start, tier))
            statuses = hotswap.status(compiled)
            if done_at is None and statuses and all(s.tier != "eager" for s in statuses):
                done_at = time.time() - psutil.Process().create_time()
                deadline = min(deadline, time.monotonic() + 50 * args.interval_ms / 1e3 + 1)
            time.sleep(args.interval_ms / 1e3)
    eager = sorted(d for _, d, t in calls[1:] if t == "eager") or [0.0]
    return {"row": path, "path": hotswap.status(compiled)[0].path,
            "compiled_from_start_s": done_at, "calls": len(calls),
            "first_call_ms": calls[0][1] * 1e3,
            "largest_ms": max(d for _, d, _ in calls[1:]) * 1e3,
            "eager_p99_ms": eager[int(0.99 * (len(eager) - 1))] * 1e3,
            "eager_median_ms": eager[len(eager) // 2] * 1e3}


def _spawn(path: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hotswap-paths-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                   HOTSWAP_CACHE_DIR=os.path.join(cache, "hotswap"))
        out = subprocess.run([sys.executable, __file__, "--row", path, "--model", args.model,
                              "--device", args.device, "--seconds", str(args.seconds),
                              "--interval-ms", str(args.interval_ms)],
                             env=env, capture_output=True, text=True, timeout=args.seconds + 300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"row": path, "error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="transformer", help="zoo model (default transformer)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seconds", type=float, default=90.0, help="per row, at most")
    parser.add_argument("--interval-ms", type=float, default=2.0)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        print(json.dumps(_row(args.row, args)))
        return 0
    rows = [_spawn(path, args) for path in ("worker", "inprocess")]
    print(f"{'row':<11}{'compiled s':>11}{'first call ms':>15}{'largest ms':>12}"
          f"{'eager p99 ms':>14}{'eager med ms':>14}  path")
    for r in rows:
        if "error" in r:
            print(f"{r['row']:<11}  failed: {r['error']}")
            continue
        compiled = r["compiled_from_start_s"]
        print(f"{r['row']:<11}{compiled if compiled is None else round(compiled, 1)!s:>11}"
              f"{r['first_call_ms']:>15.0f}{r['largest_ms']:>12.1f}{r['eager_p99_ms']:>14.2f}{r['eager_median_ms']:>14.2f}"
              f"  {r['path'][:70]}")
    ok = [r for r in rows if "error" not in r]
    if len(ok) == 2 and all(r["compiled_from_start_s"] for r in ok):
        worker, here = ok
        ratio = here["compiled_from_start_s"] / worker["compiled_from_start_s"]
        print(f"in-process / worker: compiled code {ratio:.2f}x as late, first call "
              f"{here['first_call_ms'] / worker['first_call_ms']:.1f}x as long")
    return 0


if __name__ == "__main__":
    sys.exit(main())
