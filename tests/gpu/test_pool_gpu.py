from __future__ import annotations

import torch

from hotswap import WorkerCrashed, WorkerPool


def test_workers_pinned_to_a_gpu_run_cuda_and_survive_a_crash() -> None:
    gpus = torch.cuda.device_count()
    with WorkerPool(2, worker_env=lambda slot: {"CUDA_VISIBLE_DEVICES": str(slot % gpus)}) as pool:
        first = pool.submit("tests.gpu.jobs:cuda_identity").result(timeout=120)
        assert first["count"] == 1  # each worker sees exactly the GPU it is pinned to
        assert first["visible"] in {str(i) for i in range(gpus)}
        assert first["sum"] == float(sum(range(1024)) * 2)
        crashed = pool.submit("hotswap.testing.faults:sigkill")
        try:
            crashed.result(timeout=120)
        except WorkerCrashed as e:
            assert e.signal_name == "SIGKILL"
        again = pool.submit("tests.gpu.jobs:cuda_identity").result(timeout=120)
        assert again["sum"] == first["sum"]


def test_the_op_family_warm_up_compiles_on_the_gpu_and_matches_eager() -> None:
    from hotswap.jobs.compile import compile_op_families

    with torch.no_grad():
        for compiled, module, example in compile_op_families("cuda", torch.bfloat16):
            torch.testing.assert_close(compiled(example), module(example), rtol=2e-2, atol=2e-2)
