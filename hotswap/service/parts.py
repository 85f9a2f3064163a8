"""A compile job split across the service's warm workers: one graph, compiled in parts at once.

    client --JobRequest(compile, parts=k)--> service connection thread
        submit_parts: k pool jobs RUN_PART (payload, i, k) --> k warm workers, each lands the
                      graph, cuts it into the same k parts and compiles part i (jobs/regions.py)
        PartsFuture   done once every part is, failed at the first part that fails (the rest
                      cancelled if queued, left to end if running: a cancel kills a
                      running job's worker, and warm workers are what parts need),
                      cancelled with all its parts
        merged()      on the connection thread: one entry (artifacts.merge_parts) --> client

Inductor compiles one graph on one thread: its time grows with the graph's nodes (lowering,
scheduling, code generation), and a warm worker's compile of ViT took 6-8 s on the H100 where
GPT-2's six blocks took 3-4. Two warm workers compiling a half each serve the graph sooner;
what it costs is fusion across each cut (one more kernel and round trip through memory for
the value that crosses) and one more artifact call per part. Where the graph is not cut (no
place to cut, dynamic sizes, training) a part's job compiles the whole graph and the merge
returns it.
"""

from __future__ import annotations

import pickle
import threading
from concurrent.futures import Future
from typing import Any

from hotswap.cache.entry import merge_parts
from hotswap.executors.base import Executor

__all__ = ["RUN_PART", "PartsFuture", "run_part", "submit_parts"]

RUN_PART = "hotswap.service.parts:run_part"


def run_part(request: tuple[str, bytes, int, int]) -> Any:
    """In a worker: the client's compile job (a pickled ``CompileRequest`` wire form), as part
    ``part`` of ``parts``."""
    from hotswap.workers.child import resolve_job

    job, payload, part, parts = request
    wire = pickle.loads(payload)
    return resolve_job(job)({**wire, "part": part, "parts": parts})


class PartsFuture(Future[Any]):
    """The future of a job sent as parts: its result is the parts' results, in order
    (``merged()`` puts them together); ``stage_events`` are every part's."""

    def __init__(self, futures: list[Future[Any]]) -> None:
        super().__init__()
        self.parts = futures
        self._lock = threading.Lock()
        self._left = len(futures)

    @property
    def stage_events(self) -> list[Any]:
        return [e for f in self.parts for e in getattr(f, "stage_events", [])]

    def cancel(self) -> bool:
        cancelled = super().cancel()  # first: the parts' callbacks then find it done
        for future in self.parts:
            future.cancel()
        return cancelled

    def part_done(self, future: Future[Any]) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if self.done():
            return
        error = None if future.cancelled() else future.exception()
        if future.cancelled() or error is not None:
            try:
                self.set_exception(error or RuntimeError("a part of the compile was cancelled"))
            except Exception:  # resolved meanwhile (cancelled, or another part failed)
                pass
            for other in self.parts:  # after: their callbacks find this future done
                if not other.running():  # queued; a running one ends on its own
                    other.cancel()
        elif last:
            try:
                self.set_result([f.result() for f in self.parts])
            except Exception:
                pass

    def merged(self) -> dict[str, Any]:
        """The compile result of the whole graph: the first part's, with the merged entry."""
        results = self.result()
        entry = merge_parts([r["entry"] for r in results])
        return {**results[0], "entry": entry}


def submit_parts(executor: Executor, job: str, payload: bytes, timeout_s: float | None,
                 parts: int) -> PartsFuture:
    """``job`` (a compile, its ``payload`` pickled by the client) as ``parts`` pool jobs."""
    futures: list[Future[Any]] = []
    try:
        for part in range(parts):
            futures.append(executor.submit(RUN_PART, (job, payload, part, parts), timeout_s))
    except BaseException:
        for future in futures:
            future.cancel()
        raise
    out = PartsFuture(futures)
    for future in futures:
        future.add_done_callback(out.part_done)
    return out
