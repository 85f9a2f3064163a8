"""Autotuning off the serving GPU (``worker_devices``) and the cluster executor on a GPU
machine. The two-GPU test needs two GPUs and skips, saying so, on one."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

import hotswap

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="worker_devices=['cuda:1'] needs a second GPU")


def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 512)).cuda()
    return model, torch.randn(64, 512, device="cuda")


def _gpu_of_pids() -> dict[int, str]:
    """Which GPU (by index) each process that holds a CUDA context runs on."""
    uuids = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                           capture_output=True, text=True, check=True).stdout
    index = {u.strip(): i.strip() for i, u in (line.split(",") for line in uuids.splitlines())}
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid",
                           "--format=csv,noheader"], capture_output=True, text=True,
                          check=True).stdout
    return {int(p): index[u.strip()] for p, u in (line.split(",") for line in apps.splitlines())}


@two_gpus
def test_workers_compile_and_autotune_on_the_other_gpu() -> None:
    model, x = _model()
    with torch.no_grad():
        expected = model(x)
        compiled = hotswap.compile(model, mode="async", tiers=["max-autotune-no-cudagraphs"],
                                   worker_devices=["cuda:1"])
        compiled(x)
        [status] = hotswap.wait(compiled, timeout_s=600)
        gpus = _gpu_of_pids()  # the workers still hold their CUDA contexts
        torch.testing.assert_close(compiled(x), expected, rtol=1e-2, atol=1e-2)
    assert status.tier == "max-autotune-no-cudagraphs", status
    workers = hotswap.runtime().worker_pids()
    assert workers and all(gpus.get(pid, "1") == "1" for pid in workers), (workers, gpus)
    assert gpus.get(os.getpid()) == "0"
