"""The benchmark job (``hotswap.orchestrator.bench_job:bench_tiers``), run inside a worker.

The gate and the profile's tier comparison measure artifacts here, not in the user's process:
a benchmark there would take the GIL and the device from the user's calls. The worker loads
each tier's packed artifact, builds inputs from the same metadata the compile used (parameters
get random values of the right shape; timing does not depend on them), and benchmarks every
tier on those same inputs, one after the other. With ``graph_bytes`` the graph also runs as
it is (``eager``), so every tier gets a speed-up over eager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hotswap.orchestrator.compile_job import InputMeta
from hotswap.profiles.records import KernelBreakdown, TierBench
from hotswap.workers import stage

__all__ = ["BenchReply", "BenchRequest", "CachedEntry", "bench_tiers"]


@dataclass(frozen=True)
class CachedEntry:
    """An entry the worker reads from the artifact cache itself, so that the user's process
    neither pickles nor sends its bytes (tens of MB for a GPU tier, copied holding the GIL)."""

    cache_dir: str
    key: str


@dataclass(frozen=True)
class BenchRequest:
    graph_id: str
    entries: dict[str, bytes | CachedEntry]  # tier -> artifacts.pack_entry(...), or where
    inputs: tuple[InputMeta, ...]
    grad_enabled: bool
    graph_bytes: bytes = b""         # transport.ship_graph(); adds an "eager" row when given
    budget_ms: float = 200.0         # per tier
    purpose: str = "compare"         # "gate" or "compare"
    breakdown: bool = False          # also profile each tier's kernels
    num_threads: int | None = None   # the caller's intra-op threads: time what it will run
    # tier -> the inductor config it compiled with; its artifact loads under it (load_entry)
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class BenchReply:
    benches: list[TierBench]
    kernels: list[KernelBreakdown] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # tier -> why it has no row


def bench_tiers(request: BenchRequest) -> BenchReply:
    import torch

    from hotswap.orchestrator import compat
    from hotswap.orchestrator.artifacts import load_entry
    from hotswap.orchestrator.compile_job import real_inputs
    from hotswap.orchestrator.transport import land_graph
    from hotswap.profiles.bench import compare_tiers
    from hotswap.profiles.kernels import kernel_breakdown

    device = next((m.device for m in request.inputs if m.is_tensor), "cpu")
    errors: dict[str, str] = {}
    calls: dict[str, Any] = {}
    with stage("bench_load", graph=request.graph_id):
        inputs = real_inputs(request.inputs)
        if request.graph_bytes:
            gm = land_graph(request.graph_bytes, inputs, None)
            calls["eager"] = _bind(gm, inputs)
        for tier, entry in request.entries.items():
            try:
                calls[tier] = _bind(load_entry(_read(entry), request.configs.get(tier)), inputs)
            except Exception as e:
                errors[tier] = f"failed to load: {type(e).__name__}: {e}"
    with (stage("bench", graph=request.graph_id), torch.set_grad_enabled(request.grad_enabled),
          compat.intra_op_threads(request.num_threads)):
        benches = compare_tiers(request.graph_id, calls, device=device,
                                budget_ms=request.budget_ms, purpose=request.purpose,
                                errors=errors)
        kernels = []
        if request.breakdown:
            for tier, fn in calls.items():
                if tier in errors:
                    continue
                try:
                    kernels.append(kernel_breakdown(request.graph_id, tier, fn, device=device))
                except Exception as e:
                    errors[f"{tier}/kernels"] = f"{type(e).__name__}: {e}"
    return BenchReply(benches, kernels, errors)


def _read(entry: bytes | CachedEntry) -> bytes:
    if isinstance(entry, bytes):
        return entry
    from hotswap.cache import ArtifactCache

    data = ArtifactCache(entry.cache_dir).get(entry.key)  # verified; no stamp: read only
    if data is None:
        raise LookupError(f"the artifact cache no longer holds entry {entry.key[:12]}")
    return data


def _bind(fn: Any, inputs: list[Any]) -> Any:
    # Unpacked per call, as GraphRunner calls it: compiled code may clear the list it is given.
    return lambda: fn(*inputs)
