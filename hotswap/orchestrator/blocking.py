"""The blocking modes: ``inprocess`` (inductor in the caller's process) and ``subprocess`` (a
worker compiles while the first call waits). Both serve a cache hit before the call returns and
store what they compile, so the background modes and other processes can start warm.

``BlockingModes`` is a mixin of the Coordinator: its methods need what ``_Host`` lists.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch

from hotswap.orchestrator import compat, kernel_files
from hotswap.orchestrator.artifacts import pack_entry
from hotswap.orchestrator.cache_access import CacheAccess
from hotswap.orchestrator.counters import bump
from hotswap.orchestrator.graph import GraphRunner
from hotswap.orchestrator.load_guard import cpp_sources, probes, record_precompiled_headers
from hotswap.orchestrator.local import LocalCompiler
from hotswap.orchestrator.options import Tier
from hotswap.orchestrator.recording import Recorder
from hotswap.orchestrator.request import (
    GraphRequest,
    cpu_threads,
    portable_inputs,
    reason_of,
)
from hotswap.orchestrator.tiers import LoadFailed, TierLifecycle
from hotswap.orchestrator.wire import InputMeta

__all__ = ["BlockingModes"]

log = logging.getLogger("hotswap")


class _Host(Protocol):
    """What the blocking paths use of their coordinator."""

    cache: CacheAccess
    recorder: Recorder
    local: LocalCompiler
    tiers: TierLifecycle

    def _fail(self, runner: GraphRunner, tier: str, reason: str) -> None: ...
    def _await_warmup(self, runner: GraphRunner) -> None: ...
    def _load_tier(self, runner: GraphRunner, tier: Tier, entry: Any, stage: str) -> Any: ...
    def _compiled_here_instead(self, runner: GraphRunner, request: GraphRequest, tier: Tier,
                               error: BaseException, *, blocking: bool) -> bool: ...
    def _serve_cached_now(self, runner: GraphRunner, tier: Tier, key: str | None) -> bool: ...
    def _compile_inprocess_and_store(self, runner: GraphRunner, gm: torch.fx.GraphModule,
                                     example_inputs: list[Any], tier: Tier, key: str,
                                     inputs: tuple[InputMeta, ...]) -> Any: ...



class BlockingModes:
    """The inprocess and subprocess paths of the Coordinator."""

    def _serve_cached_now(self: _Host, runner: GraphRunner, tier: Tier, key: str | None) -> bool:
        """Blocking modes: load a hit before the call returns. False on a miss."""
        cached = self.cache.get(key)
        if cached is None:
            return False
        try:
            fn = self._load_tier(runner, tier, cached, "cache_load")
        except Exception as e:
            log.warning("hotswap: cached artifact failed to load (%s); compiling", e)
            return False
        bump("cache_hits")
        runner.arrived(tier.name, "cache")
        runner.serve_now(tier.name, fn)
        return True

    def _compile_inprocess(self: _Host, runner: GraphRunner, gm: torch.fx.GraphModule,
                           example_inputs: list[Any], tier: Tier, path: str = "inprocess") -> None:
        """Inductor right here. With a cache: serve a hit, or compile saveably and store
        (where inductor can save the artifact)."""
        described = portable_inputs(gm, example_inputs)  # else: compiled here, not stored
        key = None
        if not isinstance(described, str):
            key = self.cache.keys(gm, described, torch.is_grad_enabled(), [tier],
                                  cpu_threads(described)).get(tier.name)
        if key is not None and self._serve_cached_now(runner, tier, key):
            return
        t = time.monotonic()
        try:
            if key is None:
                from torch._inductor.compile_fx import compile_fx

                fn: Any = compile_fx(gm, example_inputs, config_patches=dict(tier.config))
            else:
                assert not isinstance(described, str)
                fn = self._compile_inprocess_and_store(runner, gm, example_inputs, tier, key,
                                                       described)
        except Exception as e:
            # On the path of a graph that cannot travel, the reason it could not comes first.
            why = path.removeprefix("inprocess: ")
            prefix = f"{why}; compiling it in this process failed too: " if why != path else ""
            self._fail(runner, tier.name, f"{prefix}inductor raised {type(e).__name__}: {e}")
            return
        self.recorder.span(runner, tier.name, "inprocess_compile", t, time.monotonic())
        bump("inprocess_compiles")
        runner.arrived(tier.name, path)
        runner.serve_now(tier.name, fn)

    def _compile_inprocess_and_store(self: _Host, runner: GraphRunner, gm: torch.fx.GraphModule,
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
        self.cache.store(key, tier.name, pack_entry(data, files, probes()))
        return artifact

    def _compile_blocking(self: _Host, runner: GraphRunner, request: GraphRequest, tier: Tier,
                          key: str | None) -> None:
        """Subprocess mode: the tier's lifecycle (tiers.py), waited for in the call."""
        try:
            arrival = self.tiers.start(runner, request, tier, key).result()
        except Exception as e:
            if not self._compiled_here_instead(runner, request, tier, e, blocking=True):
                self._fail(runner, tier.name, str(e) if isinstance(e, LoadFailed)
                           else reason_of(e))
            return
        runner.arrived(tier.name, arrival.path)
        runner.serve_now(tier.name, arrival.fn)
