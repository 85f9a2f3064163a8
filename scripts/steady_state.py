"""Steady state on the GPU: hotswap's tiers against torch.compile(mode=...), in one process.

    python scripts/steady_state.py [--models corpus:gpt2,corpus:vit,corpus:resnet]
        [--batches 1,8] [--modes default,reduce-overhead] [--rounds 15] [--json FILE]

Per model, batch and mode: hotswap's ladder for torch.compile's ``mode`` (``["default"]``, or
``["default", mode]``) served until final, and ``torch.compile(model, mode=mode)``; then
rounds of triton's do_bench (median) interleaved between the two. The ratio is hotswap's
median over torch's, the median of the rounds' ratios (target <= 1.03x), with their range. To
say where a gap lies, each side is also profiled over --profile-calls calls: the GPU's busy
time per call (kernels, copies and memsets, summed), the host's time to issue a call (no
synchronization: what the CPU spends per call), and the kernels whose time per call differs
most between the two sides. Prints a table, and JSON with --json.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _profile(fn: Any, calls: int) -> tuple[float, float, dict[str, float]]:
    """(GPU busy ms per call, host ms to issue a call, {kernel: ms per call})."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host_ms = (time.perf_counter() - start) * 1e3 / calls
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type.name == "CUDA":
            kernels[event.name[:90]] += event.device_time / 1e3 / calls
    return sum(kernels.values()), host_ms, dict(kernels)


def _case(model: Any, inputs: tuple[Any, ...], mode: str, rounds: int, calls: int
          ) -> dict[str, Any]:
    import torch
    from triton.testing import do_bench

    import hotswap

    # torch.compile(backend="hotswap", mode=mode)'s ladder, on a coordinator of its own
    ladder = ["default"] if mode == "default" else ["default", mode]
    backend = hotswap.backend(mode="progressive", tiers=ladder)
    ours = torch.compile(model, backend=backend)
    with torch.no_grad():
        ours(*inputs)
        [status] = hotswap.wait(backend, timeout_s=600, raise_on_timeout=True)
        for _ in range(3):  # a CUDA-graph tier captures on its second call
            ours(*inputs)
        plain = torch.compile(model, mode=mode)
        for _ in range(3):
            plain(*inputs)
        sides = {"hotswap": lambda: ours(*inputs), "torch": lambda: plain(*inputs)}
        times: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(rounds):
            for name, fn in sides.items():
                times[name].append(do_bench(fn, return_mode="median"))
        profiles = {name: _profile(fn, calls) for name, fn in sides.items()}
    [status] = hotswap.status(backend)
    ms = {name: statistics.median(v) for name, v in times.items()}
    ratios = sorted(o / p for o, p in zip(times["hotswap"], times["torch"], strict=True))
    ours_k, plain_k = profiles["hotswap"][2], profiles["torch"][2]
    gaps = sorted(((ours_k.get(k, 0.0) - plain_k.get(k, 0.0), k) for k in {*ours_k, *plain_k}),
                  key=lambda t: -abs(t[0]))
    return {"tier": status.tier, "kept": status.kept, "ms": ms, "ratio": statistics.median(ratios),
            "round_ratios": [round(r, 4) for r in ratios], "round_ms": times,
            "gpu_ms": {n: p[0] for n, p in profiles.items()},
            "host_ms": {n: p[1] for n, p in profiles.items()},
            "launches": {n: len(p[2]) for n, p in profiles.items()},
            "kernel_gaps_ms": [(k, round(d, 5)) for d, k in gaps[:6] if abs(d) > 1e-4],
            "served_ms": status.served_ms, "served_gap": status.served_gap}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="corpus:gpt2,corpus:vit,corpus:resnet")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--modes", default="default,reduce-overhead")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--profile-calls", type=int, default=50)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    import hotswap
    from hotswap.tools import zoo

    if not torch.cuda.is_available():
        parser.error("this compares CUDA steady states: no CUDA device here")
    torch._dynamo.config.cache_size_limit = 64
    results = []
    print(f"{'model':<16}{'batch':>6} {'mode':<16}{'tier':<16}{'hotswap ms':>11}{'torch ms':>10}"
          f"{'ratio':>7}{'gpu ms h/t':>16}{'host ms h/t':>16}", flush=True)
    for name in args.models.split(","):
        workload = zoo.make(name, device="cuda", dtype=args.dtype)
        full = workload.inputs(0)
        for batch in (int(b) for b in args.batches.split(",")):
            inputs = tuple(x[:batch] if isinstance(x, torch.Tensor) and x.dim() else x
                           for x in full)
            for mode in args.modes.split(","):
                try:
                    row = _case(workload.target, inputs, mode, args.rounds, args.profile_calls)
                except Exception as e:  # one case's failure is a row, not the end
                    row = {"error": f"{type(e).__name__}: {e}"}
                row.update(model=name, batch=batch, mode=mode)
                results.append(row)
                if args.json:  # after every row: a run cut short keeps what it measured
                    args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                     "rows": results}, indent=2, default=str))
                if "error" in row:
                    print(f"{name:<16}{batch:>6} {mode:<16}{row['error']}", flush=True)
                    continue
                print(f"{name:<16}{batch:>6} {mode:<16}{row['tier']:<16}"
                      f"{row['ms']['hotswap']:>11.4f}{row['ms']['torch']:>10.4f}"
                      f"{row['ratio']:>7.3f} ({row['round_ratios'][0]:.3f}-"
                      f"{row['round_ratios'][-1]:.3f})"
                      f"{row['gpu_ms']['hotswap']:>8.4f}/{row['gpu_ms']['torch']:<7.4f}"
                      f"{row['host_ms']['hotswap']:>8.4f}/{row['host_ms']['torch']:<7.4f}",
                      flush=True)
                print(f"    as served (status.served_ms): {row['served_ms']} "
                      f"{row['served_gap']}", flush=True)
                if row["kernel_gaps_ms"]:
                    print(f"    kernels, hotswap minus torch (ms per call): "
                          f"{row['kernel_gaps_ms']}", flush=True)
    hotswap.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
