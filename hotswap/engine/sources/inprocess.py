"""Inductor in the caller's process, in the call: ``inprocess`` mode, and a graph that cannot
go to a worker (the coordinator says why). A cache hit is served before the call returns, and
what compiles here is stored like a worker's result (where inductor can save it), so the
other modes and other processes start warm. The same contract as the worker modes'
``TierLifecycle`` (tiers.py): ``start`` returns the tier's future, here already resolved.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from hotswap import compat
from hotswap.compat import Buffer
from hotswap.counting import bump
from hotswap.engine.journey import GraphJourney
from hotswap.engine.loading import kernel_files
from hotswap.engine.loading.artifacts import pack_entry
from hotswap.engine.loading.load_guard import cpp_sources, probes, record_precompiled_headers
from hotswap.engine.options import Tier
from hotswap.engine.recording import Recorder
from hotswap.engine.sources.cache_access import CacheAccess
from hotswap.engine.sources.tiers import Arrival, Load, TierError
from hotswap.system import cores

__all__ = ["InProcess"]

log = logging.getLogger("hotswap")


class InProcess:
    """Compiles a graph's tier with inductor right here, in the backend call, from the
    journey's ``gm`` and the call's ``example_inputs`` (passed in: they live only that long)."""

    def __init__(self, cache: CacheAccess, recorder: Recorder, load: Load) -> None:
        self._cache, self._recorder, self._load = cache, recorder, load

    def start(self, journey: GraphJourney, tier: Tier, *, cached: Buffer | None = None,
              example_inputs: Sequence[Any] = ()) -> Future[Arrival]:
        out: Future[Arrival] = Future()
        try:
            out.set_result(self._arrive(journey, tier, cached, list(example_inputs)))
        except Exception as e:
            out.set_exception(e)
        return out

    def _arrive(self, journey: GraphJourney, tier: Tier, cached: Buffer | None,
                example_inputs: list[Any]) -> Arrival:
        """A hit, loaded; or inductor right here (compiled saveably and stored where a key
        says the artifact may be reused)."""
        key = journey.keys.get(tier.name)
        entry = cached if cached is not None else self._cache.get(key)
        if entry is not None:
            try:
                fn = self._load(journey, tier, entry, "cache_load")
            except Exception as e:
                log.warning("hotswap: cached artifact failed to load (%s); compiling", e)
            else:
                bump("cache_hits")
                return Arrival(fn, "cache", self._cache.ref(key) or entry)
        path = f"inprocess: {journey.here_because}" if journey.here_because else "inprocess"
        t = time.monotonic()
        try:
            fn = self._compile(journey, tier, key, example_inputs)
        except Exception as e:
            # On the path of a graph that cannot travel, the reason it could not comes first.
            prefix = (f"{journey.here_because}; compiling it in this process failed too: "
                      if journey.here_because else "")
            raise TierError(f"{prefix}inductor raised {type(e).__name__}: {e}") from e
        self._recorder.span(journey, tier.name, "inprocess_compile", t, time.monotonic())
        bump("inprocess_compiles")
        return Arrival(fn, path, b"")

    def _compile(self, journey: GraphJourney, tier: Tier, key: str | None,
                 example_inputs: list[Any]) -> Any:
        # For the caller's own intra-op threads, what its key says (inside an eager answer
        # that runs with fewer: system/cores.py)
        with cores.at_own_threads():
            return self._compile_here(journey, tier, key, example_inputs)

    def _compile_here(self, journey: GraphJourney, tier: Tier, key: str | None,
                      example_inputs: list[Any]) -> Any:
        gm = journey.gm
        if key is None or journey.inputs is None:
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs, config_patches=dict(tier.config))
        # standalone_compile (inductor's compile plus a saveable artifact), stored like a
        # worker's result, kernel files included.
        started = time.time() - 1.0  # mtime granularity
        record_precompiled_headers()  # the entry names them (load_guard.py)
        with cpp_sources() as sources:
            artifact = compat.standalone_compile(gm, example_inputs, dict(tier.config),
                                                 dynamic=any(m.symbols for m in journey.inputs))
        files = kernel_files.compile_outputs(sources, started)
        try:
            data = compat.artifact_to_bytes(artifact)
        except compat.UnsaveableArtifact as e:
            log.info("graph %s: %s; serving it unstored", journey.graph_id, e)
            return artifact
        self._cache.store(key, tier.name, pack_entry(data, files, probes()), journey.origin)
        return artifact
