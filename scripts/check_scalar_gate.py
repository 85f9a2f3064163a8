"""The gate on a busy CPU box, as it was reported: a scalar tier (``cpp.simdlen=1``, about 10x
slower than eager) and the default tier, in progressive mode, with a caller calling every 1 ms;
and the scalar tier alone in async mode, where no gate weighs it before it serves: on
probation, it must give way to eager once its calls have run slower than eager's.

    .venv/bin/python scripts/check_scalar_gate.py [--timeout-s 600] [--orders "async: scalar"]

Each order runs in a fresh process with a cold cache of its own. While the
caller runs, the status line is printed whenever it changes (``measuring`` / ``deciding``);
once the graph is final, the caller stops and the served tier is timed against eager on the
quiet machine (interleaved blocks, the median of their ratios). Printed per order: the tier
that served at the end (and every tier that served on the way), its per-call time against
eager's, and the time from the graph's arrival to the final decision. Targets: ``scalar``
never serves in progressive mode; the final tier is within 10 % of the best of eager and
default; in async mode ``scalar`` serves until its probation ends, then eager for good.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch

import hotswap

SCALAR = {"name": "scalar", "config": {"cpp.simdlen": 1}}
ORDERS = {"scalar, default": ("progressive", [SCALAR, "default"]),
          "default, scalar": ("progressive", ["default", SCALAR]),
          "async: scalar": ("async", [SCALAR])}
PROBATION_S = 60.0  # async: how long the caller goes on once the tier serves


class Chain(torch.nn.Module):
    """6 blocks of layer_norm, gelu, sin on 256x1024."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(1024))
                                              for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (1024,), w)).sin()
        return x


def per_call_ms(fn: Any, x: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls * 1e3


def one_order(name: str, timeout_s: float) -> dict[str, Any]:
    """In this (fresh) process: serve the model while its ladder climbs; time the result."""
    torch.manual_seed(0)
    model = Chain().eval()
    x = torch.randn(256, 1024)
    cache = tempfile.mkdtemp(prefix="hotswap-scalar-gate-")
    mode, tiers = ORDERS[name]
    compiled = hotswap.compile(model, mode=mode, tiers=tiers, cache_dir=cache)
    stop = threading.Event()
    served: list[str] = []
    largest_ms = [0.0]

    def caller() -> None:
        with torch.no_grad():
            while not stop.is_set():
                t = time.perf_counter()
                compiled(x)
                largest_ms[0] = max(largest_ms[0], (time.perf_counter() - t) * 1e3)
                time.sleep(0.001)

    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(compiled(x), expected)
    started = time.monotonic()
    thread = threading.Thread(target=caller, daemon=True)
    thread.start()
    last, status, final_s = "", None, None
    while time.monotonic() - started < timeout_s:
        [status] = hotswap.status(compiled)
        if not served or status.tier != served[-1]:
            served.append(status.tier)
        line = status.summary()
        if line != last:
            print(f"  [{name}] {time.monotonic() - started:6.1f} s  {line}", file=sys.stderr,
                  flush=True)
            last = line
        if status.final and final_s is None:
            final_s = time.monotonic() - started
        # async: final once its tier serves; on probation until it has served a while
        if final_s is not None and (mode != "async" or len(served) > 2
                                    or time.monotonic() - started > final_s + PROBATION_S):
            break
        time.sleep(0.05)
    final_s = time.monotonic() - started if final_s is None else final_s
    stop.set()
    thread.join()
    assert status is not None
    with torch.no_grad():
        # scalar and vectorized code round gelu/sin differently: 4e-4 apart on this chain
        torch.testing.assert_close(compiled(x), expected, rtol=1e-3, atol=1e-3)
        for fn in (compiled, model):
            per_call_ms(fn, x, 3)  # warm
        pairs = [(per_call_ms(compiled, x, 10), per_call_ms(model, x, 10)) for _ in range(15)]
    return {"order": name, "final": status.final, "tier": status.tier, "served": served,
            "final_s": final_s, "tier_ms": statistics.median(t for t, _ in pairs),
            "eager_ms": statistics.median(e for _, e in pairs),
            "ratio": statistics.median(t / e for t, e in pairs), "largest_call_ms": largest_ms[0],
            "kept": [f"{t}: {why}" for t, why in status.kept], "gate": status.gate,
            "mode": mode, "served_after_s": list(status.served_after_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--orders", default=";".join(ORDERS),
                        help=f"which to run, of {list(ORDERS)} (default: all, ';'-separated)")
    parser.add_argument("--order", choices=list(ORDERS), help=argparse.SUPPRESS)  # the child
    args = parser.parse_args()
    if args.order:
        print(json.dumps(one_order(args.order, args.timeout_s)))
        hotswap.shutdown()
        return
    results = []
    names = [n.strip() for n in args.orders.split(";") if n.strip()]
    if unknown := [n for n in names if n not in ORDERS]:
        parser.error(f"--orders: unknown {unknown}; choose from {list(ORDERS)}")
    for name in names:
        child = subprocess.run([sys.executable, __file__, "--order", name, "--timeout-s",
                                str(args.timeout_s)], stdout=subprocess.PIPE, text=True,
                               check=True)
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
    missed = []
    for r in results:
        print(f"order [{r['order']}]: final={r['final']} after {r['final_s']:.1f} s; served "
              f"{' -> '.join(r['served'])}; final tier {r['tier']} at {r['tier_ms']:.2f} ms per "
              f"call vs eager {r['eager_ms']:.2f} ms (ratio {r['ratio']:.2f}); largest call "
              f"beside the climb {r['largest_call_ms']:.1f} ms")
        for line in r["kept"]:
            print(f"    kept {line}")
        if r["gate"]:
            print(f"    gate: {r['gate']}")
        print("    served after (s): "
              + ", ".join(f"{t} {at:.1f}" for t, at in r["served_after_s"]))
        if r["mode"] == "async":
            if r["tier"] != "eager":
                missed.append(f"[{r['order']}]: {r['tier']} still serves")
        elif "scalar" in r["served"]:
            missed.append(f"[{r['order']}]: scalar served")
        if not r["final"]:
            missed.append(f"[{r['order']}]: not final after {args.timeout_s:g} s")
    # The best of eager and default, measured on the quiet machine in each run: a final tier
    # of default or eager is within 10 % of it when its ratio to eager is, or it is default.
    for r in results:
        if r["tier"] == "eager" and r["mode"] != "async" and any(s["tier"] == "default" and s["ratio"] < 0.9
                                        for s in results):
            missed.append(f"[{r['order']}]: eager kept, default measured faster elsewhere")
        if r["tier"] == "default" and r["ratio"] > 1.1:
            missed.append(f"[{r['order']}]: default serves, {r['ratio']:.2f}x eager")
    print("targets met" if not missed else "missed: " + "; ".join(missed))
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
