"""Which of a graph's nodes belong to a repeated region (a transformer's blocks, any module in
a ``ModuleList`` or ``Sequential`` beside others alike), and how the graph cuts into runs.

Dynamo records, for each node, the stack of modules it was traced in
(``node.meta["nn_module_stack"]``, outermost first: ``"L['self'].transformer.h.3"``). A module
whose path ends in an index, with a sibling under the same parent, is a region. The graph cuts
into *runs*: maximal stretches of nodes of one region, or of none (the glue between them).
Runs alike (the same operations on inputs of the same layout, whatever their nodes are named)
compile once (jobs/regions.py). The user's process labels the nodes (the shipped graph has no
node meta) and sends labels only where cutting pays (``WORTH``); the worker cuts the graph it
lands by them.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import operator
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.node import map_aggregate
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["WORTH", "Run", "example_value", "part_labels", "region_labels", "runs_of"]

log = logging.getLogger("hotswap")

# A graph is cut where its distinct runs hold at most this share of its nodes (each compile
# has costs of its own): GPT-2's six blocks leave about a quarter, ResNet-18's eight units
# (six of them distinct) most of theirs.
WORTH = 0.5

_INDEXED = re.compile(r"^(.+?)(?:\.(\d+)|\[(\d+)\])$")
# Nodes of no region however they were traced: the graph's inputs and outputs, and the
# attributes it reads (each run that reads one holds its own reference).
_OUTSIDE = ("placeholder", "output", "get_attr")
# A graph cut into parts (``part_labels``) has at least this many calls per part.
_MIN_PART_NODES = 16
# How deep in nested regions a graph is cut at most.
_DEPTHS = 3
# The call that changes the grad mode for the rest of the graph: each run compiles under the
# mode the graph is called under, so a switch and its way back stay within one run; so do
# contexts (``_contexts_kept``).
_GRAD_MODE = torch._C._set_grad_enabled
# Contexts traced as two calls of one function, to set and to restore (``sdpa_kernel``).
_SET_AND_RESTORE = ("_sdpa_kernel",)
# Calls that neither change their inputs nor draw random numbers: where nothing live reads
# their value, the pieces leave them out, as inductor does in the whole graph. Mistral's blocks
# each move a CPU ``torch.tensor(4096)`` made in the glue to the device and never read it;
# kept, it crossed into every block and the glue's piece returned two CPU tensors, a C++
# kernel beside its Triton ones (55 s of code generation in a GPU worker).
_PURE_METHODS = frozenset({"to", "type", "float", "double", "half", "bfloat16", "int", "long",
                           "bool", "contiguous", "view", "reshape", "expand", "unsqueeze",
                           "squeeze", "size", "dim", "detach"})
_PURE_FUNCTIONS = (torch.tensor, operator.getitem, torch._C._log_api_usage_once)


@dataclass
class Run:
    nodes: list[torch.fx.Node]
    inputs: list[torch.fx.Node]   # made outside it (placeholders, earlier runs), first use first
    outputs: list[torch.fx.Node]  # used after it (later runs, the graph's output)
    signature: str
    views: bool                   # two of its inputs share storage (views of one tensor)


def region_labels(gm: torch.fx.GraphModule,
                  static: Sequence[bool] | None = None) -> tuple[int, ...]:
    """``_labels``, or empty (the whole graph) should anything in it raise: it runs in the
    caller's first call."""
    try:
        return _labels(gm, static)
    except Exception as e:  # a graph this code did not foresee: compiled whole
        log.debug("hotswap: regions not labelled: %s: %s", type(e).__name__, e)
        return ()


def _labels(gm: torch.fx.GraphModule, static: Sequence[bool] | None) -> tuple[int, ...]:
    """Per node of ``gm``'s graph, in order: the region it belongs to (0, 1, ... in order of
    appearance) or -1. A region is an indexed module beside a sibling that is itself made of
    modules (a block, not a bare layer). A node in nested regions (a block in a stage) takes
    the outermost, or the next where cutting there does not gain. Empty where the graph has
    fewer than two regions, cannot be cut (``runs_of``) or would not gain (``WORTH``).
    ``static``: the placeholders dynamo marked static. A few ms for a 700-node graph."""
    nodes = list(gm.graph.nodes)
    found: list[list[tuple[str, str]]] = []
    siblings: dict[str, set[str]] = defaultdict(set)
    containers: set[str] = set()  # indexed modules with nodes traced in a submodule of theirs
    for node in nodes:
        stack = node.meta.get("nn_module_stack") if node.op not in _OUTSIDE else None
        paths = [str(v[0] if isinstance(v, tuple) else v) for v in (stack or {}).values()]
        indexed = []
        for depth, path in enumerate(paths):
            match = _INDEXED.match(path)
            if match is not None:
                indexed.append((match.group(1), path))
                siblings[match.group(1)].add(path)
                if depth + 1 < len(paths):
                    containers.add(path)
        found.append(indexed)
    for depth in range(_DEPTHS):  # stages of blocks: the blocks, where the stages differ
        labels = _at_depth(found, depth, siblings, containers)
        if labels is None:
            return ()
        runs = runs_of(gm, labels, static)
        if runs is not None and worth(runs):
            return labels
    return ()


