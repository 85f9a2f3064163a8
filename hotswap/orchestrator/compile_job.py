"""The compile job (``hotswap.orchestrator.compile_job:compile_graph``), run inside a worker.

The coordinator ships the dynamo graph pickled, and its inputs as metadata only (shape, stride,
dtype, device, requires_grad): parameters are graph inputs and may be gigabytes, so their values
never travel. Constants the graph holds (get_attr tensors) travel inside the pickled graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hotswap.workers import stage

__all__ = ["CompileRequest", "CompileResult", "InputMeta", "compile_graph"]


@dataclass(frozen=True)
class InputMeta:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    device: str
    requires_grad: bool


@dataclass(frozen=True)
class CompileRequest:
    graph_id: str
    tier: str
    config_patches: dict[str, Any]
    graph_bytes: bytes           # transport.ship_graph(); unpickled only here, in the worker
    inputs: tuple[InputMeta, ...]
    grad_enabled: bool


@dataclass(frozen=True)
class CompileResult:
    graph_id: str
    tier: str
    artifact: bytes
    timings_s: dict[str, float] = field(default_factory=dict)


def _make_input(meta: InputMeta) -> Any:
    import torch

    dtype = getattr(torch, meta.dtype)
    t = torch.empty_strided(meta.shape, meta.stride, dtype=dtype, device=meta.device)
    # Values only matter to autotuning benchmarks; integers stay 0 so they are valid indices.
    if dtype.is_floating_point or dtype.is_complex:
        t.normal_()
    else:
        t.zero_()
    return t.requires_grad_(meta.requires_grad)


def compile_graph(request: CompileRequest) -> CompileResult:
    import time

    import torch

    from hotswap.orchestrator import compat
    from hotswap.orchestrator.transport import land_graph

    timings: dict[str, float] = {}
    t = time.monotonic()
    with stage("graph_unpickle", tier=request.tier):
        inputs = [_make_input(m) for m in request.inputs]
        gm = land_graph(request.graph_bytes, inputs)
    timings["graph_unpickle"] = time.monotonic() - t
    t = time.monotonic()
    with stage("inductor_compile", tier=request.tier), torch.set_grad_enabled(request.grad_enabled):
        data = compat.compile_saveable(gm, inputs, request.config_patches)
    timings["inductor_compile"] = time.monotonic() - t
    return CompileResult(request.graph_id, request.tier, data, timings)
