"""Benchmark: hotswap's modes vs torch.compile and PyTorch's own async/progressive subprocess modes.

Every row runs in a fresh process with empty inductor and triton cache directories (cold), and
serves the model in a loop (one call every --interval-ms) until the final tier serves:
  first output      the first call's latency (dynamo trace + eager run, or + compile)
  to final tier     first call start -> the final tier is serving
  largest call      the slowest call after the first one (did a compile or a swap stall a call?)
  steady            median latency once final (CPU: timer over many calls; CUDA: do_bench)
hotswap rows start their worker pool and let it pre-warm before the first call ("warm pool");
its caches are as cold as everyone else's. PyTorch's modes run with the cache switches their
tests use (fx_graph_cache, autotune_local_cache and autograd cache off).

Targets (issue): async first output <= 0.1x PyTorch async's first call; with a warm pool, time
to final tier <= 1.2x the in-process compile of that tier; largest call <= 2x eager + 10 ms;
dispatch overhead over calling the artifact directly <= 2 us.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Runs from a checkout as it is (e.g. on a GPU machine without network): hotswap is one level up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
}


def _transformer_block() -> Any:
    import torch

    class Block(torch.nn.Module):
        """Pre-norm transformer block: attention through scaled_dot_product_attention, MLP."""

        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                           torch.nn.Linear(4 * d, d))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                       for z in (q, k, v))
            attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp(self.ln2(x))

    return Block


def _matmul_relu(k: int) -> Any:
    import torch

    class MatmulRelu(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("y", torch.randn(k, k))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x @ self.y).relu()

    return MatmulRelu()


def build(name: str, device: str) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if name == "mlp":
        width, depth, batch = (4096, 8, 512) if device == "cuda" else (512, 4, 64)
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        model = torch.nn.Sequential(*layers)
        x = torch.randn(batch, width)
    elif name == "transformer":
        # Written out (not nn.TransformerEncoderLayer, whose fused inference fast path leaves
        # inductor almost nothing to compile).
        d, heads, seq, batch = (1024, 16, 512, 16) if device == "cuda" else (256, 4, 64, 8)
        model = _transformer_block()(d, heads)
        x = torch.randn(batch, seq, d)
    elif name == "matmul-relu":
        # PyTorch's own progressive test: (x @ y).relu() on bf16 1152x1024 @ 1024x1024.
        n, k = (1152, 1024) if device == "cuda" else (288, 256)
        model = _matmul_relu(k)
        x = torch.randn(n, k)
    else:
        raise SystemExit(f"unknown model {name!r}; choose mlp, transformer or matmul-relu")
    return model.to(device, dtype).eval(), x.to(device, dtype)


def _timer(fn: Any, device: str, n: int = 200) -> float:
    """Median latency in ms: do_bench on CUDA, a wall-clock median on CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def run_row(args: argparse.Namespace) -> dict[str, Any]:
    """Runs inside the row's own process."""
    import torch

    row = args.row
    model, x = build(args.model, args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    with torch.no_grad():
        eager_ms = _timer(lambda: model(x), args.device, 50)
    stats: Any = None
    import hotswap

    if row.startswith("hotswap:"):
        from hotswap.orchestrator.pools import shared_pool

        mode = row.split(":")[1]
        if mode != "inprocess":
            shared_pool(args.workers).wait_ready(300)
        tiers = ["default", "max-autotune-no-cudagraphs"] if mode == "progressive" else None
        compiled = hotswap.compile(model, mode=mode, tiers=tiers, workers=args.workers)

        def is_final() -> bool:
            statuses = hotswap.status(compiled)
            return bool(statuses) and all(s.final for s in statuses)
    elif row == "torch:eager-backend":
        compiled = torch.compile(model, backend="eager")

        def is_final() -> bool:
            return True
    elif row.startswith("torch:"):
        mode = "max-autotune-no-cudagraphs" if row.endswith("max-autotune") else None
        compiled = torch.compile(model, mode=mode)

        def is_final() -> bool:
            return True
    else:
        from torch._inductor import compile_fx_async

        torch._inductor.config.fx_graph_cache = False
        torch._inductor.config.autotune_local_cache = False
        torch._functorch.config.enable_autograd_cache = False
        compiled = torch.compile(model)
        if row.startswith("pytorch:async"):
            stats = compile_fx_async._AsyncFxCompile
            stats._reset_stats()

            def is_final() -> bool:
                return bool(stats._stat_compiled_runs > 0)
        else:
            stats = compile_fx_async._ProgressiveFxCompile
            stats._reset_stats()

            def is_final() -> bool:
                return bool(stats._stat_optimized_runs > 0)

    before = hotswap.counters()
    durations: list[float] = []
    final_s = None
    start = time.perf_counter()
    deadline = start + args.timeout_s
    with torch.no_grad():
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            compiled(x)
            sync()
            durations.append(time.perf_counter() - t)
            if is_final():
                final_s = time.perf_counter() - start
                break
            time.sleep(args.interval_ms / 1e3)
        steady_ms = _timer(lambda: compiled(x), args.device) if final_s is not None else None
    return {
        "row": row, "model": args.model, "device": args.device, "eager_ms": eager_ms,
        "first_output_s": durations[0], "to_final_s": final_s,
        "largest_call_ms": max(durations[1:], default=0.0) * 1e3, "calls": len(durations),
        "steady_ms": steady_ms,
        "timings_s": ({k: v for s in hotswap.status(compiled) for k, v in s.timings_s.items()}
                      if row.startswith("hotswap:") else {}),
        "counters": {k: v - before.get(k, 0) for k, v in hotswap.counters().items()},
    }


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
    direct = runner._fn
    n = 200_000
    via = min(timeit.repeat(lambda: runner(x), number=n, repeat=5)) / n
    raw = min(timeit.repeat(lambda: direct(x), number=n, repeat=5)) / n
    return {"row": "hotswap:dispatch", "runner_ns": via * 1e9, "direct_ns": raw * 1e9,
            "overhead_ns": (via - raw) * 1e9}


def spawn_row(row: str, args: argparse.Namespace,
              extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one row in a fresh process with empty inductor, triton and hotswap caches
    (``extra_env`` may point HOTSWAP_CACHE_DIR at a shared one)."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="hotswap-bench-") as cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
        env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
        env["HOTSWAP_CACHE_DIR"] = os.path.join(cache, "hotswap")
        env.update(extra_env or {})
        if row.startswith("pytorch:"):
            env["TORCHINDUCTOR_FX_COMPILE_MODE"] = row.split(":")[1]
        cmd = [sys.executable, __file__, "--row", row, "--model", args.model, "--device",
               args.device, "--workers", str(args.workers), "--timeout-s", str(args.timeout_s),
               "--interval-ms", str(args.interval_ms)]
        try:
            out = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                 timeout=args.timeout_s + 120)
        except subprocess.TimeoutExpired:
            return {"row": row, "error": f"no result within {args.timeout_s + 120:g} s"}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"row": row, "error": (out.stderr.strip().splitlines() or ["?"])[-1][:200]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _fmt(value: Any, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def report(results: list[dict[str, Any]], dispatch: dict[str, Any] | None) -> None:
    by_row = {r["row"]: r for r in results}
    print(f"\n{'row':<32}{'first out s':>12}{'to final s':>12}{'largest ms':>12}"
          f"{'steady ms':>11}{'eager ms':>10}")
    for r in results:
        if "error" in r:
            print(f"{r['row']:<32}  failed: {r['error']}")
            continue
        print(f"{r['row']:<32}{_fmt(r['first_output_s'], 1, 3):>12}{_fmt(r['to_final_s']):>12}"
              f"{_fmt(r['largest_call_ms'], 1, 1):>12}{_fmt(r['steady_ms'], 1, 3):>11}"
              f"{_fmt(r['eager_ms'], 1, 3):>10}")

    def ratio_line(label: str, a: str, a_key: str, b: str, b_key: str, target: float) -> None:
        ra, rb = by_row.get(a, {}), by_row.get(b, {})
        va, vb = ra.get(a_key), rb.get(b_key)
        if va is None or vb is None:
            print(f"  {label}: not measured")
            return
        ratio = va / vb
        print(f"  {label}: {va:.3f} / {vb:.3f} = {ratio:.3f}x (target <= {target}x) "
              f"{'met' if ratio <= target else 'MISSED'}")

    print("\ntargets")
    ratio_line("async first output vs PyTorch async first call", "hotswap:async",
               "first_output_s", "pytorch:async+subprocess", "first_output_s", 0.1)
    ratio_line("async time to final vs in-process default compile", "hotswap:async",
               "to_final_s", "torch:default", "to_final_s", 1.2)
    ratio_line("progressive time to final vs in-process max-autotune", "hotswap:progressive",
               "to_final_s", "torch:max-autotune", "to_final_s", 1.2)
    for row in ("hotswap:async", "hotswap:progressive"):
        ratio_line(f"{row} first output vs dynamo trace + eager call", row, "first_output_s",
                   "torch:eager-backend", "first_output_s", 1.5)
    for row in ("hotswap:async", "hotswap:progressive"):
        r = by_row.get(row)
        if r and "error" not in r:
            limit = 2 * r["eager_ms"] + 10
            print(f"  {row} largest call {r['largest_call_ms']:.1f} ms vs 2x eager + 10 ms = "
                  f"{limit:.1f} ms {'met' if r['largest_call_ms'] <= limit else 'MISSED'}")
    if dispatch is not None:
        over = dispatch["overhead_ns"] / 1e3
        print(f"  dispatch overhead: {dispatch['runner_ns']:.0f} ns via hotswap vs "
              f"{dispatch['direct_ns']:.0f} ns direct = {over:.2f} us (target <= 2 us) "
              f"{'met' if over <= 2 else 'MISSED'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp",
                        help="mlp, transformer or matmul-relu (default mlp)")
    parser.add_argument("--models", default=None, help="comma list; runs each (default: --model)")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma list of rows")
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per row (default 300)")
    parser.add_argument("--interval-ms", type=float, default=5.0,
                        help="pause between served calls (default 5)")
    parser.add_argument("--json", default=None, help="also write all results to this file")
    parser.add_argument("--row", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row == "hotswap:dispatch":
        print(json.dumps(dispatch_overhead(args)))
        return
    if args.row:
        print(json.dumps(run_row(args)))
        return
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; choose from {list(ROWS)}")
    everything: dict[str, Any] = {"rows": []}
    for model in (args.models or args.model).split(","):
        args.model = model
        print(f"\n== {model} on {args.device} (each row a fresh process, cold caches) ==")
        results = []
        for row in rows:
            print(f"  running {row} ...", flush=True)
            results.append(spawn_row(row, args))
        dispatch = spawn_row("hotswap:dispatch", args)
        report(results, dispatch if "error" not in dispatch else None)
        everything["rows"] += results
        everything["dispatch"] = dispatch
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=2)


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


if __name__ == "__main__":
    main()
