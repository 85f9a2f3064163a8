"""Moving a dynamo graph to a worker, node for node.

``pickle.dumps(GraphModule)`` is not used: ``GraphModule.__reduce__`` re-creates the module by
re-tracing its generated Python code, which changes nodes (``operator.mul`` becomes a
``call_method``) and drops node meta. AOTAutograd then refuses to cache the graph ("Unsupported
call_method target ...") and ``CompiledArtifact.save`` finds nothing to save.

Instead the graph travels as a flat list of node records (op, name, target, args, kwargs;
arguments that are nodes become references by name), together with the real values of the
tensors the graph reads through ``get_attr``. Node meta stays behind (it holds FakeTensors and
weak references, which do not pickle). Not the ``fx.Graph`` object either: its nodes form a
linked list that pickle walks recursively, and a 500-node chain overflows the C stack guard.
In the worker, fake-tensor propagation over inputs built from metadata restores
``meta["val"]`` / ``meta["example_value"]`` on every node.

Targets travel by reference (``pickling.GraphPickler``): the worker resolves each to the
identical function or operator, including those plain pickle cannot name
(``torch.nn.functional.max_pool2d``, ``torch.ops.higher_order.cond``). Subgraphs that
higher-order operators call (``cond``'s branches, activation checkpointing's body) are
attributes holding ``GraphModule``s; they travel as node records too, nested.

PyTorch's own subprocess compile mode ships graphs with ``torch.fx._graph_pickler``, which
pickles the ``GraphModule`` with its ``__dict__`` (submodules and their tensors by value) and
node meta with FakeTensors described, and names targets by their printed path under a few
roots (``torch.``, ``operator.``, ``builtins.``, ``math.``). We keep node records and do not
ship meta: FakeTensor descriptions would tie the payload to the sender's ShapeEnv, while fake
propagation in the worker rebuilds them for the worker's own symbols, and a printed path does
not find ``boolean_dispatch`` closures or re-exports, which identity search does.

Submodules called as a unit (``call_module`` nodes) do not travel: their weights would go by
value, and an artifact made around copies of them would not see the user's updates. Dynamo
inlines ``nn.Module`` calls by default (``inline_inbuilt_nn_modules``), so its graphs have
none; a graph that does compiles in the user's process instead (the coordinator's
in-process path).
"""

from __future__ import annotations

import os
import pickle
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.node import map_aggregate

from hotswap.engine.shipping.pickling import dumps

__all__ = [
    "get_attr_value",
    "land_graph",
    "mutated_attributes",
    "origin_of",
    "ship_graph",
    "submodule_reason",
    "unship_graph",
]


@dataclass(frozen=True)
class _Ref:
    """An argument that is another node of the graph, by name (not a tuple: map_aggregate
    would walk into one)."""

    name: str


@dataclass(frozen=True)
class _Subgraph:
    """A ``GraphModule`` held as an attribute (a higher-order operator's body), as records."""

    records: list[tuple[Any, ...]]
    attrs: dict[str, Any]


def ship_graph(gm: torch.fx.GraphModule) -> bytes:
    return dumps(_records(gm))


def _records(gm: torch.fx.GraphModule) -> _Subgraph:
    records = []
    attrs: dict[str, Any] = {}

    def ref(a: Any) -> Any:
        return _Ref(a.name) if isinstance(a, torch.fx.Node) else a

    for node in gm.graph.nodes:
        records.append((node.op, node.name, node.target, map_aggregate(node.args, ref),
                        map_aggregate(node.kwargs, ref)))
        if node.op == "get_attr":
            value = get_attr_value(gm, str(node.target))
            attrs[node.target] = (_records(value) if isinstance(value, torch.fx.GraphModule)
                                  else value)
        elif node.op == "call_module":
            # portable_inputs() keeps such graphs here; this guards any other caller
            raise ValueError(submodule_reason(gm))
    return _Subgraph(records, attrs)


def submodule_reason(gm: torch.fx.GraphModule) -> str | None:
    """Why a graph that calls a submodule as a unit must not leave the user's process (nor be
    stored: cache keys cover the tensors a graph reads, not a submodule's weights)."""
    node = next(iter(gm.graph.find_nodes(op="call_module")), None)
    if node is None:
        return None
    return f"the graph calls submodule {node.target!r} (call_module); its weights would travel by value"


# Ops whose result shares storage with their first argument: an in-place op on the result
# changes what it was taken from. (By name: call_method targets, and call_function __name__s.)
_VIEWS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "t", "transpose", "permute", "expand",
    "expand_as", "narrow", "select", "unsqueeze", "squeeze", "flatten", "unflatten", "as_strided",
    "detach", "unfold", "split", "chunk", "unbind", "movedim", "moveaxis", "swapaxes",
    "swapdims", "diagonal", "contiguous", "getitem", "__getitem__", "real", "imag"})


