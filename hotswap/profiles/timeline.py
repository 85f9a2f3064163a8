"""One run's timeline: every graph's stages, every user call, every swap, in memory and on disk.

    coordinator threads ----add()/add_call()----> Timeline (lock) ----> memory (status, reports)
    (user, loader, pool manager)                          \\-- flush() --> <dir>/<run>.records.msgpack

The record file is a stream of msgpack maps, one per record, appended as records arrive (calls
are buffered and written by ``flush``/``close``: writing on every call would cost the caller).
A run cut short leaves a readable prefix. ``read_records`` reads a file or every file in a
directory.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

import msgpack

from hotswap.profiles.records import GRAPH_TIER, PROCESS, Call, RunInfo, Span, record_from_dict

__all__ = [
    "COMPILE_CATEGORIES", "Timeline", "category_of", "process_span", "read_records",
    "self_time_by_category",
]

RECORDS_SUFFIX = ".records.msgpack"

# Inductor's own timed events (dynamo_timed names) grouped into the stages a user asks about.
# Matched by prefix; the first match wins. Time is attributed to the innermost event (self time).
COMPILE_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("artifact_save", ("CompiledArtifact.save", "TritonBundler.collect")),
    ("load", ("CompiledArtifact.load", "AOTAutogradCache.inductor_load")),
    ("autotuning", ("CachingAutotuner.", "benchmark_fused_nodes", "benchmark_codegened_module",
                    "collective_compute_do_bench")),
    ("kernel_compile", ("compile_file", "PyCodeCache.load_by_key_path", "async_compile",
                        "StaticAutotunerFuture", "reload_kernel_in_parent", "AotCodeCompiler",
                        "aoti_", "GraphLowering.compile_to_fn", "code_gen")),
    ("codegen", ("Scheduler.", "GraphLowering.codegen", "PythonWrapperCodegen", "CppWrapper",
                 "generate_kernel_code_from_nodes")),
    ("lowering", ("GraphLowering.run", "_recursive_pre_grad_passes", "_recursive_post_grad_passes",
                  "additional_fake_tensor_prop", "fx_codegen_and_compile", "inductor_compile",
                  "compile_fx_inner", "convert_conv_weights_to_channels_last")),
    ("aot_autograd", ("create_aot_dispatcher_function", "aot_", "_recursive_joint_graph_passes",
                      "min_cut_rematerialization_partition")),
)


def category_of(name: str) -> str:
    """The stage category of an inductor event name (``"inductor_other"`` if unknown)."""
    if name.endswith(("_template_autotuning", "_template_precompiling")):
        return "autotuning"
    for category, prefixes in COMPILE_CATEGORIES:
        if name.startswith(prefixes):
            return category
    return "inductor_other"


def self_time_by_category(spans: Iterable[Span]) -> dict[str, float]:
    """Seconds per category, each instant counted once: a span's time minus its children's.

    Spans nest by containment per (pid, track) — inductor's events inside a worker's
    ``inductor_compile`` stage, autotuning inside codegen — so summing durations would count
    nested time twice or three times.
    """
    totals: dict[str, float] = {}
    by_track: dict[tuple[int, str], list[Span]] = {}
    for span in spans:
        by_track.setdefault((span.pid, span.track), []).append(span)
    for group in by_track.values():
        group.sort(key=lambda s: (s.start_s, -s.end_s))
        stack: list[list[Any]] = []  # [span, child seconds]

        def close(entry: list[Any]) -> None:
            span, children = entry
            own = max(0.0, span.duration_s - children)
            key = span.category or span.name
            totals[key] = totals.get(key, 0.0) + own

        for span in group:
            while stack and span.start_s >= stack[-1][0].end_s:
                close(stack.pop())
            if stack:
                stack[-1][1] += span.duration_s
            stack.append([span, 0.0])
        while stack:
            close(stack.pop())
    return totals


class Timeline:
    """Thread-safe store of one run's records; writes them to ``directory`` when one is given.

    ``record_calls`` decides whether user calls are kept (profiling runs): a long-running
    service would otherwise grow without bound. At most ``max_calls`` are kept; the rest are
    counted in ``dropped_calls``.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *,
                 record_calls: bool | None = None, max_calls: int = 1_000_000,
                 argv: Iterable[str] = (), versions: dict[str, str] | None = None) -> None:
        self.directory = os.fspath(directory) if directory is not None else None
        self.record_calls = self.directory is not None if record_calls is None else record_calls
        self._max_calls = max_calls
        self._lock = threading.Lock()
        self._records: list[Any] = []
        self._calls: list[tuple[str, str, float, float, str, int]] = []
        self._written_calls = 0
        self.dropped_calls = 0
        self._file: Any = None
        self.path: str | None = None
        now = time.monotonic()
        self.info = RunInfo(now, time.time(), os.getpid(), tuple(argv), dict(versions or {}))
        if self.directory is not None:
            os.makedirs(self.directory, exist_ok=True)
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.info.started_unix_s))
            self.path = os.path.join(self.directory, f"run-{stamp}-{os.getpid()}{RECORDS_SUFFIX}")
            self._file = open(self.path, "ab")  # noqa: SIM115 - kept open for the run
        self.add(self.info)
        if self.directory is not None:
            with _process_lock:
                _open_timelines.add(self)

    # ------------------------------------------------------------------ writing

    def add(self, record: Any) -> None:
        with self._lock:
            self._records.append(record)
            if self._file is not None:
                self._file.write(msgpack.packb(record.to_dict(), use_bin_type=True))
                self._file.flush()

    def add_call(self, graph_id: str, tier: str, start_s: float, end_s: float, track: str,
                 seq: int = 0) -> None:
        """Cheap: one list append (the GIL makes it atomic); written by ``flush``."""
        if len(self._calls) >= self._max_calls:
            self.dropped_calls += 1
            return
        self._calls.append((graph_id, tier, start_s, end_s, track, seq))

    def flush(self) -> None:
        with self._lock:
            if self._file is None:
                return
            pending = self._calls[self._written_calls:]
            self._written_calls += len(pending)
            packer = msgpack.Packer(use_bin_type=True)
            self._file.write(b"".join(packer.pack(Call(*c).to_dict()) for c in pending))
            self._file.flush()

    def close(self) -> None:
        self.flush()
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
        with _process_lock:
            _open_timelines.discard(self)

    # ------------------------------------------------------------------ reading

    def records(self, kind: type[Any] | None = None) -> list[Any]:
        with self._lock:
            found = list(self._records)
        found.extend(Call(*c) for c in list(self._calls))
        return found if kind is None else [r for r in found if isinstance(r, kind)]

    def spans(self, graph_id: str) -> list[Span]:
        with self._lock:
            return [r for r in self._records if isinstance(r, Span) and r.graph_id == graph_id]


