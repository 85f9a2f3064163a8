"""Chrome / Perfetto trace export of a run's records (Trace Event Format, JSON object form).

    process "hotswap coordinator"  tracks: the user's threads (calls, named by the tier that
                                   answered them), hotswap-load (loads, swaps), dynamo
    process "hotswap worker <pid>" one track per worker: its compile stages, inductor's events
                                   nested inside them
    global instant events          swaps and gate decisions

``merge_torch_trace`` folds in a ``torch.profiler`` trace of the same run (its
``export_chrome_trace`` file): hotswap marks each profiled call with a ``hotswap.call <graph>
#<n>`` range, and the offset between the two clocks is read off those marks, so kernels line up
under the calls that launched them.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterable
from typing import Any

from hotswap.profiles.records import Call, GateDecision, RunInfo, Span, Swap

__all__ = ["CALL_MARK", "call_mark", "chrome_trace", "merge_torch_trace", "write_chrome_trace"]

CALL_MARK = "hotswap.call"
_TID_BASE = 1_000_000  # clear of the OS thread ids a torch.profiler trace uses
# Chrome's reserved colour names, by tier rank (eager first); Perfetto colours by name instead.
_COLOURS = ("grey", "yellow", "olive", "good", "rail_response", "cq_build_passed")


def chrome_trace(records: Iterable[Any]) -> dict[str, Any]:
    """The Trace Event JSON object (``{"traceEvents": [...], ...}``) for ``records``."""
    records = list(records)
    run = next((r for r in records if isinstance(r, RunInfo)), None)
    base_s = run.started_s if run else min((_start(r) for r in records), default=0.0)
    main_pid = run.pid if run else 0
    events: list[dict[str, Any]] = []
    tids: dict[tuple[int, str], int] = {}
    pids: set[int] = set()

    def tid(pid: int, track: str) -> int:
        key = (pid, track)
        if key not in tids:
            tids[key] = _TID_BASE + len(tids)
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tids[key],
                           "args": {"name": track}})
        if pid not in pids:
            pids.add(pid)
            label = "hotswap coordinator" if pid == main_pid else f"hotswap worker {pid}"
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                           "args": {"name": label}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                           "args": {"sort_index": 0 if pid == main_pid else 1}})
        return tids[key]

    def us(t: float) -> float:
        return round((t - base_s) * 1e6, 3)

    ranks: dict[str, int] = {"eager": 0}
    for record in records:
        if isinstance(record, Span):
            events.append({"ph": "X", "name": record.name, "cat": record.category or "stage",
                           "pid": record.pid, "tid": tid(record.pid, record.track),
                           "ts": us(record.start_s),
                           "dur": round(record.duration_s * 1e6, 3),
                           "args": {"graph": record.graph_id, "tier": record.tier}})
        elif isinstance(record, Call):
            rank = ranks.setdefault(record.tier, len(ranks))
            events.append({"ph": "X", "name": f"{record.graph_id} [{record.tier}]", "cat": "call",
                           "pid": main_pid, "tid": tid(main_pid, record.track),
                           "ts": us(record.start_s),
                           "dur": round((record.end_s - record.start_s) * 1e6, 3),
                           "cname": _COLOURS[min(rank, len(_COLOURS) - 1)],
                           "args": {"graph": record.graph_id, "tier": record.tier,
                                    "seq": record.seq}})
        elif isinstance(record, Swap):
            events.append({"ph": "i", "s": "g", "cat": "swap", "pid": main_pid, "tid": 0,
                           "name": f"{record.reason} {record.graph_id}: {record.old_tier} -> "
                                   f"{record.new_tier}",
                           "ts": us(record.time_s)})
        elif isinstance(record, GateDecision):
            verdict = ("undecided on" if record.outcome == "undecided"
                       else "adopt" if record.adopt else "keep out")
            events.append({"ph": "i", "s": "g", "cat": "gate", "pid": main_pid, "tid": 0,
                           "name": f"gate {record.graph_id}: {verdict} {record.candidate}",
                           "ts": us(record.time_s), "args": {"reason": record.reason}})
    other: dict[str, Any] = {"hotswap": {"base_monotonic_s": base_s}}
    if run is not None:
        other["hotswap"].update(pid=run.pid, started_unix_s=run.started_unix_s,
                                argv=list(run.argv), versions=run.versions)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _start(record: Any) -> float:
    for name in ("start_s", "time_s"):
        if hasattr(record, name):
            return float(getattr(record, name))
    return float("inf")


def merge_torch_trace(ours: dict[str, Any], torch_trace: dict[str, Any] | str) -> dict[str, Any]:
    """Our trace shifted onto a torch.profiler trace's clock, and both sets of events together.

    Raises ValueError if the torch trace has none of hotswap's call marks (it was not recorded
    while hotswap served calls with profiling on), since nothing would line up.
    """
    if isinstance(torch_trace, str | os.PathLike):
        with open(torch_trace) as f:
            torch_trace = json.load(f)
    assert isinstance(torch_trace, dict)
    theirs = torch_trace.get("traceEvents", [])
    marks = {e["name"]: float(e["ts"]) for e in theirs
             if e.get("ph") == "X" and str(e.get("name", "")).startswith(CALL_MARK + " ")}
    offsets = []
    for event in ours["traceEvents"]:
        if event.get("cat") != "call":
            continue
        mark = marks.get(call_mark(event["args"]["graph"], event["args"]["seq"]))
        if mark is not None:
            offsets.append(mark - event["ts"])
    if not offsets:
        raise ValueError("the torch.profiler trace has no hotswap call marks to align on; record "
                         "it while hotswap serves calls with profiling on")
    offset = statistics.median(offsets)
    shifted = [dict(e, ts=round(e["ts"] + offset, 3)) if "ts" in e and e.get("ph") != "M" else e
               for e in ours["traceEvents"]]
    merged = dict(torch_trace)
    merged["traceEvents"] = list(theirs) + shifted
    other = dict(torch_trace.get("otherData") or {})
    other["hotswap"] = dict(ours.get("otherData", {}).get("hotswap", {}), offset_us=offset,
                            aligned_calls=len(offsets))
    merged["otherData"] = other
    return merged


def call_mark(graph_id: str, seq: int) -> str:
    """The name of the torch.profiler range around a graph's ``seq``-th call."""
    return f"{CALL_MARK} {graph_id} #{seq}"


def write_chrome_trace(path: str | os.PathLike[str], trace: dict[str, Any]) -> None:
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w") as f:
        json.dump(trace, f)
    os.replace(tmp, path)
