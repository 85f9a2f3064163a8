"""A graph compiled region by region, each distinct region once (inside a worker).

A transformer's blocks trace as copies of one subgraph that differ only in the parameters they
read, which dynamo passes in as inputs. Inductor lowers and generates code for every copy;
compiled once and called once per block, GPT-2's six blocks cost one block's compile. This is
PyTorch's regional compilation (``torch.compiler.nested_compile_region``), done on the graph
dynamo hands us, with no change to the user's model::

    graph + labels (shipping/regions.py)
      -> pieces: maximal runs of nodes with one label (-1: the glue between regions)
      -> pieces alike (same nodes, same input layouts, dtypes, static marks and views of one
         another) compile once, where that saves enough (WORTH), for inputs made as their
         example values describe them
      -> artifacts (one per distinct piece) + the plan that calls them (loading/regions.py)

What is lost: fusion across a region's edge (a block's last add with the next block's first
norm), one more kernel and one more round trip through memory per edge. A ladder's later tiers
compile the whole graph, and the gate adopts one only where it measures faster.

A graph that cannot be cut safely (``shipping.regions.runs_of``: grad mode or autocast
switched inside, a submodule called, a subgraph held) compiles whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hotswap.engine.shipping.regions import Run, example_value, part_labels, runs_of, worth
from hotswap.workers import stage

__all__ = ["Piece", "Split", "compile_part", "compile_regions", "split"]


@dataclass
class Piece:
    gm: torch.fx.GraphModule
    inputs: list[int]   # value ids: the graph's placeholders are 0.., then its other nodes
    outputs: list[int]
    signature: str
    views: bool         # two of its inputs share storage (views of one tensor)


@dataclass
class Split:
    pieces: list[Piece]
    outputs: list[int]  # the graph's outputs by value id, -1 for None


def split(gm: torch.fx.GraphModule, labels: Sequence[int],
          static: Sequence[bool] | None = None) -> Split | None:
    """``gm`` as its runs' pieces (``runs_of``), or None where it is not cut."""
    runs = runs_of(gm, labels, static)
    return None if runs is None else _cut(gm, runs)


def _cut(gm: torch.fx.GraphModule, runs: list[Run]) -> Split:
    nodes = list(gm.graph.nodes)
    order = ([n for n in nodes if n.op == "placeholder"]
             + [n for n in nodes if n.op != "placeholder"])
    ids = {node: i for i, node in enumerate(order)}
    results = nodes[-1].args[0]
    return Split([_piece(gm, run, ids) for run in runs],
                 [ids[r] if r is not None else -1 for r in results])


def _piece(gm: torch.fx.GraphModule, run: Run, ids: dict[torch.fx.Node, int]) -> Piece:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, node in enumerate(run.inputs):
        env[node] = graph.placeholder(f"arg{i}")
        env[node].meta = dict(node.meta)

    def local(node: torch.fx.Node) -> torch.fx.Node:
        if node not in env:  # an attribute: each piece reads it itself
            env[node] = graph.get_attr(str(node.target))
            env[node].meta = dict(node.meta)
        return env[node]

    for node in run.nodes:
        env[node] = graph.node_copy(node, local)
    graph.output(tuple(env[n] for n in run.outputs))
    return Piece(torch.fx.GraphModule(gm, graph), [ids[n] for n in run.inputs],
                 [ids[n] for n in run.outputs], run.signature, run.views)


def compile_regions(gm: torch.fx.GraphModule, inputs: list[Any], static: Sequence[bool],
                    labels: Sequence[int],
                    compile_one: Callable[[torch.fx.GraphModule, list[Any]], bytes],
                    ) -> tuple[list[bytes], dict[str, Any]] | None:
    """The distinct pieces' artifacts, and the plan that serves the graph with them
    (``loading.regions.Regional`` reads it); None where the graph is not cut (``split``) or
    its distinct pieces hold more than ``WORTH`` of its nodes (each compile has costs of its
    own). ``inputs`` are real tensors; ``gm``'s nodes carry example values (``landed``)."""
    from hotswap import compat

    runs = runs_of(gm, labels, static)
    if runs is None or not worth(runs):
        return None
    cut = _cut(gm, runs)
    firsts: dict[str, int] = {}  # signature -> the first piece that has it, in order
    steps = []
    for i, piece in enumerate(cut.pieces):
        firsts.setdefault(piece.signature, i)
        steps.append([list(firsts).index(piece.signature), piece.inputs, piece.outputs])
    with stage("regions_examples"):
        examples = _example_inputs(cut, inputs, set(firsts.values()))
    artifacts = []
    for i in firsts.values():
        piece_gm = cut.pieces[i].gm
        compat.mark_static_inputs(piece_gm, [v < len(inputs) and bool(static[v])
                                             for v in cut.pieces[i].inputs])
        artifacts.append(compile_one(piece_gm, examples.pop(i)))
    plan = {"inputs": len(inputs), "sizes": [len(a) for a in artifacts], "steps": steps,
            "outputs": cut.outputs}
    return artifacts, plan


