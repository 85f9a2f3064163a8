"""Benchmark a callable: ``triton.testing.do_bench`` on a GPU, ``torch.utils.benchmark`` on CPU.

Both return one record type, :class:`BenchResult` (median, p20, p80, n in ms) — not do_bench's
float-or-list. ``compare_tiers`` runs several callables (the tiers of one graph, and eager) on
the same inputs, in one process, one after the other, and reports speed-ups over eager.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

from hotswap.profiles.records import BenchResult, GateDecision, Paired, TierBench

__all__ = ["DEFAULT_BUDGET_MS", "GATE_ROUNDS", "MIN_CLEAN", "benchmark", "compare_tiers",
           "faster_by", "gate_decision", "measure_pair", "median_interval",
           "paired_from_medians"]

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
    contended: dict[str, int] = dict.fromkeys(tiers, 0)
    failed: dict[str, str] = {}
    order = list(tiers)
    for round_index in range(max(1, rounds)):
        for name in order if round_index % 2 == 0 else reversed(order):
            if name in failed:
                continue
            try:
                waited, start = _waited_ns(), time.perf_counter()
                samples[name].append(benchmark(tiers[name], device=device,
                                               budget_ms=budget_ms / max(1, rounds)))
                if not _clean(waited, time.perf_counter() - start):
                    contended[name] += 1  # someone else's work had a CPU this took
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
                      device=device, purpose=purpose, contended=contended[name],
                      rounds=len(samples[name]))
            for name, result in results.items()]


def _pool(parts: list[BenchResult]) -> BenchResult:
    """One result from several rounds: medians of the rounds' medians and percentiles."""
    return BenchResult(statistics.median(p.median_ms for p in parts),
                       statistics.median(p.p20_ms for p in parts),
                       statistics.median(p.p80_ms for p in parts),
                       sum(p.n for p in parts), parts[0].benchmarker)


# The gate's measurement (measure_pair): rounds of interleaved blocks, a decision needs
# MIN_CLEAN rounds free of preemption (fewer give no 95 % interval of a median).
GATE_ROUNDS = 24
MIN_CLEAN = 8
MAX_ROUNDS = 400
# A block's length: short, so that most blocks fit between a busy caller's calls (at idle
# priority beside a caller serving every 5 ms, 1 ms blocks were clean 48-59 times in 60 on our
# 2-core box, 3 ms blocks 28 times), yet long against a clock read and a device sync.
BLOCK_S = {"cpu": 0.001, "cuda": 0.002}


