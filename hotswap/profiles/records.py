"""The records a profile is made of: spans, calls, swaps, benchmarks, gate decisions, kernels.

Every record is a frozen dataclass that turns into a plain dict (``to_dict``) with a ``type``
field, and back (``record_from_dict``): the msgpack record file, the chrome trace and the
reports all read the same records. Times are ``time.monotonic()`` seconds (system-wide on
Linux, so a worker's readings and the coordinator's share one axis); durations carry their unit.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "GRAPH_TIER", "PROCESS", "BenchResult", "Call", "GateDecision", "GraphInfo", "KernelBreakdown", "Paired",
    "Record", "RunInfo", "Span", "Swap", "TierBench", "record_from_dict",
]


# The tier of spans that belong to the graph, not to one of its tiers (dynamo trace, serialize).
GRAPH_TIER = "-"
# The graph id of spans that belong to the process, not to a graph (the load path's warm-up):
# in the records and the trace, not in a report's graphs.
PROCESS = "process"


class _Record:
    type: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        for name, value in data.items():
            if isinstance(value, _Record):
                data[name] = value.to_dict()
        data["type"] = self.type
        return data


@dataclass(frozen=True)
class RunInfo(_Record):
    """The first record of a run: where and when it ran."""

    type: ClassVar[str] = "run"
    started_s: float          # monotonic
    started_unix_s: float     # wall clock at the same moment (for humans and for merging)
    pid: int
    argv: tuple[str, ...] = ()
    versions: dict[str, str] = field(default_factory=dict)
    device: str = ""


@dataclass(frozen=True)
class GraphInfo(_Record):
    """What a graph id of this run stands for: ``signature`` hashes the graph's code and its
    inputs' shapes and dtypes (the same graph has the same one in another run, whatever its id
    there); ``origin`` is where the user's code made it, e.g. ``forward (model.py:12)``."""

    type: ClassVar[str] = "graph"
    graph_id: str
    signature: str
    origin: str = ""


@dataclass(frozen=True)
class Span(_Record):
    """A timed stage of one graph's tier: ``name`` is a stage (``queue_wait``, ``load``...) or
    an inductor event inside a worker's compile (``GraphLowering.run``...); ``category`` groups
    those (``lowering``, ``autotuning``...). ``track`` names the thread or worker it ran on."""

    type: ClassVar[str] = "span"
    name: str
    start_s: float
    end_s: float
    graph_id: str
    tier: str
    pid: int
    track: str
    category: str = ""

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Call(_Record):
    """One user call of a graph and the tier that answered it."""

    type: ClassVar[str] = "call"
    graph_id: str
    tier: str
    start_s: float
    end_s: float
    track: str
    seq: int = 0              # the graph's n-th call (1-based), as marked for torch.profiler


@dataclass(frozen=True)
class Swap(_Record):
    type: ClassVar[str] = "swap"
    graph_id: str
    old_tier: str
    new_tier: str
    time_s: float
    reason: str = ""          # "swap", "kept", "failed", "dropped"


@dataclass(frozen=True)
class BenchResult(_Record):
    """Timing of one callable: median and the 20th/80th percentiles of ``n`` samples, in ms."""

    type: ClassVar[str] = "bench_result"
    median_ms: float
    p20_ms: float
    p80_ms: float
    n: int
    benchmarker: str = ""

    @classmethod
    def from_samples(cls, samples_ms: list[float], benchmarker: str) -> BenchResult:
        if not samples_ms:
            raise ValueError("no samples to summarize")
        ordered = sorted(samples_ms)

        def pct(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]

        return cls(statistics.median(ordered), pct(0.2), pct(0.8), len(ordered), benchmarker)

    @property
    def spread(self) -> float:
        """(p80 - p20) / median: how noisy the measurement was."""
        return (self.p80_ms - self.p20_ms) / self.median_ms if self.median_ms else 0.0


@dataclass(frozen=True)
class TierBench(_Record):
    """One tier (or ``eager``) of one graph, benchmarked on the same inputs as its siblings."""

    type: ClassVar[str] = "tier_bench"
    graph_id: str
    tier: str
    result: BenchResult
    speedup_vs_eager: float | None = None
    device: str = ""
    purpose: str = "compare"   # "gate" (decided a swap) or "compare" (the profile's table)
    # Of the measurement's ``rounds``, how many a thread of the measuring process spent waiting
    # for a CPU another task held (bench.WAIT_TOLERANCE): its figures are upper bounds then.
    contended: int = 0
    rounds: int = 0