def _at_depth(found: list[list[tuple[str, str]]], depth: int, siblings: dict[str, set[str]],
              containers: set[str]) -> tuple[int, ...] | None:
    """Labels by each node's ``depth``-th region (outermost: 0); None where fewer than two."""
    named: dict[str, int] = {}
    labels = []
    for indexed in found:
        # A block: beside a sibling, and made of modules of its own (a Sequential's bare
        # Linear is one operation: a piece of its own would only cost a call).
        blocks = [path for parent, path in indexed
                  if len(siblings[parent]) >= 2 and path in containers]
        labels.append(named.setdefault(blocks[depth], len(named))
                      if len(blocks) > depth else -1)
    return tuple(labels) if len(named) >= 2 else None


def worth(runs: list[Run]) -> bool:
    """Whether the distinct runs hold at most ``WORTH`` of the graph's nodes."""
    firsts: dict[str, int] = {}
    for run in runs:
        firsts.setdefault(run.signature, len(run.nodes) + len(run.inputs))
    return sum(firsts.values()) <= WORTH * sum(len(r.nodes) + len(r.inputs) for r in runs)


def runs_of(gm: torch.fx.GraphModule, labels: Sequence[int],
            static: Sequence[bool] | None = None) -> list[Run] | None:
    """The graph's runs, in order; None where it is not cut: fewer than two runs, or a graph
    that starts a run under another grad mode than this thread's (the caller's, or the
    worker's as it compiles the graph), enters a context in one run and leaves it in another
    (``_contexts_kept``), calls a submodule, holds a subgraph, returns anything but a tuple
    of computed values, inputs and Nones, or passes from one run to the next a value that is
    not a plain tensor or number (``_travels``)."""
    nodes = list(gm.graph.nodes)
    if len(labels) != len(nodes) or not _cuttable(gm, nodes):
        return None
    dead = _dead(nodes)
    labelled = [(n, label) for n, label in zip(nodes, _smoothed(nodes, labels), strict=True)
                if n.op in ("call_function", "call_method") and n not in dead]
    stretches = [[n for n, _ in group]
                 for _, group in itertools.groupby(labelled, key=lambda pair: pair[1])]
    if len(stretches) < 2:
        return None
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    flags = dict(zip(placeholders, static or [False] * len(placeholders), strict=True))
    if not _grad_mode_kept(stretches):
        return None
    run_of = {node: i for i, stretch in enumerate(stretches) for node in stretch}
    if not _contexts_kept(nodes, run_of):
        return None
    last_use: dict[torch.fx.Node, int] = {}
    for node in nodes:
        for user in node.users.keys() - dead:
            at = len(stretches) if user.op == "output" else run_of.get(user, -1)
            last_use[node] = max(last_use.get(node, -1), at)
    runs = []
    for i, stretch in enumerate(stretches):
        inputs: list[torch.fx.Node] = []
        for node in stretch:
            for used in node.all_input_nodes:
                if used.op != "get_attr" and run_of.get(used) != i and used not in inputs:
                    inputs.append(used)
        outputs = [node for node in stretch if last_use.get(node, -1) > i]
        values = [example_value(n) for n in inputs]
        if not all(_travels(v) for v in values):
            return None
        sharing = _sharing(values)
        runs.append(Run(stretch, inputs, outputs,
                        _signature(stretch, inputs, values,
                                   [flags.get(n, False) for n in inputs], sharing, outputs),
                        any(s >= 0 for s in sharing)))
    return runs