def _sync(device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.synchronize
    return lambda: None


def _waited_ns() -> int:
    """How long this process's threads have waited for a CPU, in all (the kernel's
    ``run_delay``: preempted, or woken while every core was taken). A block during which this
    grew was slowed by someone else's work; where the kernel does not say, involuntary context
    switches stand in (one counts as a millisecond)."""
    total = 0
    try:
        for task in os.listdir("/proc/self/task"):
            with (contextlib.suppress(FileNotFoundError, ProcessLookupError),
                  open(f"/proc/self/task/{task}/schedstat", "rb") as f):
                total += int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw * 1_000_000
    return total


# A block is clean when its threads waited for a CPU less than this share of it (waking a
# sleeping thread costs a few microseconds even on an idle machine).
WAIT_TOLERANCE = 0.02


def _block(fn: Callable[[], Any], calls: int, sync: Callable[[], None]) -> tuple[float, bool]:
    """(time per call of ``calls`` back-to-back calls, whether no thread of this process
    waited for a CPU meanwhile)."""
    before = _waited_ns()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    elapsed = time.perf_counter() - start
    return elapsed / calls, _clean(before, elapsed)


def _clean(waited_before_ns: int, elapsed_s: float) -> bool:
    """Whether this process's threads waited for a CPU less than WAIT_TOLERANCE of the
    ``elapsed_s`` since ``_waited_ns()`` read ``waited_before_ns``."""
    return (_waited_ns() - waited_before_ns) * 1e-9 <= WAIT_TOLERANCE * elapsed_s


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of ``values`` (order statistics: the
    j-th smallest and largest, j from the binomial); (-inf, inf) when too few values."""
    n = len(values)
    ordered = sorted(values)
    tail = (1.0 - confidence) / 2
    j, below = 0, 0.0
    while j < n // 2:
        below += math.comb(n, j) / 2 ** n  # P(at most j values below the median)
        if below > tail:
            break
        j += 1
    if j == 0:
        return -math.inf, math.inf
    return ordered[j - 1], ordered[n - j]


def measure_pair(graph_id: str, serving: str, candidate: str,
                 fns: Mapping[str, Callable[[], Any]], *, device: str = "cpu",
                 budget_ms: float = DEFAULT_BUDGET_MS, rounds: int = GATE_ROUNDS) -> Paired:
    """Time ``fns[serving]`` against ``fns[candidate]`` for about ``2 * budget_ms`` (never
    fewer than ``rounds`` rounds) in rounds of four short blocks of back-to-back calls, A B B
    A (B A A B the next round): each round's ratio compares blocks adjacent in time, so a
    machine that gets faster or slower (a host's frequency, a neighbour's load: 30 % from one
    second to the next on a VM) moves both tiers alike, and a linear drift within the round
    cancels. A block during which a thread of this process waited for a CPU (another task had
    it) is left out; a round left without a block of either tier is ``contended``. The ratio
    is the median of the clean rounds' ratios, with its 95 % distribution-free interval.

    What it represents: steady-state serving of back-to-back calls (warm caches; on a GPU,
    launch overhead included when a graph is launch-bound, since a block synchronizes once),
    which is what a tier costs a busy service per call."""
    sync = _sync(device)
    pair = (fns[serving], fns[candidate])
    per_call = 0.0
    for fn in pair:
        fn()  # lazy initialization, autotuning caches, ...
        sync()
        start = time.perf_counter()
        for _ in range(3):
            fn()
        sync()
        per_call = max(per_call, (time.perf_counter() - start) / 3, 1e-7)
    kind = "cuda" if device.startswith("cuda") else "cpu"
    calls = max(1, round(BLOCK_S[kind] / per_call))
    # As many rounds as the budget holds (two blocks per tier each), at least ``rounds``.
    rounds = max(MIN_CLEAN, rounds,
                 min(MAX_ROUNDS, int(budget_ms / 1000.0 / (2 * calls * per_call))))
    ratios: list[float] = []
    every: list[float] = []  # each round's ratio, contended rounds' from their fastest blocks
    times: list[tuple[float, float]] = []  # (serving, candidate) per call, each clean round
    fastest: list[tuple[float, float]] = []
    for index in range(rounds):
        order = (0, 1, 1, 0) if index % 2 == 0 else (1, 0, 0, 1)
        blocks: list[list[float]] = [[], []]  # clean blocks' time per call, per tier
        least = [math.inf, math.inf]
        for i in order:
            t, ok = _block(pair[i], calls, sync)
            least[i] = min(least[i], t)
            if ok:
                blocks[i].append(t)
        fastest.append((least[0], least[1]))
        if blocks[0] and blocks[1]:
            s_t, c_t = statistics.fmean(blocks[0]), statistics.fmean(blocks[1])
            times.append((s_t, c_t))
            ratios.append(c_t / s_t)
        every.append(ratios[-1] if blocks[0] and blocks[1] else least[1] / least[0])
    clean_rounds = len(ratios)
    low, high = median_interval(ratios)
    if not ratios:  # all contended: an estimate from the fastest blocks anyway
        ratios, times = [c / s for s, c in fastest], fastest
    return Paired(graph_id, serving, candidate,
                  serving_ms=1e3 * statistics.median(s for s, _ in times),
                  candidate_ms=1e3 * statistics.median(c for _, c in times),
                  ratio=statistics.median(ratios), ratio_low=low, ratio_high=high,
                  rounds=rounds, contended=rounds - clean_rounds, calls_per_block=calls,
                  device=device, benchmarker=f"paired rounds (A B B A blocks of {calls} calls)",
                  round_low=min(every), round_high=max(every),
                  clean_ratios=tuple(ratios[:clean_rounds]))


def paired_from_medians(graph_id: str, serving: str, serving_ms: float, candidate: str,
                        candidate_ms: float) -> Paired:
    """Two medians as a pair known exactly (a benchmarker that gives medians alone)."""
    ratio = candidate_ms / serving_ms
    return Paired(graph_id, serving, candidate, serving_ms, candidate_ms, ratio, ratio, ratio,
                  rounds=MIN_CLEAN, contended=0, benchmarker="medians", round_low=ratio,
                  round_high=ratio)


# Contention slows whichever block it lands in, so contended rounds do not give a median's
# interval; but it cannot make every round agree. With too few clean rounds, a pair is still
# decided when every round (contended ones by each tier's faster block) has the same tier ahead
# by more than the threshold, even the round most favourable to the loser, and their median
# puts it DECISIVE times ahead.
DECISIVE = 1.5
# Contended measurements in a row that each put the same tier ahead by more than the threshold
# (their paired rounds' median) decide: contention slows both tiers of a round alike and
# cannot make one tier look faster measurement after measurement.
CONSISTENT = 3
# Contended measurements after which a pair whose ratios' geometric mean has the candidate at
# most CLOSE_MARGIN thresholds faster is too close to call on this machine, or the candidate
# slower: the serving tier stays. (Within the margin either way, the cold demo's
# max-autotune, 4-9 % slower on average, was measured seven times, 70 s, before one close
# mean kept it out.)
# Each measurement's ratio is the median of its clean rounds: where every one had some (and
# MIN_CLEAN together), contention bent none and the verdict is "close"; where one came from
# contended rounds alone (their fastest blocks, pulled toward 1.0), "low" and a later process
# measures it again. A pair
# still undecided at its last attempt whose 95 % interval of clean rounds has the candidate
# at most CLOSE_MARGIN thresholds faster is a "close" verdict: the serving tier stays, and
# what that may cost is bounded (CLOSE_MARGIN * threshold, 5 % at the default 2 %), so later
# processes take it as it is instead of measuring the pair again at every start. How much
# slower the candidate might be costs nothing: it does not serve. (Beside a test run, an
# interval of -6.2 % to +4.1 % was kept "low" under an either-way rule, and the next start
# spent 51 s measuring the pair again.)
CLOSE_AFTER = 5
CLOSE_MARGIN = 2.5


def direction(pair: Paired, threshold: float) -> int:
    """+1 where the candidate is ahead by more than ``threshold`` (the paired median), -1 where
    the serving tier is, 0 in between."""
    if pair.ratio <= 1.0 - threshold:
        return 1
    if pair.ratio * (1.0 - threshold) >= 1.0:
        return -1
    return 0


def gate_decision(pair: Paired, *, threshold: float, time_s: float = 0.0, attempt: int = 1,
                  last_attempt: bool = True, streak: int = 0,
                  contended_mean: tuple[int, float, bool] | None = None) -> GateDecision:
    """Adopt the candidate when it is ``threshold`` faster (0.02: 2 %) and surely faster (its
    interval's slow end still gains); keep it out when even the fast end of the interval gains
    less than ``threshold``. With fewer than MIN_CLEAN clean rounds, decide only when every
    round, contended ones included, puts the same tier DECISIVE times ahead, or when this one
    and the ``streak`` contended measurements before it (signed: +n the candidate ahead, -n
    the serving tier) put the same tier ahead by more than ``threshold``, CONSISTENT in all.
    ``contended_mean``: (how many contended measurements of the pair, this one included; the
    geometric mean of their ratios; whether every one's ratio came from clean rounds, MIN_CLEAN
    of them together); from CLOSE_AFTER on, a mean that has the candidate at most
    CLOSE_MARGIN thresholds faster (slower by any amount included) keeps the serving tier:
    "close" where the ratios came from clean rounds (contention bent none of them), else "low"
    (too close to call, or slower, here; a later process measures again).
    Anything else is "undecided" — unless ``last_attempt``: then the serving tier stays,
    "close" where the interval's fast end has the candidate at most CLOSE_MARGIN thresholds
    faster (what keeping the serving tier may cost), else "low" (a later process measures it
    again).

    One statistic, the median of the paired rounds' ratios, gives both the verdict and the
    number its reason states ("eager is 5.8% faster than default; kept eager")."""
    gain = 1.0 - pair.ratio
    gain_low, gain_high = 1.0 - pair.ratio_high, 1.0 - pair.ratio_low
    decided_by: tuple[float, str] | None = None  # a statistic other than this pair's median
    if pair.clean >= MIN_CLEAN:
        if gain >= threshold and gain_low > 0:
            outcome, confidence, why = "adopt", "confident", "faster"
        elif gain_high < threshold:
            outcome, confidence, why = "keep", "confident", "not faster"
        else:
            outcome, confidence, why = "undecided", "", "the interval straddles the threshold"
    else:
        outcome, confidence, why = _every_round(pair, threshold)
        way = direction(pair, threshold)
        if outcome == "undecided" and way and streak * way + 1 >= CONSISTENT:
            outcome = "adopt" if way > 0 else "keep"
            confidence = "confident"
            why = (f"{'faster' if way > 0 else 'slower'} by more than the threshold in each "
                   f"of {streak * way + 1} contended measurements in a row")
        elif outcome == "undecided" and contended_mean is not None:
            count, mean, pooled = contended_mean
            if count >= CLOSE_AFTER and math.log(mean) >= -CLOSE_MARGIN * threshold:
                outcome, confidence = "keep", "close" if pooled else "low"
                slower = mean >= 1.0 / (1.0 - threshold)  # as direction() says -1
                why = (f"{'slower' if slower else 'too close to call'} on this machine: over "
                       f"{count} contended measurements the ratio averaged {mean:.3f} "
                       f"(geometric mean); the serving tier stays")
                decided_by = (mean, f"over {count} measurements")
    if outcome == "undecided" and last_attempt:  # no verdict on noise: what serves stays
        margin = CLOSE_MARGIN * threshold
        close = pair.clean >= MIN_CLEAN and gain_high <= margin
        outcome, confidence = "keep", "close" if close else "low"
        why += f"; still undecided at attempt {attempt}: the serving tier stays"
        if close:
            why += (f" (the candidate is at most {max(gain_high, 0.0):.1%} faster, within "
                    f"{margin:.0%}: what keeping it out may cost)")
    return GateDecision(pair.graph_id, pair.candidate, pair.serving, outcome == "adopt",
                        _words(pair, outcome, confidence, why, threshold, decided_by),
                        pair.candidate_ms, pair.serving_ms, threshold, time_s, outcome,
                        confidence, gain, _finite(gain_low), _finite(gain_high), pair.rounds,
                        pair.contended, attempt)


def _every_round(pair: Paired, threshold: float) -> tuple[str, str, str]:
    """(outcome, confidence, why) of a pair with too few clean rounds."""
    low, high = pair.round_low, pair.round_high
    if low is not None and high is not None and pair.rounds >= MIN_CLEAN:
        every = (f"in every one of {pair.rounds} rounds ({pair.contended} contended: "
                 f"{_range(low, high)})")
        if 1.0 - high >= threshold and pair.ratio * DECISIVE <= 1.0:
            return "adopt", "confident", f"faster by more than the threshold {every}"
        if 1.0 - 1.0 / low >= threshold and pair.ratio >= DECISIVE:
            return "keep", "confident", f"slower by more than the threshold {every}"
    return "undecided", "", (f"contended: {pair.contended} of {pair.rounds} rounds preempted"
                             + (f"; rounds {_range(low, high)}" if low and high else ""))


def _range(low: float, high: float) -> str:
    return f"candidate / serving from {low:.2f} to {high:.2f}"


def _name(tier: str) -> str:
    return tier if tier == "eager" else repr(tier)


def faster_by(fast_over_slow: float) -> str:
    """How much faster, from the faster tier's time over the slower one's: "5.8%" (the time
    it saves, of the slower one's), or "2.3x" from twice as fast on."""
    if fast_over_slow <= 0.5:
        return f"{1.0 / fast_over_slow:.1f}x"
    return f"{100.0 * (1.0 - fast_over_slow):.1f}%"


def _words(pair: Paired, outcome: str, confidence: str, why: str, threshold: float,
           decided_by: tuple[float, str] | None = None) -> str:
    """A verdict as the user reads it: which tier is faster and by how much (the paired
    ratio, whose sign the verdict follows), what was done, then the evidence. ``decided_by``:
    the ratio that decided where it is not this measurement's (the mean over several, and
    over what), which the head then states."""
    c, s, r = _name(pair.candidate), _name(pair.serving), pair.ratio
    if decided_by is not None:
        r, over = decided_by
        # kept within the close band: a candidate ahead by less than that band is "within",
        # never "faster ... kept" the other one
        head = (f"{s} is {faster_by(1.0 / r)} faster than {c} {over}"
                if r > 1.0 and outcome != "adopt"
                else f"{c} and {s} are within {abs(100.0 * (1.0 - r)):.1f}% of each other "
                     f"{over}")
        head += {"adopt": f"; adopted {c}", "keep": f"; kept {s}"}.get(outcome, "")
        return (f"{head} (this measurement: {c} {pair.candidate_ms:.4f} ms, {s} "
                f"{pair.serving_ms:.4f} ms per call, {pair.clean} of {pair.rounds} rounds "
                f"clean; adopts at >= {100 * threshold:.1f}% faster; {confidence}: {why})")
    if r < 1.0:
        head, advantage = f"{c} is {faster_by(r)} faster than {s}", r
    elif r > 1.0:
        head, advantage = f"{s} is {faster_by(1.0 / r)} faster than {c}", 1.0 / r
    else:
        head, advantage = f"{c} and {s} measured the same", 1.0
    head += {"adopt": f"; adopted {c}", "keep": f"; kept {s}"}.get(outcome, " so far; deciding")
    # the interval, in the same words: the faster tier's advantage at each end
    ends = sorted((pair.ratio_low, pair.ratio_high) if r < 1.0
                  else (1.0 / pair.ratio_high, 1.0 / pair.ratio_low), reverse=True)
    if any(math.isinf(e) or e <= 0 for e in ends) or pair.clean < MIN_CLEAN:
        interval = ""
    elif advantage <= 0.5:
        interval = f", 95% interval {1.0 / ends[0]:.1f}x to {1.0 / ends[1]:.1f}x"
    else:
        interval = (f", 95% interval {100.0 * (1.0 - ends[0]):+.1f}% to "
                    f"{100.0 * (1.0 - ends[1]):+.1f}%")
    source = (f"median of {pair.clean} paired rounds" if pair.clean
              else f"median of {pair.rounds} contended rounds, their fastest blocks")
    if pair.measurements > 1:
        source += f", the clean ones of {pair.measurements} measurements together"
    rounds = f"{pair.clean} of {pair.rounds} rounds clean" + (
        f", {pair.contended} contended" if pair.contended else "")
    per_call = (f"per call {c} {pair.candidate_ms:.4f} ms, {s} {pair.serving_ms:.4f} ms"
                + (" (contended)" if pair.clean < MIN_CLEAN
                   else " (the last measurement's)" if pair.measurements > 1 else ""))
    if (pair.candidate_ms - pair.serving_ms) * (r - 1.0) < 0:
        per_call += " (these medians point the other way; the paired rounds decide)"
    return (f"{head} ({source}{interval}; {rounds}; {per_call}; adopts at >= "
            f"{100 * threshold:.1f}% faster; " + (f"{confidence}: {why})" if confidence
                                                  else f"{why})"))


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
