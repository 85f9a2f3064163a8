"""What a graph compiled in contiguous parts (the compile service's ``parts``) costs in steady
calls against the whole graph, one model at a time in this process.

Per model (the corpus's, built from configs) and graph: the whole graph compiled as a worker
compiles it, then each of its ``--parts`` parts alone, the parts merged into one entry as the
service merges them, both loaded as the serving process loads them, their outputs checked
against eager, and their calls timed alternately (median of ``--calls``). Inductor's caches
start empty (a fresh folder). The compile seconds are printed too, but they do not compare:
the first compile pays the process's one-time costs, and the parts find the kernels the whole
graph's compile built (``hotswap bench``'s service rows measure what the parts gain).

    python scripts/parts_check.py [--models corpus:gpt2,corpus:vit,corpus:resnet]
                                  [--device cpu|cuda] [--parts 2] [--calls 50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any


def _graphs(model: str, device: str) -> tuple[Any, list[tuple[Any, list[Any]]]]:
    import torch
    from warm_ops_check import graphs_of  # beside this script

    from hotswap.tools import zoo

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    workload = zoo.make(model, device=device, dtype=dtype)
    return workload, graphs_of(workload)


def _compile(gm: Any, example: list[Any], part: int, parts: int) -> tuple[bytes, float]:
    import torch

    from hotswap.engine.options import Tier
    from hotswap.engine.shipping.inputs import describe_inputs
    from hotswap.engine.shipping.request import GraphRequest
    from hotswap.engine.shipping.transport import ship_graph
    from hotswap.engine.shipping.wire import CompileResult
    from hotswap.jobs.compile import compile_graph

    described = describe_inputs(gm, example)
    assert not isinstance(described, str), described
    request = GraphRequest(ship_graph(gm), described, torch.is_grad_enabled(),
                           torch.get_num_threads())
    wire = {**request.compile_request("g", Tier("default", parts=parts)).to_wire(), "part": part}
    start = time.perf_counter()
    entry = CompileResult.from_wire(compile_graph(wire)).entry
    return bytes(entry), time.perf_counter() - start


def _timed(fn: Any, args: list[Any], sync: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    sync()
    return (time.perf_counter() - start) * 1e3


def check(model: str, device: str, parts: int, calls: int) -> list[dict[str, Any]]:
    import torch

    from hotswap.cache.entry import merge_parts
    from hotswap.engine.loading.artifacts import load_entry
    from hotswap.engine.options import PARTS_KEY

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    _, graphs = _graphs(model, device)
    rows = []
    with torch.no_grad():
        for i, (gm, example) in enumerate(graphs):
            whole, whole_s = _compile(gm, example, -1, 1)
            made = [_compile(gm, example, k, parts) for k in range(parts)]
            merged = merge_parts([entry for entry, _ in made])
            fns = {"whole": load_entry(whole, {}), "parts": load_entry(merged, {PARTS_KEY: parts})}
            expected = gm(*example)
            for fn in fns.values():
                for got, want in zip(fn(*example), expected, strict=True):
                    if isinstance(want, torch.Tensor):
                        # bf16 on the GPU: a few elements in a thousand one or two bf16 steps
                        # off eager's (ResNet-18's features by 0.2 near 16), whole and in parts
                        scale = want.abs().max().item() if want.numel() else 1.0
                        tol = ({"atol": 2e-2 * max(1.0, scale), "rtol": 5e-2}
                               if device == "cuda" else {})
                        torch.testing.assert_close(got, want, **tol)
            times: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(5):
                for fn in fns.values():
                    _timed(fn, example, sync)
            for _ in range(calls):
                for name, fn in fns.items():
                    times[name].append(_timed(fn, example, sync))
            split = merged != whole and len([s for _, s in made]) == parts
            rows.append({"model": model, "graph": i, "device": device, "cut": split,
                         "whole_s": round(whole_s, 2),
                         "parts_s": [round(s, 2) for _, s in made],
                         "whole_ms": round(statistics.median(times["whole"]), 3),
                         "parts_ms": round(statistics.median(times["parts"]), 3)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="corpus:gpt2,corpus:vit,corpus:resnet")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--parts", type=int, default=2)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="parts-check-")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "triton")
    print(f"{'model':16s} {'graph':>5s} {'cut':>4s} {'whole s':>8s} {'parts s':>14s} "
          f"{'whole ms':>9s} {'parts ms':>9s} {'parts/whole':>11s}")
    for model in args.models.split(","):
        for row in check(model, args.device, args.parts, args.calls):
            print(json.dumps(row), flush=True)
            print(f"{row['model']:16s} {row['graph']:5d} {row['cut']!s:>4s} "
                  f"{row['whole_s']:8.2f} {','.join(f'{s:.2f}' for s in row['parts_s']):>14s} "
                  f"{row['whole_ms']:9.3f} "
                  f"{row['parts_ms']:9.3f} {row['parts_ms'] / row['whole_ms']:11.3f}", flush=True)


if __name__ == "__main__":
    main()
