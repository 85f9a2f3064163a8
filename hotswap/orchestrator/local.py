"""The in-process path: graphs, and artifacts, that cannot travel compile in the user's process.

A graph stays out of the workers when it updates tensors it holds (an artifact made apart from
them would update copies), calls a submodule as a unit, or holds a target or an input hotswap
cannot describe; an artifact cannot come back when inductor cannot save it (``torch.cond``).
Rather than leave such a graph eager, ``LocalCompiler`` compiles it here, on one background
thread (``hotswap-compile``) while eager serves, or in the call when the mode waits anyway.

Only one tier per graph compiles here: a later tier would be adopted only after a benchmark,
and a benchmark here runs on the caller's time. The compile holds the GIL in Python-heavy
stretches, so the thread runs under the loader's quick GIL hand-off; what it costs a caller is
measured by ``scripts/bench_paths``.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from hotswap.orchestrator import compat
from hotswap.orchestrator.compile_job import landed
from hotswap.orchestrator.counters import bump
from hotswap.orchestrator.graph import GraphRunner
from hotswap.orchestrator.loader import Loader
from hotswap.orchestrator.options import Tier
from hotswap.orchestrator.recording import Recorder
from hotswap.orchestrator.request import GraphRequest

__all__ = ["UNSAVEABLE", "LocalCompiler"]

log = logging.getLogger("hotswap")

UNSAVEABLE = "inductor cannot save this graph's artifact (control flow operators)"
Build = Callable[[], tuple[torch.fx.GraphModule, list[Any], bool]]


class LocalCompiler:
    """Compiles one tier per graph in this process. ``fail(runner, tier, reason)`` records a
    failed tier; ``after(fn, args)`` runs a background compile (the coordinator's bookkeeping
    around it)."""

    def __init__(self, recorder: Recorder, fail: Callable[[GraphRunner, str, str], None],
                 after: Callable[[Callable[..., Any], tuple[Any, ...]], None]) -> None:
        self._recorder = recorder
        self._fail = fail
        self._after = after
        self._thread = Loader("hotswap-compile")
        self._lock = threading.Lock()
        self._graphs: set[str] = set()  # graphs with a tier compiling here

    def graph(self, runner: GraphRunner, gm: torch.fx.GraphModule, example_inputs: list[Any],
              wanted: list[Tier], reason: str) -> None:
        """A graph that cannot go to a worker: its first tier compiles in the background, on
        a copy of the graph that holds the user's own tensors."""
        self._claim(runner.graph_id)
        for tier in wanted[1:]:
            runner.keep(tier.name, f"only {wanted[0].name!r} compiles in this process ({reason})")
        inputs = list(example_inputs)
        self._submit(runner, wanted[0], f"inprocess: {reason}",
                     lambda: (_sharing_copy(gm), inputs, _is_dynamic(gm)), torch.is_grad_enabled())

    def unsaveable(self, runner: GraphRunner, request: GraphRequest, tier: Tier, detail: str,
                   *, blocking: bool) -> None:
        """A worker compiled the graph but inductor could not save its artifact: compile it
        again here from what the worker got, in the call (``blocking``) or in the background.
        A graph's other tiers that report the same are kept."""
        if not self._claim(runner.graph_id):
            runner.keep(tier.name, f"another tier compiles in this process ({UNSAVEABLE})")
            return
        log.info("graph %s: %s; compiling tier %r in this process", runner.graph_id, detail,
                 tier.name)
        build: Build = lambda: landed(request.graph_bytes, request.inputs)  # noqa: E731
        if blocking:
            self.compile(runner, tier, f"inprocess: {UNSAVEABLE}", build, request.grad_enabled,
                         blocking=True)
        else:
            self._submit(runner, tier, f"inprocess: {UNSAVEABLE}", build, request.grad_enabled)

    def compile(self, runner: GraphRunner, tier: Tier, path: str, build: Build, grad: bool, *,
                blocking: bool = False) -> None:
        """Inductor here; the tier serves at once (``blocking``) or swaps in."""
        t = time.monotonic()
        try:
            gm, inputs, dynamic = build()
            with torch.set_grad_enabled(grad):
                fn = compat.standalone_compile(gm, inputs, dict(tier.config), dynamic=dynamic,
                                               donate=True)
        except Exception as e:
            self._fail(runner, tier.name, f"{path.removeprefix('inprocess: ')}; compiling it in "
                                          f"this process failed too: {type(e).__name__}: {e}")
            return
        self._recorder.span(runner, tier.name, "inprocess_compile", t, time.monotonic())
        bump("inprocess_compiles")
        runner.arrived(tier.name, path)
        if blocking:
            runner.serve_now(tier.name, fn)
        else:
            runner.swap_in(tier.name, fn)

    def _submit(self, runner: GraphRunner, tier: Tier, path: str, build: Build,
                grad: bool) -> None:
        self._thread.submit(self._after, self.compile, (runner, tier, path, build, grad))

    def _claim(self, graph_id: str) -> bool:
        with self._lock:
            first = graph_id not in self._graphs
            self._graphs.add(graph_id)
        return first


def _sharing_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A graph inductor may rewrite while ``gm`` keeps serving eagerly, holding the same
    tensors (an artifact of a copy of them would update the copies)."""
    return torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))


def _is_dynamic(gm: torch.fx.GraphModule) -> bool:
    """Whether dynamo traced the graph with symbolic sizes (compile it for them, not for the
    example inputs' sizes)."""
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt) or (isinstance(value, torch.Tensor) and any(
                isinstance(d, torch.SymInt) for d in value.shape)):
            return True
    return False
