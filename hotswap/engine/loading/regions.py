"""A graph served as its regions' compiled pieces (compiled by jobs/regions.py).

The plan, as an entry's header carries it::

    {"inputs": n,                      # the graph's inputs are values 0 .. n-1
     "sizes": [bytes, ...],            # each distinct piece's artifact, in the entry's order
     "steps": [[piece, [in ids], [out ids]], ...],   # called in order
     "outputs": [id or -1 (None), ...]}

A call runs the steps on one list of values, dropping each intermediate after its last use
(as the whole graph's code frees its buffers), and returns the graph's outputs as a list, as
inductor's own compiled graphs do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hotswap.cache.entry import check_plan

__all__ = ["Regional", "check_plan"]


class Regional:
    """Calls ``fns`` (the distinct pieces, loaded) as ``plan``'s steps say."""

    def __init__(self, fns: Sequence[Callable[..., Any]], plan: dict[str, Any]) -> None:
        self.pieces = list(fns)
        self._inputs = plan["inputs"]
        self._outputs = tuple(plan["outputs"])
        last: dict[int, int] = {}
        for i, (_, ins, _) in enumerate(plan["steps"]):
            for value in ins:
                last[value] = i
        keep = set(self._outputs)
        self._steps = []
        for i, (piece, ins, outs) in enumerate(plan["steps"]):
            done = tuple(v for v in ins if last[v] == i and v >= self._inputs and v not in keep)
            self._steps.append((self.pieces[piece], tuple(ins), tuple(outs), done))
        ids = [v for _, _, outs, _ in self._steps for v in outs]
        self._size = max([self._inputs - 1, *ids]) + 1

    def __call__(self, *args: Any) -> list[Any]:
        if len(args) != self._inputs:
            raise TypeError(f"this compiled graph takes {self._inputs} inputs, got {len(args)}")
        values: list[Any] = [*args, *(None,) * (self._size - len(args))]
        for fn, ins, outs, done in self._steps:
            results = fn(*[values[i] for i in ins])
            for i, result in zip(outs, results, strict=True):
                values[i] = result
            for i in done:
                values[i] = None
        return [values[i] if i >= 0 else None for i in self._outputs]