def compile_part(gm: torch.fx.GraphModule, inputs: list[Any], static: Sequence[bool],
                 part: int, parts: int,
                 compile_one: Callable[[torch.fx.GraphModule, list[Any]], bytes],
                 ) -> tuple[bytes, dict[str, Any]] | None:
    """Part ``part`` of ``gm`` cut into ``parts`` contiguous parts (``part_labels``), compiled
    alone, with the plan that calls all the parts in turn; None where the graph is not cut so.
    Each of the service's workers that takes a part (service/parts.py) cuts the same graph the
    same way, so their plans agree, and ``artifacts.merge_parts`` puts the parts together."""
    from hotswap import compat

    labels = part_labels(gm, parts)
    runs = None if labels is None else runs_of(gm, labels, static)
    if runs is None or len(runs) != parts:
        return None
    cut = _cut(gm, runs)
    with stage("regions_examples"):
        examples = _example_inputs(cut, inputs, {part})
    piece = cut.pieces[part]
    compat.mark_static_inputs(piece.gm, [v < len(inputs) and bool(static[v])
                                         for v in piece.inputs])
    artifact = compile_one(piece.gm, examples.pop(part))
    plan = {"inputs": len(inputs), "part": part, "parts": parts, "outputs": cut.outputs,
            "steps": [[i, p.inputs, p.outputs] for i, p in enumerate(cut.pieces)]}
    return artifact, plan


def _example_inputs(cut: Split, inputs: list[Any], wanted: set[int]) -> dict[int, list[Any]]:
    """The arguments each wanted piece compiles for: the graph's own inputs where a piece
    reads those, else tensors made as the piece's example values describe them (sizes,
    strides, storage offset). Where two inputs of a wanted piece share storage (views of one
    tensor), the graph runs eagerly on ``inputs`` as far as the last wanted piece, and the
    pieces compile for the very values they read: a first eager run on a GPU pays its
    libraries' start (cuBLAS, attention backends), seconds in a fresh worker."""
    if any(cut.pieces[i].views for i in wanted):
        return _run_eagerly(cut, inputs, wanted)
    examples = {}
    for i in wanted:
        piece = cut.pieces[i]
        placeholders = list(piece.gm.graph.find_nodes(op="placeholder"))
        examples[i] = [inputs[v] if v < len(inputs) else _like(example_value(p))
                       for v, p in zip(piece.inputs, placeholders, strict=True)]
    return examples


def _like(value: Any) -> Any:
    """A real tensor laid out as example value ``value`` is (values random: they matter to
    autotuning alone; integers 0, valid as indices)."""
    if not isinstance(value, torch.Tensor):
        return value
    extent = 1 + sum((n - 1) * st for n, st in zip(value.shape, value.stride(), strict=True))
    base = torch.empty(value.storage_offset() + extent if value.numel() else 0,
                       dtype=value.dtype, device=value.device)
    if value.dtype.is_floating_point or value.dtype.is_complex:
        base.normal_()
    else:
        base.zero_()
    return base.as_strided(value.shape, value.stride(), value.storage_offset())


def _run_eagerly(cut: Split, inputs: list[Any], wanted: set[int]) -> dict[int, list[Any]]:
    """The arguments each wanted piece is called with when the graph runs eagerly on
    ``inputs`` (as far as the last wanted piece), each value dropped after its last use."""
    last = max(wanted)
    last_use = {v: i for i, piece in enumerate(cut.pieces[:last + 1]) for v in piece.inputs}
    values: dict[int, Any] = dict(enumerate(inputs))
    examples = {}
    for i, piece in enumerate(cut.pieces[:last + 1]):
        args = [values[v] for v in piece.inputs]
        if i in wanted:
            examples[i] = args
        if i < last:
            values.update(zip(piece.outputs, piece.gm(*args), strict=True))
        for v in piece.inputs:
            if last_use[v] == i and v >= len(inputs):
                del values[v]
    return examples
