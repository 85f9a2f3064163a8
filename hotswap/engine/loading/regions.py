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

__all__ = ["Regional", "check_plan"]


def check_plan(plan: Any, artifact_size: int) -> dict[str, Any]:
    """``plan`` if well formed for an artifact of ``artifact_size`` bytes, else ValueError."""
    try:
        n_inputs, sizes, steps = int(plan["inputs"]), list(plan["sizes"]), list(plan["steps"])
        outputs = [int(o) for o in plan["outputs"]]
        made = set(range(n_inputs))
        for piece, ins, outs in steps:
            if not 0 <= int(piece) < len(sizes) or any(int(i) not in made for i in ins):
                raise ValueError(f"step {piece, ins, outs} reads a value not made before it")
            if any(int(o) < n_inputs or int(o) in made for o in outs) or \
                    len(set(outs)) != len(outs):
                raise ValueError(f"step {piece, ins, outs} makes a value made before it")
            made.update(int(o) for o in outs)
        if any(o != -1 and o not in made for o in outputs):
            raise ValueError("an output is never made")
        if sum(int(n) for n in sizes) != artifact_size or any(int(n) <= 0 for n in sizes):
            raise ValueError("the pieces' sizes do not add up to the artifact")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"artifact entry has a malformed region plan: {e}") from e
    return {"inputs": n_inputs, "sizes": [int(n) for n in sizes], "outputs": outputs,
            "steps": [(int(p), [int(i) for i in ins], [int(o) for o in outs])
                      for p, ins, outs in steps]}


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
