"""Describing a graph's inputs to a worker: metadata only, dynamic dims by symbol."""

from __future__ import annotations

from typing import Any

import torch

from hotswap.engine.shipping.wire import InputMeta

__all__ = ["ALIGNMENT", "describe_inputs"]

# torch._inductor.utils.ALIGNMENT, the bytes inductor's GPU code assumes an input aligned to;
# not imported from there: this runs in the serving process, which does not import inductor.
ALIGNMENT = 16


def describe_inputs(gm: torch.fx.GraphModule,
                     example_inputs: list[Any]) -> tuple[InputMeta, ...] | str:
    """Input metadata for the worker (never values), or the reason the graph cannot travel.

    Dynamic dims are named by their symbol, so inputs that share a size share it in the worker.
    """
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(example_inputs):
        return "the graph's inputs do not match the example inputs dynamo passed"
    metas: list[InputMeta] = []
    for node, real in zip(placeholders, example_inputs, strict=True):
        value = node.meta.get("example_value", real)
        if isinstance(value, torch.SymInt):
            hint = real if isinstance(real, int) else getattr(real, "node", value.node).hint
            if not _is_symbol(value) or hint is None:
                return f"graph input {node.name} is a size expression hotswap cannot describe"
            metas.append(InputMeta((), (), "int64", "cpu", False, (), str(value.node.expr),
                                   int(hint)))
            continue
        if real is None or type(real) in (bool, int, float):  # specialized: sent by value
            metas.append(InputMeta((), (), "constant", "", False, value=real))
            continue
        if not isinstance(real, torch.Tensor) or not isinstance(value, torch.Tensor):
            return f"graph input {node.name} of type {type(real).__name__} cannot travel"
        if real.is_sparse or real.layout != torch.strided or type(real) not in (
                torch.Tensor, torch.nn.Parameter):
            return f"graph input {type(real).__name__} with layout {real.layout} cannot travel"
        sizes: list[str | None] = []
        dims: tuple[Any, ...] = tuple(value.shape)  # SymInts where dynamic (typed as ints)
        for dim in dims:
            if isinstance(dim, int) or dim.node.expr.is_number:  # static, or specialized
                sizes.append(None)
            elif _is_symbol(dim):
                sizes.append(str(dim.node.expr))
            else:
                return (f"graph input {node.name} has a size expression ({dim}) hotswap "
                        "cannot describe")
        strides = _strides(value, sizes) if any(sizes) and not real.is_contiguous() else ()
        if isinstance(strides, str):
            return f"graph input {node.name} has a stride expression ({strides}) hotswap cannot describe"
        metas.append(InputMeta(tuple(real.shape), tuple(real.stride()),
                               str(real.dtype).removeprefix("torch."), str(real.device),
                               bool(real.requires_grad), tuple(sizes) if any(sizes) else (),
                               strides=strides, static=_static(node, real)))
    return tuple(metas)


def _static(node: torch.fx.Node, real: torch.Tensor) -> bool:
    """Whether dynamo marked the input static (its parameters and buffers) and it is aligned
    as inductor's code for a static input assumes without checking (``tensor_is_aligned``)."""
    marked = node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
    return bool(marked) and real.data_ptr() % ALIGNMENT == 0


def _strides(value: torch.Tensor, sizes: list[str | None]) -> tuple[str | None, ...] | str:
    """The symbolic strides of a dynamic view (``ids[:, :n]``): each by its expression, or
    None where static; or the first expression whose symbols the sizes and bare stride
    symbols do not name."""
    stride: tuple[Any, ...] = tuple(value.stride())  # SymInts where dynamic (typed as ints)
    exprs = [None if isinstance(st, int) or st.node.expr.is_number else st.node.expr
             for st in stride]
    known = {n for n in sizes if n} | {str(e) for e in exprs if e is not None and e.is_Symbol}
    for expr in exprs:
        if expr is not None and not {str(x) for x in expr.free_symbols} <= known:
            return str(expr)
    return tuple(None if e is None else str(e) for e in exprs) if any(
        e is not None for e in exprs) else ()


def _is_symbol(value: torch.SymInt) -> bool:
    return bool(getattr(value.node.expr, "is_Symbol", False))