def mutated_attributes(gm: torch.fx.GraphModule) -> list[str]:
    """The ``get_attr`` tensors the graph changes in place (an optimizer's step holds the
    parameters it updates this way). They travel by value, so an artifact compiled elsewhere
    would update its own copies and the user's tensors would never change: such a graph must
    not be compiled in a worker."""
    mutated: list[str] = []
    for node in gm.graph.nodes:
        for target in _mutated_args(node):
            root = target
            while (isinstance(root, torch.fx.Node) and root.op != "get_attr" and root.args
                   and _name(root) in _VIEWS):
                root = root.args[0]
            if isinstance(root, torch.fx.Node) and root.op == "get_attr":
                mutated.append(str(root.target))
    return sorted(set(mutated))


def _name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        return str(getattr(node.target, "__name__", ""))
    return ""


def _mutated_args(node: torch.fx.Node) -> list[Any]:
    """The arguments ``node`` writes to: the first one of an in-place op (``add_``,
    ``_foreach_add_`` with its list, ``setitem``, ``inplace=True``), and any ``out=``."""
    name = _name(node)
    written: list[Any] = []
    if node.args and (name in ("setitem", "__setitem__") or node.kwargs.get("inplace") is True
                      or (name.endswith("_") and not name.startswith("__"))):
        first = node.args[0]
        written += list(first) if isinstance(first, (list, tuple)) else [first]
    out = node.kwargs.get("out")
    written += list(out) if isinstance(out, (list, tuple)) else [out] if out is not None else []
    return written


def _rebuild(records: list[tuple[Any, ...]]) -> torch.fx.Graph:
    graph = torch.fx.Graph()
    nodes: dict[str, torch.fx.Node] = {}

    def node_of(a: Any) -> Any:
        return nodes[a.name] if isinstance(a, _Ref) else a

    for op, name, target, args, kwargs in records:
        node = graph.create_node(op, target, map_aggregate(args, node_of),
                                 map_aggregate(kwargs, node_of), name=name)
        nodes[name] = node
    return graph


def land_graph(data: bytes, inputs: list[Any], fake_mode: Any = None) -> torch.fx.GraphModule:
    """Rebuild the graph and its node meta. ``inputs`` are real tensors, or (for a dynamic
    graph) fake ones made in ``fake_mode`` with the coordinator's symbols."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gm = _module(pickle.loads(data))
    if fake_mode is not None:
        FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*inputs)
    else:
        # Static sizes: fakified with a symbol each, a static graph hit kernels that take
        # only concrete sizes (CUDA SDPA with a mask: "SymIntArrayRef expected to contain
        # only concrete integers"). The ShapeEnv stays for data-dependent sizes.
        mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True,
                              static_shapes=True)
        FakeTensorProp(gm, mode).propagate(*inputs)
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["example_value"] = node.meta["val"]
    return gm


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def origin_of(gm: torch.fx.GraphModule) -> str:
    """Where the graph came from, for people: the user's innermost frame of its first traced
    operation, "forward (model.py:12)"; where dynamo kept no frame of the user's (a model
    made of torch's modules alone), the outermost module, "Sequential.forward"; else ""."""
    module = ""
    for node in gm.graph.nodes:
        frames = _FRAME.findall(node.meta.get("stack_trace") or "")
        if frames:
            path, line, name = frames[-1]
            return f"{name} ({os.path.basename(path)}:{line})"
        stack = node.meta.get("nn_module_stack")
        if not module and stack:
            _, cls = next(iter(stack.values()))
            module = f"{getattr(cls, '__name__', cls)}.forward"
    return module


def unship_graph(data: bytes) -> torch.fx.GraphModule:
    """The shipped graph as a module that runs it, without node meta (nothing to compile)."""
    return _module(pickle.loads(data))


def _module(shipped: _Subgraph) -> torch.fx.GraphModule:
    root = torch.nn.Module()
    for target, value in shipped.attrs.items():
        _set_attr(root, target, _module(value) if isinstance(value, _Subgraph) else value)
    return torch.fx.GraphModule(root, _rebuild(shipped.records))


def get_attr_value(gm: torch.nn.Module, target: str) -> Any:
    """What a ``get_attr`` node with a dotted ``target`` reads from ``gm``."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _set_attr(root: torch.nn.Module, target: str, value: Any) -> None:
    *path, name = target.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    if isinstance(value, torch.nn.Module):
        module.add_module(name, value)
    elif isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        module.register_buffer(name, value)
    else:
        setattr(module, name, value)