def part_labels(gm: torch.fx.GraphModule, parts: int) -> tuple[int, ...] | None:
    """Per node of ``gm``'s graph, which of ``parts`` contiguous parts it falls in, cut where
    fewest computed values cross (a transformer's residual stream between two blocks, a
    convolutional net's between two units) within ``1 / (8 * parts)`` of the graph either
    side of each even share (a sixteenth for two); None where the graph is too small or has
    no such place outside a context (grad mode, autocast, ``sdpa_kernel``) or free of values
    that cannot pass between pieces (``_travels``). ``runs_of`` then cuts the graph by them."""
    nodes = list(gm.graph.nodes)
    dead = _dead(nodes)
    compute = [n for n in nodes if n.op in ("call_function", "call_method") and n not in dead]
    n = len(compute)
    if parts < 2 or n < parts * _MIN_PART_NODES:
        return None
    at = {node: i for i, node in enumerate(compute)}
    # crossing[c]: values made before compute[c] that a node from c on reads; blocked[c]: of
    # them, those that cannot travel, plus the contexts open there.
    crossing, blocked = [0] * (n + 1), [0] * (n + 1)
    for i, node in enumerate(compute):
        last = max((at[u] for u in node.users if u in at), default=i)
        if last > i:
            crossing[i + 1] += 1
            crossing[last + 1] -= 1
            if not _travels(example_value(node)):
                blocked[i + 1] += 1
                blocked[last + 1] -= 1
    ambient = grad = torch.is_grad_enabled()
    depth, toggled = 0, set[Any]()
    open_at = [False] * (n + 1)
    for i, node in enumerate(compute):
        name = getattr(node.target, "__name__", "")
        if node.target is _GRAD_MODE and node.args:
            grad = bool(node.args[0])
        elif name.startswith("_enter_"):
            depth += 1
        elif _is_exit(node):
            depth -= 1
        elif name in _SET_AND_RESTORE:
            toggled ^= {node.target}
        open_at[i + 1] = depth != 0 or grad != ambient or bool(toggled)
    running, blocks = 0, 0
    free = []
    for c in range(n + 1):
        running += crossing[c]
        blocks += blocked[c]
        free.append(None if blocks or open_at[c] else running)
    cuts: list[int] = []
    for j in range(1, parts):
        target, reach = j * n // parts, max(1, n // (8 * parts))
        window = [c for c in range(max(1, target - reach), min(n - 1, target + reach) + 1)
                  if free[c] is not None and (not cuts or c > cuts[-1])]
        if not window:
            return None
        cuts.append(min(window, key=lambda c: (free[c], abs(c - target))))
    part = {node: sum(i >= c for c in cuts) for i, node in enumerate(compute)}
    labels, current = [], 0
    for node in nodes:  # the rest (placeholders, dead calls, the output) go with the part before
        current = part.get(node, current)
        labels.append(current)
    return tuple(labels)


