"""How many cases each fuzz target ran in this session (the terminal summary prints them)."""

from __future__ import annotations

from collections import Counter

CASES: Counter[str] = Counter()


def count(target: str) -> None:
    """One more case run against ``target``."""
    CASES[target] += 1