@dataclass(frozen=True)
class Paired(_Record):
    """Two tiers timed in paired rounds on the same inputs (profiles/bench.measure_pair).

    Each round times four blocks of ``calls_per_block`` back-to-back calls, A B B A (the
    order flips round to round); ``ratio`` is the median over rounds of candidate / serving,
    and ``ratio_low``/``ratio_high`` its 95 % distribution-free interval. A round in which
    this process waited for a CPU is ``contended`` and left out of the ratio and its interval;
    ``round_low``/``round_high`` bound every round's ratio, contended rounds included (their
    fastest blocks): the direction contention cannot fake when all rounds agree by a wide
    margin (None: not known, a record from medians). ``clean_ratios``: the clean rounds'
    ratios, which the gate pools over contended measurements of the pair; ``measurements``:
    how many measurements a pooled pair's rounds came from (gate.decide)."""

    type: ClassVar[str] = "paired"
    graph_id: str
    serving: str
    candidate: str
    serving_ms: float       # per call: the median over clean rounds
    candidate_ms: float
    ratio: float            # candidate / serving
    ratio_low: float
    ratio_high: float
    rounds: int             # rounds measured (clean + contended)
    contended: int
    calls_per_block: int = 1
    device: str = ""
    benchmarker: str = ""
    round_low: float | None = None
    round_high: float | None = None
    clean_ratios: tuple[float, ...] = ()
    measurements: int = 1

    @property
    def clean(self) -> int:
        return self.rounds - self.contended


@dataclass(frozen=True)
class GateDecision(_Record):
    """Whether a ready tier replaced the serving one, and the measurements that decided it.
    ``outcome``: "adopt", "keep" or "undecided" (kept for now, measured again later);
    ``confidence``: "confident" (the interval is clear of the threshold), "close" (kept what
    serves: the candidate is at most bench.CLOSE_MARGIN thresholds faster, all that keeping it
    out may cost), "low"
    (the last attempt decided on its estimate alone) or "" (undecided). ``gain_*`` is 1 - ratio: the
    candidate's speed-up over the serving tier and its 95 % interval."""

    type: ClassVar[str] = "gate"
    graph_id: str
    candidate: str
    serving: str
    adopt: bool
    reason: str
    candidate_ms: float
    serving_ms: float
    threshold: float
    time_s: float = 0.0
    outcome: str = ""
    confidence: str = ""
    gain: float | None = None
    gain_low: float | None = None
    gain_high: float | None = None
    rounds: int = 0
    contended: int = 0
    attempt: int = 1


@dataclass(frozen=True)
class KernelBreakdown(_Record):
    """Device (or CPU) time of one tier by kernel category, from a profiler pass over ``calls``
    calls. ``busy_pct``: kernel time (overlaps merged) over wall time, inductor's "GPU busy"."""

    type: ClassVar[str] = "kernels"
    graph_id: str
    tier: str
    device: str
    calls: int
    wall_ms: float
    busy_pct: float
    category_ms: dict[str, float] = field(default_factory=dict)
    top_kernels: tuple[tuple[str, str, float, int], ...] = ()  # (name, category, total ms, count)


Record = (RunInfo | GraphInfo | Span | Call | Swap | TierBench | Paired | GateDecision
          | KernelBreakdown)

_TYPES: dict[str, type[Any]] = {cls.type: cls for cls in (
    RunInfo, GraphInfo, Span, Call, Swap, BenchResult, TierBench, Paired, GateDecision,
    KernelBreakdown)}


def record_from_dict(data: dict[str, Any]) -> Any:
    """The record a ``to_dict`` made (unknown fields are ignored: newer files stay readable)."""
    cls = _TYPES.get(data.get("type", ""))
    if cls is None:
        raise ValueError(f"unknown profile record type {data.get('type')!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in data.items() if k in names}
    for name, value in kwargs.items():
        if isinstance(value, dict) and "type" in value:
            kwargs[name] = record_from_dict(value)
        elif name == "clean_ratios":  # anything but a list of numbers: none (older records)
            kwargs[name] = (tuple(float(v) for v in value) if isinstance(value, list)
                            and all(isinstance(v, int | float) for v in value) else ())
        elif isinstance(value, list) and name in ("argv", "top_kernels"):
            kwargs[name] = tuple(tuple(v) if isinstance(v, list) else v for v in value)
    return cls(**kwargs)