def _dead(nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """The pure calls (``_PURE_METHODS``, ``_PURE_FUNCTIONS``) whose values nothing live reads."""
    dead: set[torch.fx.Node] = set()
    for node in reversed(nodes):
        pure = (node.target in _PURE_METHODS if node.op == "call_method"
                else node.op == "call_function" and node.target in _PURE_FUNCTIONS)
        if pure and node.users.keys() <= dead:
            dead.add(node)
    return dead


def _contexts_kept(nodes: list[torch.fx.Node], run_of: dict[torch.fx.Node, int]) -> bool:
    """Whether every context the graph enters (autocast, inference mode: an ``_exit_*`` call
    that takes its ``_enter_*``; or ``_SET_AND_RESTORE``'s calls, one to set and one to
    restore) is left in the run it was entered in."""
    effects: dict[Any, list[torch.fx.Node]] = defaultdict(list)
    for node in nodes:
        if node.op != "call_function" or node.target is _GRAD_MODE:
            continue
        name = getattr(node.target, "__name__", "")
        if name.startswith("_enter_"):
            if not any(_is_exit(user) for user in node.users):
                return False
        elif _is_exit(node):
            enter = node.args[0] if node.args else None
            if not isinstance(enter, torch.fx.Node) or run_of.get(enter) != run_of.get(node):
                return False
        elif name in _SET_AND_RESTORE:
            effects[node.target].append(node)
    return all(len(calls) % 2 == 0 and all(run_of.get(a) == run_of.get(b)
                                           for a, b in zip(calls[::2], calls[1::2], strict=True))
               for calls in effects.values())


def _grad_mode_kept(stretches: list[list[torch.fx.Node]]) -> bool:
    """Whether every run starts under the grad mode the graph is called (and each piece
    compiled) under: a switch and its way back within one run are fine (LLaMA's rotary
    embedding, a ``no_grad`` function, on torch 2.11)."""
    ambient = state = torch.is_grad_enabled()
    for stretch in stretches:
        if state != ambient:
            return False
        for node in stretch:
            if node.op == "call_function" and node.target is _GRAD_MODE and node.args:
                state = bool(node.args[0])
    return True


def example_value(node: torch.fx.Node) -> Any:
    """The value a node was traced with (the worker's fake propagation, or dynamo's own)."""
    return node.meta.get("val", node.meta.get("example_value"))


def _cuttable(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> bool:
    from hotswap.engine.shipping.transport import get_attr_value

    for node in nodes:
        if node.op == "call_module":
            return False
        if node.op == "get_attr" and isinstance(get_attr_value(gm, str(node.target)),
                                                torch.fx.GraphModule):
            return False
    results = nodes[-1].args[0] if nodes and nodes[-1].op == "output" else None
    return isinstance(results, tuple | list) and all(
        r is None or (isinstance(r, torch.fx.Node) and r.op != "get_attr") for r in results)


def _is_exit(node: torch.fx.Node) -> bool:
    return getattr(node.target, "__name__", "").startswith("_exit_")


def _smoothed(nodes: list[torch.fx.Node], labels: Sequence[int]) -> list[int]:
    """A node outside every region, between two nodes of one region, joins it (a getitem
    traced with no module on the stack must not cut a block in two); so does a context
    entered and left around one region's nodes."""
    out = list(labels)
    known = [i for i, n in enumerate(nodes) if out[i] >= 0]
    for before, after in itertools.pairwise(known):
        if out[before] == out[after]:
            for i in range(before + 1, after):
                if out[i] < 0:
                    out[i] = out[before]
    # A context (autocast, inference mode) entered and left around one region's nodes alone
    # (traced with no module on the stack: the block's own ``with``) belongs to that region.
    at = {node: i for i, node in enumerate(nodes)}
    for node in nodes:
        if node.op == "call_function" and _is_exit(node) and node.args \
                and isinstance(node.args[0], torch.fx.Node):
            enter, leave = at[node.args[0]], at[node]
            inside = {out[i] for i in range(enter + 1, leave)} - {-1}
            if len(inside) == 1:
                label = inside.pop()
                for i in range(enter, leave + 1):
                    out[i] = label
    return out


def _travels(value: Any) -> bool:
    """Whether a value may pass from one piece to the next: a plain strided tensor (no
    subclass, no nested or sparse layout), or a bool, int or float. Context handles (None
    as traced, or objects), symbolic sizes and the rest stay inside one run."""
    if isinstance(value, torch.Tensor):
        from torch._subclasses.fake_tensor import FakeTensor

        plain = type(value) in (torch.Tensor, torch.nn.Parameter) or isinstance(value, FakeTensor)
        return plain and value.layout == torch.strided and not value.is_nested
    return type(value) in (bool, int, float)


def _sharing(values: list[Any]) -> list[int]:
    """Per value, the first earlier one whose storage it shares (a view of one tensor), or -1."""
    storages: list[Any] = []
    out = []
    for value in values:
        storage = (StorageWeakRef(value.untyped_storage())  # type: ignore[no-untyped-call]
                   if isinstance(value, torch.Tensor) else None)
        out.append(storages.index(storage) if storage is not None and storage in storages
                   else -1)
        storages.append(storage)
    return out


def _signature(nodes: list[torch.fx.Node], inputs: list[torch.fx.Node], values: list[Any],
               static: list[bool], sharing: list[int], outputs: list[torch.fx.Node]) -> str:
    """Runs with one signature compile to one artifact: the same operations on inputs (of
    example ``values``) of the same layout, dtype, static mark and sharing of storage,
    returning the same of their nodes, whatever the nodes' names."""
    h = hashlib.sha256()
    index = {node: f"%in{i}" for i, node in enumerate(inputs)}
    index.update({node: f"%{i}" for i, node in enumerate(nodes)})
    h.update(repr([index[n] for n in outputs]).encode())

    def ref(a: Any) -> Any:
        if not isinstance(a, torch.fx.Node):
            return a
        return index.get(a, f"@{a.target}")  # an attribute, by name

    for node in nodes:
        target = node.target if isinstance(node.target, str) else repr(node.target)
        h.update(repr((node.op, target, map_aggregate(node.args, ref),
                       map_aggregate(node.kwargs, ref))).encode())
    for value, flag, shared in zip(values, static, sharing, strict=True):
        if isinstance(value, torch.Tensor):
            h.update(repr((tuple(value.shape), value.stride(), value.storage_offset(),
                           value.dtype, value.device, value.requires_grad, flag,
                           shared)).encode())
        else:
            h.update(repr((type(value).__name__, value)).encode())
    return h.hexdigest()
