"""What a warm worker's first compile of a new model pays for op families it has not compiled:
the op-family warm-up (``hotswap.jobs.compile.warm_ops``) measured.

Per model and variant, a fresh process with fresh inductor and triton caches warms up as a
compile worker does (``warm_device``, ``warm_compile``, then the zoo's ``pointwise`` model
compiled, as the bench's warm compile service had), then, in the ``ops`` variant, compiles the
op-family graphs; then it compiles the model's graph ``--repeat`` times with inductor's caches
off (kernel files stay on disk, so later compiles skip the C++ or triton compiler: compare
first compiles across variants). Prints one JSON line per process: each compile's seconds and
inductor's stage times; the first process only writes Python bytecode (``--bytecode``, as a
compile worker reads hotswap's) and is not reported.

    python scripts/warm_ops_check.py [--models corpus:gpt2,corpus:vit,corpus:resnet] [--device cuda]
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


def graphs_of(workload: Any) -> list[tuple[Any, list[Any]]]:
    """The graphs dynamo makes of a zoo workload's first call, with their example inputs."""
    import torch

    graphs = []

    def backend(gm: Any, example: list[Any]) -> Any:
        graphs.append((gm, list(example)))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(workload.target, backend=backend)(*workload.inputs(0))  # type: ignore[no-untyped-call]
    return graphs


def child(model: str, ops: bool, device: str, repeat: int) -> dict[str, Any]:
    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import compilation_time_metrics

    from hotswap import compat
    from hotswap.jobs import compile as compile_job
    from hotswap.tools import zoo

    inductor_config.fx_graph_cache = False
    inductor_config.autotune_local_cache = False
    functorch_config.enable_autograd_cache = False
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    stages: list[dict[str, float]] = []

    def compile_all(graphs: list[tuple[Any, list[Any]]]) -> float:
        before = {k: sum(v) for k, v in compilation_time_metrics.items()}
        start = time.perf_counter()
        with torch.no_grad():
            for gm, example in graphs:
                compat.standalone_compile(gm, example, {})
        took = time.perf_counter() - start
        spent = {k: round(sum(v) - before.get(k, 0.0), 3)
                 for k, v in compilation_time_metrics.items()}
        stages.append({k: v for k, v in spent.items() if v >= 0.05})
        return took

    out: dict[str, Any] = {"model": model, "ops": ops, "device": device}
    start = time.perf_counter()
    compile_job.warm_device()
    compile_job.warm_compile()
    compile_all(graphs_of(zoo.make("pointwise", device=device)))
    out["warm_s"] = time.perf_counter() - start
    if ops:
        start = time.perf_counter()
        compile_job.compile_op_families(device, dtype)
        out["ops_s"] = time.perf_counter() - start
    graphs = graphs_of(zoo.make(model, device=device, dtype=dtype))
    out["compiles_s"] = [compile_all(graphs) for _ in range(repeat)]
    out["stages"] = stages[1:]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="corpus:gpt2,corpus:vit,corpus:resnet")
    p.add_argument("--device", default=None, help="cuda where there is one, else cpu")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--bytecode", default=None, help="bytecode folder (default: a fresh one)")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "OPS"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1] == "1", a.device, a.repeat)))
        return
    bytecode = a.bytecode or tempfile.mkdtemp(prefix="hotswap-warm-ops-pyc-")
    models = [m for m in a.models.split(",") if m]
    runs = [(models[0], True, False)] + [(m, ops, True) for m in models for ops in (False, True)]
    for model, ops, report in runs:
        with tempfile.TemporaryDirectory(prefix="hotswap-warm-ops-") as fresh:
            env = {**os.environ, "PYTHONPYCACHEPREFIX": bytecode,
                   "TORCHINDUCTOR_CACHE_DIR": os.path.join(fresh, "inductor"),
                   "TRITON_CACHE_DIR": os.path.join(fresh, "triton")}
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            run = subprocess.run([sys.executable, __file__, "--device", a.device, "--repeat",
                                  str(a.repeat), "--child", model, "1" if ops else "0"],
                                 env=env, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            sys.exit(f"{model} (ops={ops}) failed:\n{run.stderr[-2000:]}")
        if report:
            result = json.loads(run.stdout.strip().splitlines()[-1])
            print(json.dumps(result), flush=True)
            print(f"# {model} {'with' if ops else 'without'} the op families: compiles "
                  f"{', '.join(f'{s:.2f}' for s in result['compiles_s'])} s",
                  file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
