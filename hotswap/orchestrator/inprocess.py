"""Inductor in the caller's process, in the call: ``inprocess`` mode, and a graph that cannot
go to a worker (the coordinator says why). A cache hit is served before the call returns, and
what compiles here is stored like a worker's result (where inductor can save it), so the
other modes and other processes start warm.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from hotswap.orchestrator import compat, kernel_files
from hotswap.orchestrator.artifacts import pack_entry
from hotswap.orchestrator.cache_access import CacheAccess
from hotswap.orchestrator.counters import bump
from hotswap.orchestrator.graph import GraphRunner
from hotswap.orchestrator.load_guard import cpp_sources, probes, record_precompiled_headers
from hotswap.orchestrator.options import Tier
from hotswap.orchestrator.recording import Recorder
from hotswap.orchestrator.request import cpu_threads, portable_inputs
from hotswap.orchestrator.tiers import Load
from hotswap.orchestrator.wire import InputMeta

__all__ = ["InProcess"]

log = logging.getLogger("hotswap")


class InProcess:
    """Compiles a graph's tier with inductor right here. ``fail(runner, tier, reason)``
    records (or, with ``on_failure="raise"``, raises) a failure."""

    def __init__(self, cache: CacheAccess, recorder: Recorder, load: Load,
                 fail: Callable[[GraphRunner, str, str], None]) -> None:
        self._cache, self._recorder, self._load, self._fail = cache, recorder, load, fail

    def _serve_cached(self, runner: GraphRunner, tier: Tier, key: str | None) -> bool:
        """Load a hit before the call returns. False on a miss."""
        cached = self._cache.get(key)
        if cached is None:
            return False
        try:
            fn = self._load(runner, tier, cached, "cache_load")
        except Exception as e:
            log.warning("hotswap: cached artifact failed to load (%s); compiling", e)
            return False
        bump("cache_hits")
        runner.arrived(tier.name, "cache")
        runner.serve_now(tier.name, fn)
        return True

    def compile(self, runner: GraphRunner, gm: torch.fx.GraphModule,
                           example_inputs: list[Any], tier: Tier, path: str = "inprocess") -> None:
        """Inductor right here. With a cache: serve a hit, or compile saveably and store
        (where inductor can save the artifact)."""
        described = portable_inputs(gm, example_inputs)  # else: compiled here, not stored
        key = None
        if not isinstance(described, str):
            key = self._cache.keys(gm, described, torch.is_grad_enabled(), [tier],
                                  cpu_threads(described)).get(tier.name)
        if key is not None and self._serve_cached(runner, tier, key):
            return
        t = time.monotonic()
        try:
            if key is None:
                from torch._inductor.compile_fx import compile_fx

                fn: Any = compile_fx(gm, example_inputs, config_patches=dict(tier.config))
            else:
                assert not isinstance(described, str)
                fn = self._compile_and_store(runner, gm, example_inputs, tier, key,
                                                       described)
        except Exception as e:
            # On the path of a graph that cannot travel, the reason it could not comes first.
            why = path.removeprefix("inprocess: ")
            prefix = f"{why}; compiling it in this process failed too: " if why != path else ""
            self._fail(runner, tier.name, f"{prefix}inductor raised {type(e).__name__}: {e}")
            return
        self._recorder.span(runner, tier.name, "inprocess_compile", t, time.monotonic())
        bump("inprocess_compiles")
        runner.arrived(tier.name, path)
        runner.serve_now(tier.name, fn)

    def _compile_and_store(self, runner: GraphRunner, gm: torch.fx.GraphModule,
                                     example_inputs: list[Any], tier: Tier, key: str,
                                     inputs: tuple[InputMeta, ...]) -> Any:
        """standalone_compile (inductor's compile plus a saveable artifact), stored like a
        worker's result, kernel files included."""
        started = time.time() - 1.0  # mtime granularity
        record_precompiled_headers()  # the entry names them (load_guard.py)
        with cpp_sources() as sources:
            artifact = compat.standalone_compile(gm, example_inputs, dict(tier.config),
                                                 dynamic=any(m.symbols for m in inputs))
        files = kernel_files.compile_outputs(sources, started)
        try:
            data = compat.artifact_to_bytes(artifact)
        except compat.UnsaveableArtifact as e:
            log.info("graph %s: %s; serving it unstored", runner.graph_id, e)
            return artifact
        self._cache.store(key, tier.name, pack_entry(data, files, probes()))
        return artifact
