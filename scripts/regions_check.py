"""Real models compiled region by region, against eager and against the whole graph.

    python scripts/regions_check.py [--device cpu|cuda] [--models gpt2,bert,...] [--all-cuts]
        [--steady-calls N] [--json FILE]

Per corpus model (all by default): dynamo's graph, labelled and cut as the serving process
does (engine/shipping/regions.py), compiled piece by piece as a worker does (jobs/regions.py,
here in one process, each model in a fresh inductor cache), its entry packed and loaded as the
serving process loads it; then the pieces' outputs against eager (the corpus tolerance, or
1.5x torch.compile's own error where that is larger), and the compile time against the whole
graph's. ``--all-cuts`` cuts wherever the graph repeats a region, however little that saves
(the CPU corpus has two blocks per model: the default rule compiles those whole). One tiny
compile first, as a worker's warm-up does, so that neither form pays the process's set-up.
``--steady-calls``: also time both compiled forms over that many calls (GPU: synchronized).
Prints a table; exits 1 if a model's pieces miss the tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _capture(model: Any, inputs: tuple[Any, ...]) -> list[tuple[Any, list[Any]]]:
    import torch

    graphs: list[tuple[Any, list[Any]]] = []

    def keep(gm: Any, example_inputs: list[Any]) -> Any:
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=keep)(*inputs)
    return graphs


def _timed(fn: Any, args: list[Any], calls: int, cuda: bool) -> float:
    import torch

    for _ in range(3):
        fn(*args)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def check(name: str, device: str, steady_calls: int) -> dict[str, Any]:
    import torch

    from hotswap import compat
    from hotswap.engine.loading.artifacts import load_entry, pack_entry
    from hotswap.engine.shipping import regions as cutting
    from hotswap.engine.shipping.inputs import describe_inputs
    from hotswap.engine.shipping.transport import land_graph, ship_graph
    from hotswap.jobs import regions
    from hotswap.tools import corpus

    workload = corpus.make(name, device=device, dtype="bfloat16" if device == "cuda" else "float32")
    graphs = _capture(workload.target, workload.inputs(0))
    row: dict[str, Any] = {"model": name, "graphs": len(graphs), "pieces": 0, "distinct": 0}
    if len(graphs) != 1:
        return {**row, "verdict": "skipped (graph breaks)"}
    gm, args = graphs[0]
    metas = describe_inputs(gm, args)
    static = [m.static for m in metas] if not isinstance(metas, str) else [False] * len(args)
    labels = cutting.region_labels(gm, static)
    if not labels:
        return {**row, "verdict": "not cut"}
    with torch.no_grad():
        start = time.perf_counter()
        try:
            made = regions.compile_regions(
                land_graph(ship_graph(gm), args), args, static, labels,
                lambda piece, example: compat.compile_saveable(piece, example, {}))
        except compat.UnsaveableArtifact:
            return {**row, "verdict": "pieces not saveable: a worker compiles the whole graph"}
        row["pieces_s"] = time.perf_counter() - start
        if made is None:
            return {**row, "verdict": "not cut"}
        artifacts, plan = made
        served = load_entry(pack_entry(b"".join(artifacts), {}, None, plan))
        row.update(pieces=len(plan["steps"]), distinct=len(plan["sizes"]))
        start = time.perf_counter()
        whole = load_entry(pack_entry(compat.compile_saveable(
            land_graph(ship_graph(gm), args), args, {}), {}))
        row["whole_s"] = time.perf_counter() - start
        expected = gm(*args)
        got, whole_out = served(*args), whole(*args)
        row["max_err"] = max(float((a.float() - b.float()).abs().max())
                             for a, b in zip(got, expected, strict=True) if a is not None)
        row["whole_err"] = max(float((a.float() - b.float()).abs().max())
                               for a, b in zip(whole_out, expected, strict=True) if a is not None)
        if steady_calls:
            cuda = device == "cuda"
            row["pieces_ms"] = _timed(served, args, steady_calls, cuda)
            row["whole_ms"] = _timed(whole, args, steady_calls, cuda)
    allowed = max(workload.tolerance, 1.5 * row["whole_err"])
    row["verdict"] = "ok" if row["max_err"] <= allowed else f"MISMATCH (allowed {allowed:.3g})"
    return row


def _cell(row: dict[str, Any], key: str, width: int, fmt: str) -> str:
    value = row.get(key)
    return f"{value:>{width}{fmt}}" if value is not None else f"{'-':>{width}}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--models", default="")
    parser.add_argument("--all-cuts", action="store_true")
    parser.add_argument("--steady-calls", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    from hotswap.engine.shipping import regions as cutting
    from hotswap.tools import corpus

    if args.all_cuts:
        cutting.WORTH = 1.0
    names = [m for m in args.models.split(",") if m] or sorted(corpus.MODELS)
    from hotswap.jobs.compile import _compile_once

    _compile_once(args.device)  # a process's first compile pays set-up neither form should
    rows = []
    print(f"{'model':<14}{'pieces':>7}{'distinct':>9}{'pieces s':>9}{'whole s':>8}"
          f"{'max err':>9}{'whole err':>10}{'pieces ms':>10}{'whole ms':>9}  verdict", flush=True)
    for name in names:
        with tempfile.TemporaryDirectory(prefix="hotswap-regions-") as cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
            try:
                row = check(name, args.device, args.steady_calls)
            except Exception as e:  # one model's failure is a row, not the end of the sweep
                row = {"model": name, "verdict": f"ERROR {type(e).__name__}: {str(e)[:160]}"}
        rows.append(row)
        print(f"{name:<14}{_cell(row, 'pieces', 7, '')}{_cell(row, 'distinct', 9, '')}"
              f"{_cell(row, 'pieces_s', 9, '.2f')}{_cell(row, 'whole_s', 8, '.2f')}"
              f"{_cell(row, 'max_err', 9, '.3g')}{_cell(row, 'whole_err', 10, '.3g')}"
              f"{_cell(row, 'pieces_ms', 10, '.3f')}{_cell(row, 'whole_ms', 9, '.3f')}  "
              f"{row['verdict']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if any(str(r["verdict"]).startswith(("MISMATCH", "ERROR")) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
