"""Where a served tier's time per call goes, against plain torch.compile, in one process (GPU).

    python scripts/served_vs_plain.py [--model matmul-relu] [--mode progressive]

Compiles the zoo model with hotswap until its ladder is final and with plain torch.compile,
then times with triton's do_bench (median, interleaved rounds): the compiled model as the user
calls it (dynamo's guards, then hotswap's runner), hotswap's runner alone, the callable the
runner serves, and plain torch.compile. A gap between the first two and the third is the
runner's; between the third and plain torch.compile, the artifact's. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from typing import Any


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="matmul-relu")
    parser.add_argument("--mode", default="progressive")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import torch
    from triton.testing import do_bench

    import hotswap
    from hotswap.tools import zoo

    workload = zoo.make(args.model, device="cuda", dtype=args.dtype)
    model, inputs = workload.target, workload.inputs(0)
    backend = hotswap.backend(mode=args.mode,
                              cache_dir=tempfile.mkdtemp(prefix="hotswap-served-"))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    compiled(*inputs)
    [status] = hotswap.wait(backend, timeout_s=600)
    runners = backend.runners
    plain = torch.compile(model, fullgraph=True)
    plain(*inputs)
    candidates: dict[str, Any] = {"hotswap (as called)": lambda: compiled(*inputs),
                                  "torch.compile": lambda: plain(*inputs)}
    if runners:
        runner = runners[0]
        candidates["hotswap runner"] = lambda: runner(*inputs)
        candidates["served callable"] = lambda: runner.serving(*inputs)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(args.rounds):
        for name, fn in candidates.items():
            times[name].append(do_bench(fn, return_mode="median"))
    print(json.dumps({"device": torch.cuda.get_device_name(), "model": args.model,
                      "dtype": args.dtype,
                      "mode": args.mode, "tier": status.tier, "kept": status.kept,
                      "gate": status.gate,
                      "ms": {n: round(statistics.median(v), 4) for n, v in times.items()}},
                     indent=2))
    hotswap.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
