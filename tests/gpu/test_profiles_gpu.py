"""Profiles on a CUDA device: triton kernel names, do_bench tier comparison, kernel breakdowns
(PyTorch's test_profiler.py scenarios, through hotswap)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import hotswap
from hotswap.engine.recording import shared_timeline
from hotswap.profiles import KernelBreakdown, TierBench, chrome_trace, merge_torch_trace, read_records
from tests.gpu.scenarios import TIERS, matmul_relu, matmul_relu_inputs


def _records(directory: Path) -> list[Any]:
    shared_timeline(str(directory)).flush()
    return read_records(directory)


def test_sin_cos_profile_names_the_triton_kernel_and_trace_has_launches(tmp_path: Path) -> None:
    torch._dynamo.reset()

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x + y).sin().cos()

    x, y = (torch.rand(4, 4, device="cuda") for _ in range(2))
    compiled = hotswap.compile(fn, mode="async", profile_dir=str(tmp_path))
    compiled(x, y)
    [status] = hotswap.wait(compiled, timeout_s=300)
    assert status.tier == "default" and not status.failures, status
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            torch.testing.assert_close(compiled(x, y), fn(x, y))
        torch.cuda.synchronize()
    trace_path = tmp_path / "torch_trace.json"
    prof.export_chrome_trace(str(trace_path))
    records = _records(tmp_path)
    # The worker-side breakdown of the compiled tier names a fused triton kernel with sin.
    kernels = {k.tier: k for k in records if isinstance(k, KernelBreakdown)}
    names = [name for name, *_ in kernels["default"].top_kernels]
    assert any(n.startswith("triton_poi_fused") and "sin" in n for n in names), names
    assert kernels["default"].category_ms.get("pointwise", 0) > 0
    assert not any(n.startswith("hotswap.") for n in names)  # our call ranges are not kernels
    # The merged trace shows the kernel and its launch under hotswap's calls.
    merged = merge_torch_trace(chrome_trace(records), str(trace_path))
    events = merged["traceEvents"]
    assert merged["otherData"]["hotswap"]["aligned_calls"] == 3
    assert any(e.get("cat") == "kernel" and "sin" in e.get("name", "") for e in events)
    assert any("LaunchKernel" in e.get("name", "") for e in events)
    json.dumps(merged)


def test_do_bench_comparison_and_breakdown_of_matmul_relu_tiers(tmp_path: Path) -> None:
    torch._dynamo.reset()
    x, y = matmul_relu_inputs()
    tiers = TIERS
    compiled = hotswap.compile(matmul_relu, mode="progressive", fullgraph=True, tiers=tiers,
                               profile_dir=str(tmp_path))
    compiled(x, y)
    [status] = hotswap.wait(compiled, timeout_s=400)
    assert not status.failures, status
    records = _records(tmp_path)
    compared = {b.tier: b for b in records if isinstance(b, TierBench) and b.purpose == "compare"}
    assert set(compared) == {"eager", *tiers}
    for bench in compared.values():
        assert bench.result.benchmarker == "triton.testing.do_bench" and bench.result.n > 10
        assert bench.result.p20_ms <= bench.result.median_ms <= bench.result.p80_ms
        assert bench.speedup_vs_eager is not None
    kernels = {k.tier: k for k in records if isinstance(k, KernelBreakdown)}
    for tier in tiers:
        categories = kernels[tier].category_ms
        assert categories and 0 < kernels[tier].busy_pct <= 150, kernels[tier]
        assert {"pointwise", "template", "extern"} & set(categories), categories
    print({t: (round(b.result.median_ms, 4), b.speedup_vs_eager) for t, b in compared.items()})
    print({t: (k.category_ms, round(k.busy_pct, 1)) for t, k in kernels.items()})
