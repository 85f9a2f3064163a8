"""One graph's journey: its request, its tiers and where each one stands, in one object.

Each tier of the graph's ladder walks one state machine (``TierState``):

    pending --> compiled --> loaded --+--> serving --> replaced --> serving ...
       |           |  \\               |    ^    |  \\      (a tier above it swapped in; it
       |           |   '--> pending   +--> measuring  '--> kept   serves again if that one
       |           |   (a cached entry |       |       (gave way)  is dropped or gives way)
       v           v    compiled again)'--> kept <--'
     kept       failed  <-- from any state before kept (a compile, a load or a call failed)

With a gate, a loaded tier is ``measuring`` against the one serving (eager first) before it
serves. While a busy machine leaves the gate undecided, the faster-looking of the two serves
(``measuring <-> serving``, ``give_way``), and the graph is not final.

``kept``: ready or not needed, and not served (the gate kept it out, a better tier came from
the cache, a tier above already serves). ``kept`` and ``failed`` are final; the graph is final
when no tier is pending, compiled, loaded or measuring and the gate has nothing left to
decide. Then the journey lets go of what only later compiles and benchmarks needed (the
shipped graph, the artifacts): a process that compiles many graphs keeps only their
callables and their status.

The journey is the runner's listener (graph.py): swaps, first calls and drops come here, are
recorded on the timeline and change the tiers' states. ``status()`` is built from it alone.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hotswap.cache.store import has_unread
from hotswap.counting import bump
from hotswap.engine import served
from hotswap.engine.graph import GraphRunner, TierFailed
from hotswap.engine.loading.first_run import FirstRun
from hotswap.engine.options import Tier
from hotswap.engine.served import Window
from hotswap.engine.shipping.request import GraphRequest, Prepared
from hotswap.engine.shipping.wire import CachedEntry, InputMeta
from hotswap.profiles.bench import faster_by
from hotswap.profiles.records import Swap

if TYPE_CHECKING:
    from hotswap.engine.policy.gate import Retry
    from hotswap.engine.recording import Recorder

__all__ = ["Candidate", "Entry", "GraphJourney", "GraphStatus", "Statuses", "TierState"]

log = logging.getLogger("hotswap")

# Told that a tier on probation gave way: (tier, eager's window, the tier's, the reason).
GaveWay = Callable[[str, Window, Window, str], None]

# A packed artifact (a worker's result arrives as a view), or where the cache holds it.
Entry = bytes | bytearray | memoryview | CachedEntry


class TierState(enum.Enum):
    PENDING = "pending"
    COMPILED = "compiled"
    LOADED = "loaded"
    MEASURING = "measuring"
    SERVING = "serving"
    REPLACED = "replaced"
    KEPT = "kept"
    FAILED = "failed"


S = TierState
_NEXT: dict[TierState, frozenset[TierState]] = {
    S.PENDING: frozenset({S.COMPILED, S.KEPT, S.FAILED}),
    S.COMPILED: frozenset({S.LOADED, S.PENDING, S.FAILED}),
    S.LOADED: frozenset({S.SERVING, S.MEASURING, S.KEPT, S.FAILED}),
    S.MEASURING: frozenset({S.SERVING, S.KEPT, S.FAILED}),
    # measuring, kept: it served while the gate was undecided, and gave way
    S.SERVING: frozenset({S.REPLACED, S.MEASURING, S.KEPT, S.FAILED}),
    S.REPLACED: frozenset({S.SERVING, S.FAILED}),
    S.KEPT: frozenset(),
    S.FAILED: frozenset(),
}
_UNDER_WAY = frozenset({S.PENDING, S.COMPILED, S.LOADED, S.MEASURING})


@dataclass(frozen=True)
class GraphStatus:
    """One graph at one moment, as ``hotswap.status`` and ``hotswap.wait`` return it: a frozen
    snapshot, safe to keep; ``print`` shows ``summary()``.

    ``final`` is True once nothing is pending: every tier of the ladder served, was kept out by
    the gate, or failed. ``wait`` returns when every graph is final (or at its timeout), and a
    final graph's ``tier`` is the one that serves from then on (in ``async`` mode, unless its
    tier then serves slower than eager did: it gives way to eager, once; served.py). ``tier``
    is "eager" until a tier swaps in, and again where eager was measured faster. ``pending``
    names the tiers still compiling, loading or being measured; ``failures`` and ``kept`` hold
    (tier, reason) for the tiers that failed or were kept out, the gate's numbers among the
    reasons. ``gate`` says what the gate is doing: "measuring ..." while a measurement runs,
    "deciding ...: why" while a busy machine leaves it undecided (then the graph is not final;
    it is measured again). ``path``, ``waiting``, ``cache``, ``states``, ``served_after_s``, ``arrived_s``,
    ``final_after_s``, ``worker_priority`` and ``timings_s`` are described where they are
    declared; docs/compile.md has them in a table.
    """

    graph_id: str
    tier: str                                  # serving now; "eager" until a tier swaps in
    final: bool                                # nothing pending, whether the ladder succeeded or not
    pending: tuple[str, ...]
    failures: tuple[tuple[str, str], ...]      # (tier, reason)
    kept: tuple[tuple[str, str], ...]          # ready tiers not served, and why
    timings_s: dict[str, float] = field(default_factory=dict)  # "tier/stage" -> seconds
    eager_calls: int = 0
    # How the serving tier got here: "eager" (none did), "worker", "cache", or
    # "inprocess: <why the graph could not go to a worker>".
    path: str = "eager"
    # Why the pending tiers wait, where hotswap knows ("" otherwise), e.g. "waiting on CPU:
    # ..." when the caller's threads starve the compile workers (workers/starvation.py).
    waiting: str = ""
    # What went wrong with the artifact cache in this process ("" when nothing did): it could
    # not be opened, read, written or locked; the graph is served and compiled without it.
    cache: str = ""
    # Each tier of the ladder and its state (``TierState`` values), lowest tier first.
    states: tuple[tuple[str, str], ...] = ()
    # When each tier began serving, in seconds after the graph reached hotswap.
    served_after_s: tuple[tuple[str, float], ...] = ()
    # When each tier's artifact arrived in this process and was loaded (from a worker, the
    # cache or a compile here), in seconds after the graph reached hotswap; before the gate.
    arrived_s: tuple[tuple[str, float], ...] = ()
    # When the graph became final, in seconds after it reached hotswap; None while it is not
    # (set exactly when ``final`` is). Less the last of ``arrived_s``: how long the gate took
    # to settle the last tier.
    final_after_s: float | None = None
    # What the gate is doing for this graph now ("" when nothing): "measuring 'b' against
    # 'a'", or "deciding 'b' against 'a': <why not yet>; ..." (contended figures say so).
    gate: str = ""
    # How this process's compile workers (the pool this graph compiles in) yield the CPU to
    # it: "cgroup v1 cpu.idle" or "cgroup v2 cpu.idle" (a cgroup of their own), "autogroup +
    # SCHED_IDLE" where no cpu cgroup is ours to make (system/priority.py); "" while no
    # worker of that pool runs.
    worker_priority: str = ""
    # Each tier's calls as it served them (served.py), in ms per call: "first" (median of
    # the first calls after its swap), "first_max" (the slowest of them), "steady" (median
    # of a later window), "measured" (the gate's last measurement of it, in a worker).
    served_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    # "" unless the serving tier's steady calls ran served.GAP or more slower than the gate
    # measured it: which tier, both figures, and by how much.
    served_gap: str = ""

    def summary(self) -> str:
        """One line: what serves, since when, and what is pending, kept or failed."""
        head = f"{self.graph_id}: {self.tier}" + ("" if self.tier == "eager" else f" ({self.path})")
        if self.served_after_s:
            head += " | served " + " -> ".join(f"{tier} at {s:.1f} s"
                                                for tier, s in self.served_after_s)
        parts = [head]
        states = dict(self.states)
        # compiling or loading; a tier the gate is on is said by ``gate``
        coming = [t for t in self.pending if states.get(t) in (None, "pending", "compiled",
                                                                "loaded")]
        if coming:
            parts.append("pending " + ", ".join(coming)
                         + (f" ({self.waiting})" if self.waiting else ""))
        if self.gate:
            parts.append(self.gate)
        parts += [f"kept {tier}: {why}" for tier, why in self.kept]
        parts += [f"failed {tier}: {why}" for tier, why in self.failures]
        if self.served_gap:
            parts.append(self.served_gap)
        if self.cache:
            parts.append(f"cache: {self.cache}")
        return " | ".join(parts)

    def __str__(self) -> str:
        return self.summary()


class Statuses(list[GraphStatus]):
    """What ``hotswap.status``/``wait`` return: a list of ``GraphStatus`` that prints as one
    line per graph (each status keeps every field), then its ``notes``: what happened beside
    the graphs (dynamo's recompile limit hit, so that calls ran outside hotswap)."""

    def __init__(self, statuses: Iterable[GraphStatus] = (), *,
                 notes: Iterable[str] = ()) -> None:
        super().__init__(statuses)
        self.notes = list(notes)

    def __str__(self) -> str:
        lines = [s.summary() for s in self] or ["(no graphs)"]
        return "\n".join([*lines, *(f"note: {n}" for n in self.notes)])

    __repr__ = __str__


@dataclass(frozen=True)
class Candidate:
    """A loaded tier waiting for the gate: its callable, and where its verdict is stored."""

    tier: str                 # or "eager": the serving tier is measured against eager
    fn: Any
    verdict_key: str | None   # where a verdict on the tier is stored
    against: str = ""         # the tier it is weighed against ("eager" too), once measured
    # What its measurements so far left (the next attempt, the contended ones and their
    # evidence); None before the first
    so_far: Retry | None = None
    undecided: str = ""       # why its last measurement decided nothing (status().gate)


def _slower_than(window: Window, eager: Window) -> bool:
    """A tier on probation gives way: its steady median GAP or more slower than eager's, or
    even the fastest call of a window FAR_SLOWER times eager's median."""
    if window.name == "steady" and window.median_ms >= eager.median_ms * (1.0 + served.GAP):
        return True
    return min(window.times_ms) >= eager.median_ms * served.FAR_SLOWER


class GraphJourney:
    """One graph: its runner, its shipped request, and its tiers' states. Thread-safe."""

    def __init__(self, runner: GraphRunner, gm: torch.fx.GraphModule, tiers: list[Tier],
                 recorder: Recorder, prepared: Prepared | None = None, *,
                 raise_failures: bool = False, retain: bool = False,
                 first_run: FirstRun | None = None) -> None:
        prepared = prepared or Prepared(origin="")
        self.runner = runner
        self.graph_id = runner.graph_id
        self.gm = gm
        self.tiers = tiers
        self.recorder = recorder
        self.inputs: tuple[InputMeta, ...] | None = prepared.inputs  # None: not portable
        self.request: GraphRequest | None = prepared.request  # None: not shipped (or let go)
        self.here_because = prepared.here_because  # why it compiles here, not in a worker
        self.origin = prepared.origin              # where the graph came from (cache labels)
        self.keys: dict[str, str] = dict(prepared.keys)  # tier -> cache key
        # Copies of the example inputs each loaded tier first runs on (first_run.py); None
        # where no run is safe or worth it, and once the graph is final.
        self.first_run = first_run
        self._raise_failures = raise_failures
        self._retain = retain                    # keep request and entries once final
        self._lock = threading.Lock()
        self._states = {t.name: S.PENDING for t in tiers}
        self._paths: dict[str, str] = {}
        self._failures: list[tuple[str, str]] = []
        self._kept: list[tuple[str, str]] = []
        self._timings: dict[str, float] = {}
        self._born_s = time.monotonic()
        self._served_after: list[tuple[str, float]] = []
        self._arrived: list[tuple[str, float]] = []
        self._final_after: float | None = None  # since born, while final (status())
        self._entries: dict[str, Entry] = {}     # what a later benchmark of a tier loads
        self._compared = False                   # its tiers' comparison claimed (profiling)
        self._waiting: list[Candidate] = []      # loaded tiers queued for the gate
        self._measuring = False
        self._gate = ""                          # what the gate does now (status().gate)
        self._deciding = ""                      # the tier it is deciding on, serving or not
        self._local = False                      # a tier of it compiles here (local.py)
        self._forgotten = False                  # torch.compiler.reset() let go of it
        self._served_ms: dict[str, dict[str, float]] = {}  # status().served_ms
        self._measured_contended: dict[str, bool] = {}  # its last measurement was contended
        self._served_gaps: dict[str, str] = {}  # per tier; status() says the serving one's
        # No gate weighs a tier before it serves: a tier whose calls run served.GAP or more
        # slower than eager's gives way to eager (on_probation); eager's timed calls
        self._probation = False
        self._eager_window: Window | None = None
        self._gave_way: GaveWay | None = None  # told of a tier probation sent back
        runner.clock = served.clock_for(m.device for m in self.inputs or () if m.is_tensor)
        runner.listener = self

    @property
    def serving(self) -> str:
        """The tier that answers the graph's calls now: the runner's, told by nobody else."""
        return self.runner.tier

    # ------------------------------------------------------------------ the state machine

    def state(self, tier: str) -> TierState:
        with self._lock:
            return self._states[tier]

    def to(self, tier: str, state: TierState) -> None:
        """Move ``tier`` to ``state``. A move the machine does not allow is hotswap's bug: it
        is logged, counted (``internal_errors``) and the tier fails, so no wait hangs on it."""
        with self._lock:
            ok = self._move(tier, state)
        if not ok:
            self.fail(tier, f"internal error: tier went {self._states[tier].value} -> "
                            f"{state.value}", level=logging.ERROR)

    def _move(self, tier: str, state: TierState) -> bool:
        if state not in _NEXT[self._states[tier]]:
            bump("internal_errors")
            return False
        self._states[tier] = state
        self._note_final_locked()
        return True

    def _note_final_locked(self) -> None:
        """After each change of a tier's state or of the gate's queue: when the graph became
        final (None again while it is not)."""
        if not self._final_locked():
            self._final_after = None
        elif self._final_after is None:
            self._final_after = time.monotonic() - self._born_s

    @property
    def final(self) -> bool:
        with self._lock:
            return self._final_locked()

    def _final_locked(self) -> bool:
        return not self._measuring and not any(s in _UNDER_WAY for s in self._states.values())

    def arrived(self, tier: str, path: str) -> None:
        """``tier``'s artifact came by ``path`` ("worker", "cache", "inprocess: ...") and
        is loaded."""
        with self._lock:
            self._paths[tier] = path
            self._arrived.append((tier, time.monotonic() - self._born_s))
            if self._states[tier] is S.PENDING:
                self._move(tier, S.COMPILED)
            ok = self._move(tier, S.LOADED)
        if not ok:
            self.fail(tier, "internal error: arrived twice", level=logging.ERROR)

    def serve_now(self, tier: str, fn: Any) -> None:
        """A first call waited for ``tier``: it serves from that call on."""
        self.runner.serve_now(tier, fn)
        self.to(tier, S.SERVING)
        with self._lock:
            self._served_after.append((tier, time.monotonic() - self._born_s))

    def swap_in(self, tier: str, fn: Any, *, measured: bool = False) -> None:
        """Offer a loaded (or measured) tier to the runner; one it does not adopt is kept."""
        serving = self.runner.tier
        if not self.runner.swap_in(tier, fn, measured=measured):
            self.keep(tier, f"tier {serving!r} already serves")

    def keep_below(self, tier: str) -> None:
        """Keep the tiers below ``tier`` that are still compiling: where tiers are adopted by
        rank (no gate), none of them would serve once ``tier`` does, and the graph is final
        without waiting for them (async's pieces, sent after the whole graph; ``unwanted``).
        A gate weighs a later lower tier against what serves: there they stay."""
        names = [t.name for t in self.tiers]
        below = names[:names.index(tier)] if tier in names else []
        with self._lock:
            under_way = [t for t in below if self._states.get(t) is S.PENDING]
        for name in under_way:
            self.keep(name, f"tier {tier!r} already serves")

    def keep(self, tier: str, reason: str, *, on_timeline: bool = False) -> None:
        """A tier that will not serve; ``status().kept`` says why (and, ``on_timeline``, the
        profile's swap records)."""
        if self._mark_kept(tier, reason) and on_timeline:
            # a decision (the gate's, now or in an earlier run): said once
            log.info("graph %s: tier %r kept out: %s", self.graph_id, tier, reason)
            self.recorder.timeline.add(Swap(self.graph_id, self.runner.tier, tier,
                                            time.monotonic(), "kept"))

    def _mark_kept(self, tier: str, reason: str) -> bool:
        """Move ``tier`` to kept, with its reason; False (and the tier failed) where its state
        does not allow it."""
        with self._lock:
            ok = self._move(tier, S.KEPT)
            if ok:
                self._kept.append((tier, reason))
        if not ok:
            self.fail(tier, f"internal error: kept from {self.state(tier).value}",
                      level=logging.ERROR)
        return ok

    def fail(self, tier: str, reason: str, *, level: int = logging.WARNING) -> None:
        """Record a failed tier; the graph stays where it is. Logged once (WARNING by
        default); with ``on_failure="raise"``, the graph's next call raises it. A forgotten
        graph's tier ends quietly: no one asked for it any more."""
        with self._lock:
            self._states[tier] = S.FAILED
            self._failures.append((tier, reason))
            self._note_final_locked()
            forgotten = self._forgotten
        if forgotten:
            log.debug("hotswap graph %s: tier %r ended after a reset: %s", self.graph_id, tier,
                      reason)
            return
        bump("fallbacks")
        log.log(level, "hotswap graph %s: tier %r failed, staying on %r: %s",
                self.graph_id, tier, self.runner.tier, reason)
        self.recorder.timeline.add(Swap(self.graph_id, self.runner.tier, tier, time.monotonic(),
                                        "failed"))
        if self._raise_failures:
            self.runner.raise_next(TierFailed(self.graph_id, tier, reason))

    def give_way(self, tier: str,
                 reason: str | Callable[[str], str] | None = None) -> str | None:
        """``tier`` served before the gate decided on it, and the tier it replaced measured
        faster: that one serves again, and is returned. ``reason``: the gate kept ``tier``
        out, and why (or a function of the tier that serves again that says it); None: it
        is still being decided. None (nothing changes) if ``tier`` no longer serves."""
        back = self.runner.give_way(tier)
        if back is None:
            return None
        if callable(reason):
            reason = reason(back)
        with self._lock:
            if back in self._states and self._states[back] is S.REPLACED:
                self._move(back, S.SERVING)
            self._served_after.append((back, time.monotonic() - self._born_s))
            ok = self._move(tier, S.MEASURING if reason is None else S.KEPT)
            if ok and reason is not None:
                self._kept.append((tier, reason))
        if not ok:
            self.fail(tier, f"internal error: gave way from {self.state(tier).value}",
                      level=logging.ERROR)
        log.info("graph %s: tier %r gave way to %r%s", self.graph_id, tier, back,
                 f": {reason}" if reason else " while the gate decides")
        self.recorder.timeline.add(Swap(self.graph_id, tier, back, time.monotonic(),
                                        "kept" if reason is not None else "swap"))
        return back

    # ------------------------------------------------------------------ the runner's listener

    def swapped(self, tier: str, previous: str) -> None:
        with self._lock:
            if previous in self._states and self._states[previous] is S.SERVING:
                self._move(previous, S.REPLACED)
            ok = self._move(tier, S.SERVING)
            self._served_after.append((tier, time.monotonic() - self._born_s))
        log.info("graph %s: now served by tier %r", self.graph_id, tier)
        self.recorder.timeline.add(Swap(self.graph_id, previous, tier, time.monotonic(), "swap"))
        if not ok:
            self.fail(tier, "internal error: swapped in from an unloaded state",
                      level=logging.ERROR)

    def first_call(self, tier: str, start_s: float, end_s: float) -> None:
        self.recorder.span(self, tier, "first_call", start_s, end_s)

    def on_probation(self, gave_way: GaveWay | None = None) -> None:
        """No gate weighs this graph's tier before it serves: eager's calls are timed, and a
        tier whose calls as served run slower than eager's gives way to it (``served`` says
        by how much); then ``gave_way(tier, eager's window, the tier's, the reason)``."""
        with self._lock:
            self._probation = True
            self._gave_way = gave_way
        self.runner.time_eager()

    def served(self, window: Window) -> None:
        """A window of ``window.tier``'s calls was timed as it served (served.py): kept for
        status, and a steady median GAP or more slower than the gate measured is reported.
        On probation, a tier's steady window GAP or more slower than eager's sends it back
        to eager; its first window only where even its fastest call took FAR_SLOWER times
        eager's median (the swap's own work, the entry's store and other graphs' loads, runs
        beside the calls right after it, and can slow them; never all of them that much)."""
        gap = ""
        revert: Callable[[str], str] | None = None
        with self._lock:
            if window.tier == "eager":
                self._eager_window = window
            eager = self._eager_window
            if self._probation and not self._forgotten and eager is not None and \
                    window.tier != "eager" and _slower_than(window, eager):
                # It gives way to what it replaced: eager, or a lower tier (the pieces under
                # async's whole graph) that served on probation itself; the reason names it.
                figures_text = (
                    f"(per call eager {eager.median_ms:.4g} ms, {window.tier!r} "
                    f"{window.median_ms:.4g} ms: medians of {len(eager.times_ms)} eager and "
                    f"{len(window.times_ms)} {window.tier!r} calls; it gives way at "
                    f"{served.GAP:.0%} slower, or at once where its fastest call took "
                    f"{served.FAR_SLOWER:g}x eager's median)")
                faster = faster_by(eager.median_ms / window.median_ms)

                def revert(back: str) -> str:
                    kept = "eager" if back == "eager" else repr(back)
                    return f"eager is {faster} faster as served; kept {kept} {figures_text}"
            figures = self._served_ms.setdefault(window.tier, {})
            figures[window.name] = window.median_ms
            if window.name == "first":
                figures["first_max"] = window.max_ms
            measured = figures.get("measured")
            if window.name == "steady" and measured and \
                    window.median_ms >= measured * (1.0 + served.GAP):
                how = " (a contended measurement)" if self._measured_contended.get(
                    window.tier) else ""
                gap = self._served_gaps[window.tier] = (
                    f"{window.tier!r} serves at {window.median_ms:.4g} ms per call, "
                    f"{window.median_ms / measured - 1.0:.0%} slower than the gate measured it "
                    f"in a worker: {measured:.4g} ms{how}")
        if gap:
            bump("served_gaps")
            log.info("graph %s: %s", self.graph_id, gap)
        back = self.give_way(window.tier, revert) if revert is not None else None
        if back is not None and revert is not None:
            bump("probation_reverts")
            if self._gave_way is not None and eager is not None:
                self._gave_way(window.tier, eager, window, revert(back))

    def measured(self, tier: str, ms: float, contended: bool) -> None:
        """The gate's latest per-call figure for ``tier`` (eager included); a contended one
        (slowed by whatever took the CPU) does not replace a clean one."""
        with self._lock:
            if contended and self._measured_contended.get(tier) is False:
                return
            self._served_ms.setdefault(tier, {})["measured"] = ms
            self._measured_contended[tier] = contended

    def dropped(self, tier: str, back_to: str, reason: str) -> None:
        self.recorder.timeline.add(Swap(self.graph_id, tier, back_to, time.monotonic(),
                                        "dropped"))
        with self._lock:
            if back_to in self._states:
                self._move(back_to, S.SERVING)
        self.fail(tier, reason)

    # ------------------------------------------------------------------ the gate's queue

    def remember(self, tier: str, entry: Entry, *, only_instead: bool = False) -> None:
        """A loaded tier's packed artifact, or where the cache holds it (then the bytes are
        not sent again): what a later benchmark of this graph loads. ``only_instead``: only
        in place of one remembered already (not once the graph has let go of its entries).
        A payload read with spans left unread (``store.Unread``: the cache's read for a load)
        is not: a benchmark loads it elsewhere, where those spans may be needed."""
        if has_unread(entry):  # tiers.py remembers where the cache holds it instead
            log.warning("hotswap: graph %s tier %r: not kept for a benchmark (a partial read "
                        "of its cache entry)", self.graph_id, tier)
            return
        with self._lock:
            if not only_instead or tier in self._entries:
                self._entries[tier] = entry

    def entries(self, tiers: tuple[str, ...] | None = None) -> dict[str, Entry]:
        with self._lock:
            return {t: e for t, e in self._entries.items() if tiers is None or t in tiers}

    def queue_for_gate(self, candidate: Candidate) -> bool:
        """Mark ``candidate`` measuring; False if another one is measured now (it waits)."""
        with self._lock:
            if self._measuring:
                self._waiting.append(candidate)
                return False
            self._measuring = True
            self._note_final_locked()
            return True

    def gate_doing(self, what: str, tier: str = "") -> None:
        """What the gate does now, as ``status().gate`` says it; ``tier``: the one it is
        deciding on (pending whether it serves meanwhile or not)."""
        with self._lock:
            self._gate, self._deciding = what, tier

    def next_for_gate(self) -> Candidate | None:
        """The gate is done with one candidate: the next one waiting, if any."""
        with self._lock:
            self._gate, self._deciding = "", ""
            if self._waiting:
                return self._waiting.pop(0)
            self._measuring = False
            self._note_final_locked()
            return None

    def claim_local(self) -> bool:
        """True once: the one tier of this graph that may compile in this process."""
        with self._lock:
            first, self._local = not self._local, True
            return first

    def forget(self) -> None:
        """``torch.compiler.reset()``: dynamo let go of this graph. What is under way for it
        ends quietly (tiers.py, ladder.py and the coordinator look here): nothing more loads,
        swaps in or is measured, and no failure is logged or counted."""
        with self._lock:
            self._forgotten = True

    @property
    def forgotten(self) -> bool:
        with self._lock:
            return self._forgotten

    def unwanted(self, tier: str) -> bool:
        """Whether nothing will serve ``tier``, whatever comes of its compile: the graph was
        let go (a reset), or the tier was kept while it compiled (``keep_below``)."""
        with self._lock:
            return self._forgotten or self._states.get(tier) is S.KEPT

    def claim_comparison(self) -> bool:
        """True once only: the caller compares this final graph's tiers (profiling runs)."""
        with self._lock:
            claimed, self._compared = self._compared, True
        return not claimed

    @property
    def comparison_claimed(self) -> bool:
        with self._lock:
            return self._compared

    def let_go(self) -> None:
        """The ladder is final: nothing will ship or measure this graph again."""
        self.first_run = None  # no tier loads any more
        if self._retain:
            return
        with self._lock:
            self.request = None
            self._entries.clear()

    # ------------------------------------------------------------------ status

    def add_timing(self, key: str, seconds: float, *, accumulate: bool = True) -> None:
        """``status().timings_s[key]``: add ``seconds`` to it (or set it)."""
        with self._lock:
            self._timings[key] = (self._timings.get(key, 0.0) if accumulate else 0.0) + seconds

    def add_timings(self, added: dict[str, float], replaced: dict[str, float]) -> None:
        """``add_timing`` of many keys at once: ``added`` add up, ``replaced`` are set."""
        with self._lock:
            for key, seconds in added.items():
                self._timings[key] = self._timings.get(key, 0.0) + seconds
            self._timings.update(replaced)

    def status(self) -> GraphStatus:
        serving = self.runner.tier
        with self._lock:
            return GraphStatus(
                graph_id=self.graph_id,
                tier=serving,
                final=self._final_locked(),
                pending=tuple(t.name for t in self.tiers if self._states[t.name] in _UNDER_WAY
                              or t.name == self._deciding),
                failures=tuple(self._failures),
                kept=tuple(self._kept),
                timings_s=dict(self._timings),
                eager_calls=self.runner.eager_calls,
                path=self._paths.get(serving, "eager"),
                states=tuple((t.name, self._states[t.name].value) for t in self.tiers),
                served_after_s=tuple(self._served_after),
                arrived_s=tuple(self._arrived),
                final_after_s=self._final_after,
                gate=self._gate,
                served_ms={tier: dict(f) for tier, f in self._served_ms.items()},
                served_gap=self._served_gaps.get(serving, ""),
            )
