"""Kernel breakdown of one compiled callable: time by the kernel categories inductor emits.

In the spirit of inductor's ``compiled_module.py -p``: a ``torch.profiler`` pass over a few
calls, kernels grouped by name — ``triton_poi`` (pointwise), ``triton_red`` (reduction),
``triton_per`` (persistent reduction), ``triton_tem`` (template), ``triton_for`` (foreach),
``cpp_fused`` (inductor's C++ kernels; named only when compiled with
``cpp.enable_kernel_profile``), and everything else as ``extern`` (cuBLAS, aten fallbacks) —
plus the share of wall time the device was busy (overlapping kernels merged).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from hotswap.profiles.records import KernelBreakdown

__all__ = ["CATEGORIES", "kernel_breakdown", "kernel_category", "summarize_kernels"]

CATEGORIES: tuple[tuple[str, str], ...] = (
    ("triton_poi", "pointwise"),
    ("triton_red", "reduction"),
    ("triton_per", "persistent_reduction"),
    ("triton_tem", "template"),
    ("triton_for", "foreach"),
    ("cpp_fused", "cpp_fused"),
)
_MARK = "hotswap.profiled_call"
# CPU ranges that wrap kernels rather than being one: descend into them.
_WRAPPERS = ("##", "Torch-Compiled Region", "CompiledFunction", "hotswap.", "Call CompiledFxGraph",
             "AOTDispatcher")


def kernel_category(name: str) -> str:
    for prefix, category in CATEGORIES:
        if prefix in name:
            return category
    lowered = name.lower()
    if "memcpy" in lowered or "memset" in lowered:
        return "memory"
    return "extern"


def summarize_kernels(graph_id: str, tier: str, device: str, calls: int, wall_ms: float,
                      kernels: list[tuple[str, float, float]], *, top: int = 15) -> KernelBreakdown:
    """A breakdown from ``(name, start_us, end_us)`` kernel intervals over ``wall_ms``."""
    category_ms: dict[str, float] = {}
    per_kernel: dict[str, list[float]] = {}
    for name, start, end in kernels:
        ms = (end - start) / 1000.0
        category = kernel_category(name)
        category_ms[category] = category_ms.get(category, 0.0) + ms
        entry = per_kernel.setdefault(name, [0.0, 0])
        entry[0] += ms
        entry[1] += 1
    busy_us = 0.0
    cursor = float("-inf")
    for _, start, end in sorted(kernels, key=lambda k: k[1]):
        if end <= cursor:
            continue
        busy_us += end - max(start, cursor)
        cursor = end
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    return KernelBreakdown(
        graph_id=graph_id, tier=tier, device=device, calls=calls, wall_ms=wall_ms,
        busy_pct=100.0 * busy_us / 1000.0 / wall_ms if wall_ms > 0 else 0.0,
        category_ms=category_ms,
        top_kernels=tuple((name, kernel_category(name), ms, int(count))
                          for name, (ms, count) in ranked),
    )


@contextlib.contextmanager
def _without_kineto_markers() -> Iterator[None]:
    """Kineto writes a "USDT: ... profiler_start/stop" line to fd 2 for every profile; in a
    worker that is the user's terminal. Hold fd 2's output while profiling and pass on the
    rest of it."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().splitlines(keepends=True)
                    if not line.startswith(b"USDT:")]
            if kept:
                os.write(2, b"".join(kept))


def kernel_breakdown(graph_id: str, tier: str, fn: Callable[[], Any], *, device: str = "cpu",
                     calls: int = 10) -> KernelBreakdown:
    """Profile ``calls`` calls of ``fn`` (after one warm-up call) and break their time down."""
    import torch
    from torch.profiler import DeviceType, ProfilerActivity, profile, record_function

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    fn()
    sync()
    with _without_kineto_markers(), profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            with record_function(_MARK):
                fn()
        sync()
        wall_ms = (time.perf_counter() - start) * 1000.0
    events = prof.events()
    if cuda:
        # Device-side events are kernels and copies, plus each record_function range mirrored
        # as a GPU "user annotation" (ours among them): those are not kernels.
        kernels = [(e.name, float(e.time_range.start), float(e.time_range.end)) for e in events
                   if e.device_type == DeviceType.CUDA and e.name != _MARK
                   and not getattr(e, "is_user_annotation", False)]
    else:
        kernels = []
        for event in events:
            if event.name == _MARK:
                _cpu_kernels(event, kernels)
    return summarize_kernels(graph_id, tier, device, calls, wall_ms, kernels)


def _cpu_kernels(event: Any, out: list[tuple[str, float, float]]) -> None:
    """The outermost kernel-like ranges under ``event``: inductor's C++ kernels, aten ops."""
    for child in event.cpu_children:
        if child.name.startswith(_WRAPPERS) or child.name == _MARK:
            _cpu_kernels(child, out)
        else:
            out.append((child.name, float(child.time_range.start), float(child.time_range.end)))
