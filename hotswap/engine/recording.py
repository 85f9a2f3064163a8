"""The coordinator's side of the profile: one timeline per run, fed from every stage.

    dynamo (user thread)   --> dynamo_trace, serialize spans       \\
    pool manager thread    --> worker StageEvents (at job end)      +--> Timeline --> records file
    loader thread          --> queue_wait, transfer, load, swap     /                 (profile_dir)
    GraphJourney           --> swaps, first call on a new tier     /
    ProfiledGraphRunner    --> every call (profiling runs only)   /

A span of a stage also adds to its graph's ``status().timings_s`` (journey.py).

Without ``profile_dir`` each coordinator keeps its own in-memory timeline (what ``status``
reports); with it, every coordinator of the process shares one timeline per directory, written
to ``<profile_dir>/run-<time>-<pid>.records.msgpack``.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, Protocol

import torch

from hotswap import compat
from hotswap.engine.graph import GraphRunner, ProfiledGraphRunner
from hotswap.engine.options import Tier
from hotswap.engine.shipping.keys import graph_signature
from hotswap.profiles.records import GRAPH_TIER, GraphInfo, Span
from hotswap.profiles.timeline import Timeline, category_of, self_time_by_category

__all__ = ["GRAPH_TIER", "PROFILE_CONFIG", "Recorder", "profiled"]

# Inductor config for profiling runs: kernels named for what they fuse, C++ kernels visible to
# torch.profiler (as inductor's own ``compiled_module.py -p`` wants them).
PROFILE_CONFIG = {"triton.unique_kernel_names": True, "cpp.enable_kernel_profile": True}



def profiled(tier: Tier) -> Tier:
    """The tier as profiling runs compile it: kernels named for profilers (keys this torch has)."""
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    extra = {k: v for k, v in PROFILE_CONFIG.items() if k in known and k not in tier.config}
    return replace(tier, config={**tier.config, **extra})


_shared: dict[str, Timeline] = {}
_shared_lock = threading.Lock()


def _versions() -> dict[str, str]:
    from importlib import metadata

    found = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for name in ("hotswap", "triton"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def shared_timeline(directory: str) -> Timeline:
    key = os.path.realpath(directory)
    with _shared_lock:
        timeline = _shared.get(key)
        if timeline is None:
            timeline = _shared[key] = Timeline(directory, argv=sys.argv, versions=_versions())
        return timeline


class Timed(Protocol):
    """What a span is about: a graph, whose status adds up its stages' times."""

    graph_id: str

    def add_timing(self, key: str, seconds: float, *, accumulate: bool = True) -> None: ...

    def add_timings(self, added: dict[str, float], replaced: dict[str, float]) -> None: ...


class Recorder:
    """Spans, swaps and calls of one coordinator's graphs, on the run's timeline."""

    def __init__(self, profile_dir: str | None) -> None:
        self.profiling = profile_dir is not None
        self.timeline = shared_timeline(profile_dir) if profile_dir else Timeline()
        if self.profiling:
            compat.watch_dynamo_traces()

    def runner(self, graph_id: str, gm: torch.fx.GraphModule, tiers: list[str],
               **kwargs: Any) -> GraphRunner:
        if self.profiling:
            runner: GraphRunner = ProfiledGraphRunner(graph_id, gm, tiers,
                                                      timeline=self.timeline, **kwargs)
        else:
            runner = GraphRunner(graph_id, gm, tiers, **kwargs)
        return runner

    def graph_seen(self, graph_id: str, gm: torch.fx.GraphModule, example_inputs: list[Any],
                   origin: str) -> None:
        """What ``graph_id`` stands for, so that another run's report finds the same graph."""
        if self.profiling:
            self.timeline.add(GraphInfo(graph_id, graph_signature(gm, example_inputs), origin))

    def span(self, graph: Timed, tier: str, name: str, start_s: float, end_s: float, *,
             pid: int | None = None, track: str | None = None, category: str = "") -> None:
        self.timeline.add(Span(name, start_s, end_s, graph.graph_id, tier, pid or os.getpid(),
                               track or threading.current_thread().name, category))
        if not category:
            key = name if tier == GRAPH_TIER else f"{tier}/{name}"
            graph.add_timing(key, end_s - start_s)

    def dynamo_trace(self, graph: Timed, backend_called_s: float) -> None:
        """The trace that led to this backend call (profiling runs; needs torch's callbacks)."""
        start = compat.dynamo_trace_start()
        if start is not None and start <= backend_called_s:
            self.span(graph, GRAPH_TIER, "dynamo_trace", start, backend_called_s)
        compat.watch_dynamo_traces()  # again, for the traces after a dynamo reset

    def worker_job(self, graph: Timed, tier: str, events: Iterable[Any],
                   submitted_s: float, done_s: float) -> None:
        """A finished worker job's StageEvents, plus the queue wait before it and the transfer
        of its result after it (worker and coordinator share the monotonic clock). The
        graph's timings are told once, at the end."""
        events = list(events)
        inner: list[Span] = []
        added: dict[str, float] = {}
        for event in events:
            category = category_of(event.name) if event.attrs.get("inductor") else ""
            span = Span(event.name, event.start_s, event.end_s, graph.graph_id, tier, event.pid,
                        f"worker {event.pid}", category)
            self.timeline.add(span)
            if category:
                inner.append(span)
            else:
                key = f"{tier}/{event.name}"
                added[key] = added.get(key, 0.0) + event.end_s - event.start_s
        replaced = {f"{tier}/compile:{category}": seconds
                    for category, seconds in self_time_by_category(inner).items()}
        graph.add_timings(added, replaced)
        if events:
            first = min(e.start_s for e in events)
            last = max(e.end_s for e in events)
            self.span(graph, tier, "queue_wait", submitted_s, max(submitted_s, first),
                      track="hotswap-queue")
            self.span(graph, tier, "transfer", min(last, done_s), done_s, track="hotswap-pipe")
