"""A compiler that compiles nothing: modes, ladders and the gate, tested without inductor.

    fake = FakeCompiler(delay_s={"max-autotune": 0.2}, crashes={"default": 1},
                        medians={"default": 1.0, "max-autotune": 0.5})
    backend = Coordinator(Options.create(mode="progressive"), compiler=fake, measure=fake.measure)
    compiled = torch.compile(model, backend=backend)

A "compile" is a thread that waits ``delay_s[tier]`` and sends the shipped graph back as the
tier's artifact; loading one gives a callable that runs the graph as dynamo handed it (so its
outputs equal eager's) and counts its calls per tier (``calls``). ``crashes[tier]`` compiles of
a tier die first (``WorkerCrashed``, as a killed worker), ``fail[tier]`` raises the worker's
``CompileFailed``; with ``hold=True`` no compile starts before ``release()``; ``measure``
answers the gate with ``medians`` (ms per tier; ``"eager"`` for the graph as it is), or, for
the gate's paired measurements, with ``pairs`` in turn (``Paired`` records: a noisy or
contended measurement, as ``profiles.bench.measure_pair`` returns it). Everything
else is hotswap's own code: the cache (keys, claims, signed entries), the lifecycle, the
ladder, the gate, the runner. The artifacts are this process's only: the fake has no inductor
output to ship.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from typing import Any

import msgpack

from hotswap.engine.shipping.transport import unship_graph
from hotswap.engine.shipping.wire import BenchReply, BenchRequest, CompileRequest, CompileResult
from hotswap.errors import CompileFailed, WorkerCrashed
from hotswap.profiles.records import BenchResult, Paired, TierBench

__all__ = ["FakeCompiler"]


class FakeCompiler:
    """Implements ``hotswap.engine.sources.compilers.Compiler`` in threads of this process."""

    def __init__(self, *, delay_s: Mapping[str, float] | None = None,
                 crashes: Mapping[str, int] | None = None,
                 fail: Mapping[str, str] | None = None,
                 medians: Mapping[str, float] | None = None, hold: bool = False,
                 pairs: Iterable[Paired] = (), call_s: Mapping[str, float] | None = None
                 ) -> None:
        self._delay_s = dict(delay_s or {})
        self._call_s = dict(call_s or {})  # tier -> how long each call of it sleeps
        self._crashes = collections.Counter(crashes or {})
        self._fail = dict(fail or {})
        self._medians = dict(medians or {})
        self._pairs = list(pairs)
        self._released = threading.Event()
        if not hold:
            self._released.set()
        self._lock = threading.Lock()
        self.compiles: list[tuple[str, str]] = []          # (graph, tier), as submitted
        self.requests: list[CompileRequest] = []           # the same, whole
        self.benches: list[BenchRequest] = []
        self.calls: collections.Counter[str] = collections.Counter()  # tier -> calls served

    def submit(self, request: CompileRequest, timeout_s: float | None) -> Future[Any]:
        with self._lock:
            self.compiles.append((request.graph_id, request.tier))
            self.requests.append(request)
        future: Future[Any] = Future()
        future.stage_events = []  # type: ignore[attr-defined]
        threading.Thread(target=self._compile, args=(request, future), daemon=True,
                         name="fake-compile").start()
        return future

    def release(self) -> None:
        """``hold=True``: compiles start only now (a test makes its first calls before)."""
        self._released.set()

    def _compile(self, request: CompileRequest, future: Future[Any]) -> None:
        self._released.wait()
        time.sleep(self._delay_s.get(request.tier, 0.0))
        if not future.set_running_or_notify_cancel():  # cancelled meanwhile, as a pool's job
            return
        with self._lock:
            crash = self._crashes[request.tier] > 0
            self._crashes[request.tier] -= crash
        if crash:
            future.set_exception(WorkerCrashed(0, None, "SIGKILL", job="compile"))
        elif request.tier in self._fail:
            future.set_exception(CompileFailed("compile", "RuntimeError",
                                               self._fail[request.tier], ""))
        else:
            entry = msgpack.packb({"tier": request.tier, "graph": request.graph_bytes})
            future.set_result(CompileResult(request.graph_id, request.tier, entry).to_wire())

    def submit_job(self, job: str, payload: Any, timeout_s: float | None) -> Any:
        raise NotImplementedError(f"FakeCompiler runs compiles only, not {job!r}; pass "
                                  "measure=fake.measure to the coordinator")

    def load(self, entry: Any, config: Mapping[str, Any]) -> Any:
        artifact = msgpack.unpackb(bytes(entry), raw=False)
        gm, tier = unship_graph(artifact["graph"]), artifact["tier"]

        def compiled(*args: Any) -> Any:
            with self._lock:
                self.calls[tier] += 1
            time.sleep(self._call_s.get(tier, 0.0))
            return gm(*args)

        return compiled

    def warm(self, devices: Iterable[str], wait_s: float | None = 0.0) -> bool:
        return True

    def measure(self, request: BenchRequest) -> Future[BenchReply]:
        """The gate's benchmark: ``medians[tier]`` ms for each tier measured (a tier with no
        median has no row, as one that failed to load in the benchmark worker: the gate keeps
        it out, "could not benchmark it"; so in progressive mode, where every tier is weighed
        against eager before it serves, a fake with no medians serves no tier); a paired
        request takes the next of ``pairs``, if any is left."""
        measured = [*request.entries, *(["eager"] if request.graph_bytes else [])]
        with self._lock:
            self.benches.append(request)
            scripted = self._pairs.pop(0) if request.pair and self._pairs else None
        pairs = [] if scripted is None else [dataclasses.replace(
            scripted, graph_id=request.graph_id, serving=request.pair[0],
            candidate=request.pair[1])]
        reply = BenchReply(
            [TierBench(request.graph_id, tier, BenchResult(ms, ms, ms, 10, "fake"),
                       purpose=request.purpose)
             for tier in measured if (ms := self._medians.get(tier)) is not None],
            errors={t: "no median" for t in measured if t not in self._medians}, pairs=pairs)
        future: Future[BenchReply] = Future()
        future.set_result(reply)
        return future
