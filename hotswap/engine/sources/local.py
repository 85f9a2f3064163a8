"""The in-process path for artifacts that cannot travel back from a worker.

Inductor cannot save the artifact of some graphs (``torch.cond`` and other control-flow
operators: "Can't cache HigherOrderOperator"): the worker compiles them, then has nothing to
send. Rather than leave such a graph eager, ``LocalCompiler`` compiles it again in the user's
process, from what the worker got.

Not on a thread beside the user's calls: AOTAutograd traces with ``make_fx``, which patches
``torch.nn.Module.__call__`` process-wide while it traces, and a user's call that ran meanwhile
raised ("Detected that you are using FX to symbolically trace a dynamo-optimized function")
or found operators half registered. So the compile runs in a call that serves the graph: in the
first call in subprocess mode, else in the graph's next call once the worker has reported. That
call waits for the compile, as it would with plain ``torch.compile``; every other call is
served as before. Graphs that cannot go to a worker at all compile in the call that meets them
(inprocess.py). Only one tier per graph compiles here: a later tier
would be adopted only after a benchmark, and here that runs on the caller's time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from hotswap import compat
from hotswap.counting import bump
from hotswap.engine.journey import GraphJourney
from hotswap.engine.options import Tier
from hotswap.engine.recording import Recorder
from hotswap.engine.shipping.request import GraphRequest
from hotswap.jobs.compile import landed

__all__ = ["UNSAVEABLE", "LocalCompiler"]

log = logging.getLogger("hotswap")

UNSAVEABLE = "inductor cannot save this graph's artifact (control flow operators)"


class LocalCompiler:
    """Compiles one tier per graph in this process. ``fail(journey, tier, reason)`` records a
    failed tier."""

    def __init__(self, recorder: Recorder,
                 fail: Callable[[GraphJourney, str, str], None]) -> None:
        self._recorder = recorder
        self._fail = fail

    def unsaveable(self, journey: GraphJourney, request: GraphRequest, tier: Tier, detail: str,
                   *, blocking: bool) -> None:
        """A worker compiled the graph but inductor could not save its artifact: compile it
        here, now (``blocking``: the caller is waiting already) or in the graph's next call.
        A graph's other tiers that report the same are kept."""
        if not journey.claim_local():
            journey.keep(tier.name, f"another tier compiles in this process ({UNSAVEABLE})")
            return
        log.info("graph %s: %s; compiling tier %r in this process", journey.graph_id, detail,
                 tier.name)
        if blocking:
            try:
                fn = self._compile(journey, tier, request)
            except Exception as e:
                self._fail(journey, tier.name, f"{UNSAVEABLE}; compiling it in this process "
                                              f"failed too: {type(e).__name__}: {e}")
                return
            journey.arrived(tier.name, f"inprocess: {UNSAVEABLE}")
            journey.serve_now(tier.name, fn)
            return
        journey.arrived(tier.name, f"inprocess: {UNSAVEABLE}")
        journey.swap_in(tier.name, self._in_next_call(journey, tier, request))

    def _in_next_call(self, journey: GraphJourney, tier: Tier, request: GraphRequest) -> Any:
        """A callable that compiles the tier in the first call that reaches it (one caller
        compiles; others arriving meanwhile wait for it), then runs the compiled code. If the
        compile raises, the runner drops the tier and serves eagerly, with the reason."""
        lock = threading.Lock()
        compiled: list[Any] = []
        compile_here: Any = torch._dynamo.disable(self._compile)  # type: ignore[no-untyped-call]

        def call(*args: Any) -> Any:
            if not compiled:
                with lock:
                    if not compiled:
                        compiled.append(compile_here(journey, tier, request))
            return compiled[0](*args)

        return call

    def _compile(self, journey: GraphJourney, tier: Tier, request: GraphRequest) -> Any:
        t = time.monotonic()
        gm, inputs, dynamic = landed(request.graph_bytes, request.inputs)
        with torch.set_grad_enabled(request.grad_enabled):
            fn = compat.standalone_compile(gm, inputs, dict(tier.config), dynamic=dynamic,
                                           donate=True)
        self._recorder.span(journey, tier.name, "inprocess_compile", t, time.monotonic())
        bump("inprocess_compiles")
        return fn
