"""Benchmark a callable: ``triton.testing.do_bench`` on a GPU, ``torch.utils.benchmark`` on CPU.

Both return one record type, :class:`BenchResult` (median, p20, p80, n in ms) — not do_bench's
float-or-list. ``compare_tiers`` runs several callables (the tiers of one graph, and eager) on
the same inputs, in one process, one after the other, and reports speed-ups over eager.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Mapping
from typing import Any

from hotswap.profiles.records import BenchResult, GateDecision, TierBench

__all__ = ["DEFAULT_BUDGET_MS", "benchmark", "compare_tiers", "gate_decision"]

log = logging.getLogger("hotswap")

DEFAULT_BUDGET_MS = 200.0


def benchmark(fn: Callable[[], Any], *, device: str = "cpu",
              budget_ms: float = DEFAULT_BUDGET_MS) -> BenchResult:
    """Time ``fn()`` for about ``budget_ms`` after a warm-up call (which pays lazy init)."""
    if budget_ms <= 0:
        raise ValueError(f"budget_ms must be > 0, got {budget_ms!r}")
    if device.startswith("cuda"):
        return _gpu(fn, budget_ms)
    return _cpu(fn, budget_ms)


def _gpu(fn: Callable[[], Any], budget_ms: float) -> BenchResult:
    from triton.testing import do_bench

    # do_bench's own split: a quarter of the budget warms up, the rest measures; "all" gives
    # every sample so the percentiles are ours, not a mix of return modes.
    samples = do_bench(fn, warmup=max(1, int(budget_ms / 4)), rep=max(1, int(budget_ms)),
                       return_mode="all")
    return BenchResult.from_samples([float(s) for s in samples], "triton.testing.do_bench")


def _cpu(fn: Callable[[], Any], budget_ms: float) -> BenchResult:
    from torch.utils import benchmark as torch_benchmark

    fn()  # warm-up
    timer = torch_benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=_threads())
    measurement = timer.blocked_autorange(min_run_time=budget_ms / 1000.0)
    # ``times`` holds one per-call average per block of ``number_per_run`` calls.
    samples = [t * 1000.0 for t in measurement.times]
    result = BenchResult.from_samples(samples, "torch.utils.benchmark")
    return BenchResult(result.median_ms, result.p20_ms, result.p80_ms,
                       len(samples) * measurement.number_per_run, result.benchmarker)


def _threads() -> int:
    import torch

    return int(torch.get_num_threads())


def compare_tiers(graph_id: str, tiers: Mapping[str, Callable[[], Any]], *, device: str = "cpu",
                  budget_ms: float = DEFAULT_BUDGET_MS, rounds: int = 4, purpose: str = "compare",
                  errors: dict[str, str] | None = None) -> list[TierBench]:
    """Benchmark every callable of ``tiers`` (name -> zero-argument call; ``"eager"`` among them
    gives speed-ups) for about ``budget_ms`` each.

    The budget is split into ``rounds`` that visit the tiers in alternating order (A B, B A,
    ...), and each tier's samples are pooled: a load that comes and goes on a shared machine
    then weighs on every tier alike instead of on whichever ran during it. A tier that raises
    is left out of the result; its reason goes to ``errors`` when given.
    """
    samples: dict[str, list[BenchResult]] = {name: [] for name in tiers}
    failed: dict[str, str] = {}
    order = list(tiers)
    for round_index in range(max(1, rounds)):
        for name in order if round_index % 2 == 0 else reversed(order):
            if name in failed:
                continue
            try:
                samples[name].append(benchmark(tiers[name], device=device,
                                               budget_ms=budget_ms / max(1, rounds)))
            except Exception as e:
                log.debug("benchmark of %s/%s raised", graph_id, name, exc_info=True)
                failed[name] = f"{type(e).__name__}: {e}"
    if errors is not None:
        errors.update(failed)
    results = {name: _pool(parts) for name, parts in samples.items() if parts and name not in failed}
    eager = results.get("eager")
    return [TierBench(graph_id, name, result,
                      speedup_vs_eager=(eager.median_ms / result.median_ms
                                        if eager and result.median_ms > 0 else None),
                      device=device, purpose=purpose)
            for name, result in results.items()]


def _pool(parts: list[BenchResult]) -> BenchResult:
    """One result from several rounds: medians of the rounds' medians and percentiles."""
    return BenchResult(statistics.median(p.median_ms for p in parts),
                       statistics.median(p.p20_ms for p in parts),
                       statistics.median(p.p80_ms for p in parts),
                       sum(p.n for p in parts), parts[0].benchmarker)


def gate_decision(graph_id: str, *, candidate: str, candidate_result: BenchResult, serving: str,
                  serving_result: BenchResult, threshold: float, time_s: float = 0.0,
                  ) -> GateDecision:
    """Adopt ``candidate`` only if its median beats the serving tier's by ``threshold``
    (0.02: at least 2 % faster)."""
    gain = 1.0 - candidate_result.median_ms / serving_result.median_ms
    adopt = gain >= threshold
    reason = (f"{candidate_result.median_ms:.4f} ms vs {serving_result.median_ms:.4f} ms for "
              f"{serving!r}: {100 * gain:+.1f}% (adopts at >= {100 * threshold:.1f}% faster)")
    return GateDecision(graph_id, candidate, serving, adopt, reason, candidate_result.median_ms,
                        serving_result.median_ms, threshold, time_s)
