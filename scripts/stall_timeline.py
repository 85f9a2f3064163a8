"""What ran while a bench row's calls were slow: each slow call and late probe wake beside
the stages that overlapped it, on the user's clock (seconds since the row's process started).

    HOTSWAP_PROFILE_DIR=prof hotswap bench ... --json bench.json
    python scripts/stall_timeline.py bench.json prof [--min-ms 20]

Reads the rows' ``slowest_calls`` and ``probe_worst`` (tools/bench/row.py) and the spans of
each row's profile (``run-*-<pid>.records.msgpack``: the serving process's own stages and
those its compile workers reported). Spans are ``time.monotonic()``; a run's first record
pairs that clock with the wall clock, which places them on the row's clock.

Beside each goes what the row's lateness probe noted of the threads then (``stall_stacks``,
tools/lateness.py): at a late wake, every other thread's innermost frames, the one that held
the GIL among them; in a slow call, the caller's frames and the others'. Threads waiting in
``threading``, ``queue``, ``selectors`` or a pipe's ``connection`` are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from hotswap.profiles.records import RunInfo, Span, Swap
from hotswap.profiles.timeline import read_records


def _records(profile_dir: str, pid: int) -> list[Any]:
    files = [f for f in os.listdir(profile_dir) if f.endswith(f"-{pid}.records.msgpack")]
    return read_records(os.path.join(profile_dir, files[0])) if files else []


_WAITING = ("(threading.py:", "(queue.py:", "(selectors.py:", "(connection.py:")


def _noted(row: dict[str, Any], start: float, end: float) -> list[str]:
    """The probe's notes taken within [start, end] (2 ms either side), the waiting threads
    left out."""
    lines = []
    for at, what, ms, threads in sorted(row.get("stall_stacks", []), key=lambda n: n[0]):
        if start - 0.002 <= at <= end + 0.002:
            lines.append(f"    noted at {what} {at:.3f} s ({ms:.1f} ms):")
            lines += [f"      {name}: {frames}" for name, frames in threads
                      if frames and not any(w in frames.split(" < ")[0] for w in _WAITING)]
    return lines


def row_timeline(row: dict[str, Any], profile_dir: str, min_ms: float,
                 show_spans: bool = False, show_notes: bool = False) -> list[str]:
    records = _records(profile_dir, row["pid"])
    run = next((r for r in records if isinstance(r, RunInfo)), None)
    if run is None:
        return [f"{row['row']}: no profile for pid {row['pid']} in {profile_dir}"]
    shift = run.started_unix_s - row["started_unix_s"] - run.started_s  # monotonic -> row clock
    spans = sorted(((s.start_s + shift, s.end_s + shift, s) for s in records
                    if isinstance(s, Span)), key=lambda x: x[0])
    lines = [f"{row['row']} (pid {row['pid']}): first output {row['first_output_s']:.2f} s, "
             f"compiled {row['to_compiled_s'] or float('nan'):.2f} s"]
    lines += [f"  swap {r.old_tier} -> {r.new_tier} at {r.time_s + shift:.2f} s ({r.reason})"
              for r in records if isinstance(r, Swap)]
    if show_spans:
        lines += [f"  {s.tier}/{s.name}@{s.track} {a:.2f}-{b:.2f} ({b - a:.2f} s)"
                  for a, b, s in spans if not s.category]
    events = [("call", at, ms) for at, ms in row.get("slowest_calls", [])]
    events += [("late wake", at - ms / 1e3, ms) for at, ms in row.get("probe_worst", [])]
    for what, at, ms in sorted(events, key=lambda e: e[1]):
        if ms < min_ms:
            continue
        end = at + ms / 1e3
        during = [f"{s.tier}/{s.name}{f' [{s.category}]' if s.category else ''}@{s.track} "
                  f"{a:.2f}-{b:.2f}" for a, b, s in spans if a < end and b > at]
        lines.append(f"  {what} {at:.3f} s, {ms:.1f} ms; during: {'; '.join(during) or '-'}")
        lines += _noted(row, at, end)
    if show_notes:
        lines += _noted(row, float("-inf"), float("inf"))
    lines += [f"  compiled from source at {at:.3f} s: {name} ({kb:.0f} KB)"
              for at, kb, name in row.get("source_compiles_largest", [])]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_json")
    parser.add_argument("profile_dir")
    parser.add_argument("--min-ms", type=float, default=20.0,
                        help="leave out calls and wakes shorter than this (default 20)")
    parser.add_argument("--spans", action="store_true",
                        help="also list every stage span of each row, in order")
    parser.add_argument("--notes", action="store_true",
                        help="also list every note of the row's lateness probe, in order")
    args = parser.parse_args(argv)
    with open(args.bench_json) as f:
        rows = json.load(f)["rows"]
    for row in rows:
        if "pid" in row and row["row"].startswith("hotswap:"):
            print("\n".join(row_timeline(row, args.profile_dir, args.min_ms, args.spans, args.notes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