_open_timelines: weakref.WeakSet[Timeline] = weakref.WeakSet()


_process_lock = threading.Lock()  # the open profiles' set, changed and read from any thread


def process_span(name: str, start_s: float, end_s: float) -> None:
    """A stage of the process's own (the load path's warm-up), on every profile this process
    has open as it ends (``PROCESS`` for its graph id). A stage that ended before a profile
    opened is not in it: with ``hotswap.prepare()`` first, the warm-up's first stages may
    end before the first backend opens its profile."""
    span = Span(name, start_s, end_s, PROCESS, GRAPH_TIER, os.getpid(),
                threading.current_thread().name)
    with _process_lock:
        timelines = list(_open_timelines)
    for timeline in timelines:
        timeline.add(span)


@atexit.register
def _close_open_timelines() -> None:
    for timeline in list(_open_timelines):
        timeline.close()


def read_records(path: str | os.PathLike[str]) -> list[Any]:
    """Records from one ``*.records.msgpack`` file, or from every such file in a directory.

    A file cut short by a crash yields the records before the cut. Several runs in one
    directory: graph ids are prefixed with the run's pid so they stay apart.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(RECORDS_SUFFIX))
        if not files:
            raise FileNotFoundError(f"no {RECORDS_SUFFIX} files in {path}")
    else:
        files = [path]
    merged: list[Any] = []
    for file in files:
        records = _read_file(file)
        if len(files) > 1:
            records = _prefix_graph_ids(records)
        merged.extend(records)
    return merged


def _read_file(path: str) -> list[Any]:
    records: list[Any] = []
    with open(path, "rb") as f:
        unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False)
        try:
            for data in unpacker:
                records.append(record_from_dict(data))
        except (msgpack.OutOfData, ValueError):
            pass  # a truncated tail: keep what was whole
    return records


def _prefix_graph_ids(records: list[Any]) -> list[Any]:
    import dataclasses

    run = next((r for r in records if isinstance(r, RunInfo)), None)
    if run is None:
        return records
    return [dataclasses.replace(r, graph_id=f"{run.pid}/{r.graph_id}")
            if hasattr(r, "graph_id") else r for r in records]
