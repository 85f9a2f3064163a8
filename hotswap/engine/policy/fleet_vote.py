"""The fleet vote: with a fleet store, each gate decision is measured by one replica and taken
by the others, as each tier is compiled by one.

    FleetVote.turn(journey, candidate, serving)
        -> MEASURE   this replica measures it: it holds the decision's claim, or no fleet
                     decision applies (no keys, or it claimed the decision already)
        -> WAIT      another replica holds the claim: look again after POLL_S
        -> Taken     another replica's verdict on it: whether the candidate won, and why
    FleetVote.verdict_key(...)  -> where this replica stores the verdict it measured
    FleetVote.done(...)         -> the claim let go, once that verdict is stored

A decision between two tiers is one decision whichever of them serves when it is measured, so
that replicas that loaded them in other orders still decide once and alike. The vote reads
and writes the fleet store through CacheAccess and starts nothing: the ladder (ladder.py)
applies a verdict taken and runs the poll timer. Its state (the claims this replica holds)
is the load thread's alone.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from hotswap.engine.journey import Candidate, GraphJourney
from hotswap.engine.policy.gate import EAGER, HELD_SUFFIX, StoredVerdict
from hotswap.engine.sources.cache_access import CacheAccess

__all__ = ["FleetVote", "Taken", "Turn"]


class Turn(enum.Enum):
    MEASURE = "measure"
    WAIT = "wait"


@dataclass(frozen=True)
class Taken:
    """Another replica's verdict on a decision: ``won`` (the candidate beat what served,
    eager too), and why, as status shows it."""

    won: bool
    reason: str


class _FleetIds(NamedTuple):
    """One fleet decision: what replicas claim to measure it, and where its verdict is
    stored when the candidate won or lost."""

    decision: str
    won: str
    lost: str


class FleetVote:
    """One replica's part in the fleet's gate decisions, over ``cache``'s fleet store."""

    # How often a replica waiting for another's decision on a tier looks for it.
    POLL_S = 0.5

    def __init__(self, cache: CacheAccess) -> None:
        self._cache = cache
        # Fleet decisions this replica has claimed and is measuring (load thread only).
        self._deciding: set[str] = set()

    def turn(self, journey: GraphJourney, candidate: Candidate, serving: str) -> Turn | Taken:
        """Whether this replica measures ``candidate`` against ``serving``, waits for another
        that does, or takes the verdict another stored."""
        ids = _fleet_ids(journey, candidate, serving)
        if ids is None or ids.decision in self._deciding:
            return Turn.MEASURE
        taken = self._taken(ids)
        if taken is not None:
            return taken
        if not self._cache.claim_decision(ids.decision):
            return Turn.WAIT
        taken = self._taken(ids)
        if taken is not None:  # decided meanwhile
            self._cache.release_decision(ids.decision)
            return taken
        self._deciding.add(ids.decision)
        return Turn.MEASURE

    def verdict_key(self, journey: GraphJourney, candidate: Candidate, serving: str, *,
                    won: bool) -> str | None:
        """Where the verdict this replica measured goes for the others (None: no fleet)."""
        ids = _fleet_ids(journey, candidate, serving) if self._cache.shared else None
        if ids is None:
            return None
        return ids.won if won else ids.lost

    def done(self, journey: GraphJourney, candidate: Candidate, serving: str) -> None:
        """The decision is applied (its verdict stored above): the others may take it."""
        ids = _fleet_ids(journey, candidate, serving) if self._deciding else None
        if ids is not None and ids.decision in self._deciding:
            self._deciding.discard(ids.decision)
            self._cache.release_decision(ids.decision)

    def _taken(self, ids: _FleetIds) -> Taken | None:
        won = self._cache.fleet_verdict(ids.won)
        lost = self._cache.fleet_verdict(ids.lost) if won is None else None
        if won is None and lost is None:
            return None
        stored = StoredVerdict.unpack(won or lost or b"")
        return Taken(won is not None, stored.reason.replace("earlier run", "another replica"))


def _fleet_ids(journey: GraphJourney, candidate: Candidate, serving: str) -> _FleetIds | None:
    """A tier against eager: its own keys (as a warm process reads them). Two tiers: one
    decision whichever of them serves when it is measured."""
    key = candidate.verdict_key
    if key is None:
        return None
    if serving == EAGER:  # as a warm process reads them: beat eager, or kept out for it
        return _FleetIds(key + "/vs-eager-check", key + HELD_SUFFIX, key)
    other = journey.keys.get(serving)
    if other is None:
        return None
    pair = "|".join(sorted((key, other)))
    return _FleetIds(pair, f"{pair}/won-by/{key}", f"{pair}/won-by/{other}")
