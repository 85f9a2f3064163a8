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

from hotswap.errors import CompileFailed, HotswapError
from hotswap.orchestrator import compat, kernel_files
from hotswap.orchestrator.artifacts import pack_entry
from hotswap.orchestrator.cache_access import CacheAccess
from hotswap.orchestrator.compilers import CompileFuture
from hotswap.orchestrator.counters import bump
from hotswap.orchestrator.graph import GraphRunner
from hotswap.orchestrator.load_guard import cpp_sources, probes, record_precompiled_headers
from hotswap.orchestrator.local import LocalCompiler
from hotswap.orchestrator.options import Tier
from hotswap.orchestrator.recording import Recorder
from hotswap.orchestrator.request import (
    GraphRequest,
    count_error,
    cpu_threads,
    portable_inputs,
    reason_of,
    unsaveable,
)
from hotswap.orchestrator.wire import CompileResult, InputMeta

__all__ = ["BlockingModes"]

log = logging.getLogger("hotswap")


class _Host(Protocol):
    """What the blocking paths use of their coordinator."""

    cache: CacheAccess
    recorder: Recorder
    local: LocalCompiler

    def _fail(self, runner: GraphRunner, tier: str, reason: str) -> None: ...
    def _await_warmup(self, runner: GraphRunner) -> None: ...
    def _cache_load(self, runner: GraphRunner, tier: Tier, entry: bytes) -> Any: ...
    def _job(self, runner: GraphRunner, request: GraphRequest, tier: Tier) -> CompileFuture: ...
    def _load(self, runner: GraphRunner, result: CompileResult, tier: Tier) -> Any: ...
    def _serve_cached_now(self, runner: GraphRunner, tier: Tier, key: str | None) -> bool: ...
    def _compile_inprocess_and_store(self, runner: GraphRunner, gm: torch.fx.GraphModule,
                                     example_inputs: list[Any], tier: Tier, key: str,
                                     inputs: tuple[InputMeta, ...]) -> Any: ...
    def _compile_and_wait(self, runner: GraphRunner, request: GraphRequest,
                          tier: Tier) -> CompileResult: ...



class BlockingModes:
    """The inprocess and subprocess paths of the Coordinator."""

    def _serve_cached_now(self: _Host, runner: GraphRunner, tier: Tier, key: str | None) -> bool:
        """Blocking modes: load a hit before the call returns. False on a miss."""
        cached = self.cache.get(key)
        if cached is None:
            return False
        try:
            fn = self._cache_load(runner, tier, cached)
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
        if self._serve_cached_now(runner, tier, key):
            return
        if key is not None and not self.cache.claim(key):
            # Another process is compiling it: this call waits anyway, so wait for its entry.
            self.cache.wait_for_holder(key)
            if self._serve_cached_now(runner, tier, key):
                return
            self.cache.claim(key)
        elif key is not None and self._serve_cached_now(runner, tier, key):
            self.cache.release(key)  # stored by another process between our miss and our claim
            return
        try:
            try:
                result = self._compile_and_wait(runner, request, tier)
                fn = self._load(runner, result, tier)
            except HotswapError as e:
                if isinstance(e, CompileFailed) and unsaveable(e):
                    self.local.unsaveable(runner, request, tier, e.remote_message, blocking=True)
                    return
                count_error(e)
                self._fail(runner, tier.name, reason_of(e))
                return
            except Exception as e:
                self._fail(runner, tier.name, f"artifact failed to load: {type(e).__name__}: {e}")
                return
            self.cache.store(key, tier.name, result.entry)
            runner.arrived(tier.name, "worker")
            runner.serve_now(tier.name, fn)
        finally:
            self.cache.release(key)  # waiting processes go on (and compile themselves if we failed)

    def _compile_and_wait(self: _Host, runner: GraphRunner, request: GraphRequest,
                          tier: Tier) -> CompileResult:
        """Blocking modes: one compile (retried once on a crashed worker), waited for here."""
        submitted = time.monotonic()
        future = self._job(runner, request, tier)
        result = CompileResult.from_wire(future.result())
        self.recorder.worker_job(runner, tier.name, future.stage_events, submitted,
                                 time.monotonic())
        return result
