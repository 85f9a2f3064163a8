"""The benchmark job (``wire.BENCH_JOB``), run inside a worker.

The gate and the profile's tier comparison measure artifacts here, not in the user's process:
a benchmark there would take the GIL and the device from the user's calls. The worker loads
each tier's packed artifact, builds inputs from the same metadata the compile used (parameters
get random values of the right shape; timing does not depend on them), and benchmarks every
tier on those same inputs, one after the other. With ``graph_bytes`` the graph also runs as
it is (``eager``), so every tier gets a speed-up over eager.
"""

from __future__ import annotations

from typing import Any

from hotswap.engine.shipping.wire import BenchReply, BenchRequest, CachedEntry
from hotswap.profiles.records import BenchResult, Paired, TierBench
from hotswap.workers import stage

__all__ = ["bench_tiers"]


def bench_tiers(wire: dict[str, Any]) -> dict[str, Any]:
    import torch

    from hotswap import compat
    from hotswap.engine.loading.artifacts import load_entry
    from hotswap.engine.shipping.transport import land_graph
    from hotswap.jobs.compile import real_inputs
    from hotswap.profiles.bench import compare_tiers
    from hotswap.profiles.kernels import kernel_breakdown

    request = BenchRequest.from_wire(wire)
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
    pairs: list[Paired] = []
    with (stage("bench", graph=request.graph_id), torch.set_grad_enabled(request.grad_enabled),
          compat.intra_op_threads(request.num_threads)):
        if request.pair:
            benches, pairs = _pair(request, calls, device, errors)
        else:
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
    return BenchReply(benches, kernels, errors, pairs).to_wire()


def _pair(request: BenchRequest, calls: dict[str, Any], device: str, errors: dict[str, str],
          ) -> tuple[list[TierBench], list[Paired]]:
    """The gate's measurement: the request's two tiers in interleaved rounds."""
    from hotswap.profiles.bench import GATE_ROUNDS, measure_pair

    serving, candidate = request.pair
    if serving not in calls or candidate not in calls:
        for tier in {serving, candidate} - set(calls):
            errors.setdefault(tier, "nothing to run (not loaded)")
        return [], []
    try:
        pair = measure_pair(request.graph_id, serving, candidate, calls, device=device,
                            budget_ms=request.budget_ms, rounds=request.rounds or GATE_ROUNDS)
    except Exception as e:
        errors[candidate] = f"{type(e).__name__}: {e}"
        return [], []
    benches = [TierBench(request.graph_id, tier, BenchResult(ms, ms, ms, pair.clean,
                                                             pair.benchmarker),
                         device=device, purpose=request.purpose, contended=pair.contended,
                         rounds=pair.rounds)
               for tier, ms in ((serving, pair.serving_ms), (candidate, pair.candidate_ms))]
    return benches, [pair]


def _read(entry: bytes | CachedEntry) -> bytes | bytearray:
    if isinstance(entry, bytes):
        return entry
    from hotswap.cache import ArtifactCache

    # verified; no stamp, read-only: a benchmark writes nothing to the cache
    data = ArtifactCache(entry.cache_dir, read_only=True).get(entry.key, touch=False)
    if data is None:
        raise LookupError(f"the artifact cache no longer holds entry {entry.key[:12]}")
    return data


def _bind(fn: Any, inputs: list[Any]) -> Any:
    # Unpacked per call, as GraphRunner calls it: compiled code may clear the list it is given.
    return lambda: fn(*inputs)
