"""A mode as a composition, made once per backend: ``compose(options, ...)`` is the only reader
of the mode's plan (``Options.plan``), as torch's ``_AsyncFxCompile(scheme)`` wraps a scheme.

    mode          a shipped graph's route                 a graph that cannot travel
    ----          -------------------------               ---------------------------
    async         Route(Cached(executor), waits=False),   Route(InProcess, waits, first rung)
                  its tier on probation against eager
    progressive   the same, every tier, gated             the same
    subprocess    Route(Cached(executor), waits=True)     the same
    inprocess     Route(InProcess, waits=True)            the same

``Cached(executor)`` is ``TierLifecycle`` (sources/tiers.py): the cache first, else a claim, a
job through the executor, a load on the load thread, a store. ``InProcess`` is inductor in the
backend call (sources/inprocess.py). A route that does not wait returns eager at once and swaps
its tiers in as they arrive; one that waits serves its tier from the first call. Which tiers the
ladder climbs (every tier, or the top one alone) and whether a gate weighs them is the plan's
too. A route that does not wait and ships its graphs starts (progressive with ``regions="auto"``,
async with ``"on"``) from a rung below the first: that tier compiled region by region, each
distinct repeated block once (``Tier.regions``; jobs/regions.py), for the graphs that repeat
one. Async whose jobs go to the compile service compiles its tier in parts at once instead
(``Tier.parts``; service/parts.py). Nothing past this module reads the mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from hotswap import settings
from hotswap.engine.options import REGIONS_SUFFIX, Options, Tier
from hotswap.engine.policy.gate import Gate
from hotswap.engine.recording import Recorder, profiled
from hotswap.engine.shipping.request import Prepared
from hotswap.engine.sources.cache_access import CacheAccess
from hotswap.engine.sources.inprocess import InProcess
from hotswap.engine.sources.tiers import (
    Compile,
    Load,
    OnLoader,
    PendingStores,
    TierLifecycle,
    TierSource,
)
from hotswap.executors import registry
from hotswap.workers.pool import default_workers

__all__ = ["Composition", "Route", "compose"]


def _bridge(tiers: Sequence[Tier]) -> list[Tier]:
    """The first tier compiled region by region: a rung of its own below it, named apart
    (none where a tier of the ladder has its name already)."""
    first = tiers[0]
    name = first.name + REGIONS_SUFFIX
    if any(t.name == name for t in tiers) or first.regions:
        return []
    return [replace(first, name=name, regions=True)]


def _parts(options: Options, not_async: bool) -> int:
    """How many parts async's tier compiles in (``HOTSWAP_PARTS``): auto, 2 where its jobs go
    to the compile service and the service keeps two workers warm (service/server.py
    ``WARM_WORKERS``; its pool is this machine's default size, as this process reckons it);
    1 elsewhere: a local pool starts a second worker only for jobs that would wait longer
    than that start, and a part that waits for a worker makes the whole graph wait."""
    if not_async or options.executor != registry.SERVICE:
        return 1
    asked = settings.parts()
    if asked is not None:
        return asked
    return 2 if default_workers() >= 2 else 1


@dataclass(frozen=True)
class Route:
    """Where a graph's tiers come from, whether its first call waits for one, and whether it
    takes only the ladder's first start point (a graph compiled in the call, beside workers)."""

    source: TierSource
    waits: bool
    first_only: bool = False


@dataclass(frozen=True)
class Composition:
    tiers: list[Tier]          # what the ladder climbs, lowest first
    gate: Gate | None          # what weighs a tier before it serves; None: adopted by rank
    shipped: Route             # a graph that travels to the workers (or, inprocess, compiles here)
    here: Route                # a graph that cannot travel: inductor in the backend call
    remote: bool               # jobs go to workers: warm them as the backend is made
    stores: PendingStores | None = None  # entries stored once their tier serves
    probation: bool = False    # ungated, a tier that swaps in is weighed against eager's calls
    rung_last: bool = False    # the rung of pieces is sent after the tier it stands in for

    def route(self, prepared: Prepared) -> Route:
        """The route of a prepared graph: ``here`` if it was to travel and could not."""
        return self.here if self.remote and prepared.request is None else self.shipped


def compose(options: Options, *, cache: CacheAccess, recorder: Recorder, load: Load,
            job: Compile, on_loader: OnLoader) -> Composition:
    plan = options.plan
    tiers: Sequence[Tier] = options.tiers if plan.climbs else options.tiers[-1:]
    # The pieces' rung serves compiled code sooner; where one worker takes both jobs, the
    # whole graph then waits for the pieces' compile (GPT-2 on the H100: 3.2 s). Progressive's
    # final tier comes minutes later anyway. Async's is its one tier: "auto" gives it the rung
    # where its jobs go to the compile service and the service's pool has two workers, which
    # it keeps warm (service/server.py; its size is this machine's default, as this process
    # reckons it: one per two cores), not where the local pool starts its second worker only
    # for jobs that would wait longer than that start.
    # There async sends its whole graph first and the pieces after (``rung_last``): a service
    # with one worker free (the first process ever: its second still starting) compiles the
    # tier that stays first, and the pieces, later, serve nothing.
    # Where async's jobs go to the compile service, its one tier compiles in parts, one per
    # warm worker at once (service/parts.py): the tier that stays serves about when the
    # pieces' rung would have, so there is no rung.
    parts = _parts(options, plan.climbs or plan.here or plan.waits)
    if parts > 1:
        tiers = [replace(t, parts=parts) for t in tiers]
    wanted = options.regions == "on" or (options.regions == "auto" and parts == 1 and (
        plan.climbs or (options.executor == registry.SERVICE and default_workers() >= 2)))
    rung_last = wanted and options.regions == "auto" and not plan.climbs
    if wanted and not plan.here and not plan.waits:  # the rung is pieces, not parts
        tiers = [*(replace(t, parts=1) for t in _bridge(tiers)), *tiers]
    if recorder.profiling:  # kernels named for profilers
        tiers = [profiled(t) for t in tiers]
    gate = Gate(options.gate_threshold, {t.name: t.load_config for t in tiers})
    inprocess = InProcess(cache, recorder, load)
    here = Route(inprocess, waits=True, first_only=not plan.waits)
    lifecycle = None if plan.here else TierLifecycle(cache, job, load, on_loader, recorder,
                                                      store_first=plan.gated,
                                                      forced=options.force_tier)
    shipped = here if lifecycle is None else Route(lifecycle, waits=plan.waits)
    return Composition(tiers=list(tiers), gate=gate if plan.gated else None,
                       shipped=shipped, here=here, remote=not plan.here,
                       stores=lifecycle.stores if lifecycle is not None else None,
                       probation=plan.probation, rung_last=rung_last)
