"""Which of the serving process's neighbours slow a GPU caller's calls: GPT-2 (corpus, bf16)
called back to back on the main thread while, one after another with a second between,
another thread does each thing hotswap does beside a caller (its load path's warm-up steps,
a child process starting CUDA, compiling with inductor, keeping the GPU busy). Prints each
phase's calls: count, median, p99 and max (ms), and the same for the caller alone.

    python scripts/gpu_stall_sources.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

CHILD_CUDA = "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"
CHILD_BUSY = ("import torch, time\na = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)\n"
              "torch.cuda.synchronize(); t = time.time()\nwhile time.time() - t < 2: a @ a\n"
              "torch.cuda.synchronize()")
CHILD_COMPILE = ("import torch\nf = torch.compile(lambda x: (x.sin() + 1).cos() * x.sum())\n"
                 "f(torch.randn(4096, device='cuda')); torch.cuda.synchronize()")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    import torch

    from hotswap.tools import zoo

    work = zoo.make("corpus:gpt2", device="cuda", dtype="bfloat16")
    model, inputs = work.target, work.inputs(0)
    import torch._inductor.codecache
    import torch._inductor.compile_fx
    phases: list[tuple[str, float, float]] = []

    def child(code: str) -> Callable[[], object]:
        return lambda: subprocess.run([sys.executable, "-c", code], check=True)

    def triton_hash() -> object:
        import torch.utils._triton
        return torch.utils._triton.triton_hash_with_backend()

    steps: list[tuple[str, Callable[[], object]]] = [
        ("alone", lambda: time.sleep(3)),
        ("torch_key", lambda: torch._inductor.codecache.torch_key()),
        ("triton_hash and driver", triton_hash),
        ("child: python + torch import", child("import torch")),
        ("child: CUDA context", child(CHILD_CUDA)),
        ("child: 2 s of matmuls", child(CHILD_BUSY)),
        ("child: torch.compile a pointwise fn", child(CHILD_COMPILE)),
    ]

    def background() -> None:
        for name, fn in steps:
            time.sleep(1.0)
            start = time.perf_counter()
            fn()
            phases.append((name, start, time.perf_counter()))

    calls: list[tuple[float, float]] = []
    with torch.no_grad():
        for _ in range(20):
            model(*inputs)
        torch.cuda.synchronize()
        worker = threading.Thread(target=background)
        worker.start()
        while worker.is_alive():
            t = time.perf_counter()
            model(*inputs)
            torch.cuda.synchronize()
            calls.append((t, time.perf_counter() - t))
    result = {}
    for name, start, end in phases:
        took = sorted(d * 1e3 for t, d in calls if start <= t < end)
        if not took:
            continue
        row = {"seconds": round(end - start, 2), "calls": len(took),
               "median_ms": round(statistics.median(took), 2),
               "p99_ms": round(took[int(0.99 * (len(took) - 1))], 2), "max_ms": round(took[-1], 2)}
        result[name] = row
        print(f"{name:<40} {row}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "phases": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
