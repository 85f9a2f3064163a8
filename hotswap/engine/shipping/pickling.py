"""Pickling a graph's targets by reference: the worker gets the identical object, never a copy.

A graph's ``call_function`` targets are torch's, the standard library's or the user's functions.
Plain pickle stores a function as ``(module, qualified name)`` and fails when that pair does not
lead back to the object: ``torch.nn.functional.max_pool2d`` is a ``boolean_dispatch`` closure
(qualified name ``boolean_dispatch.<locals>.fn``), an operator (``torch.ops.aten.add.Tensor``,
``torch.ops.higher_order.cond``) holds unpicklable pybind state, a ``method-wrapper`` or a
``getset_descriptor`` of a C type has no module at all. ``GraphPickler`` sends each of these as
the place it can be found in the worker (a module and an attribute path, an operator's
namespace and name, a C type and a slot name); ``resolve`` there returns the object itself.

The place is looked up, not guessed: first where the object says it lives, then, for objects
found under another name (re-exports, closures installed as module attributes), by identity
among the attributes of the object's module and of torch's public namespaces. An object found
nowhere is left to plain pickle, which raises, and the graph takes another path (see
``coordinator``).
"""

from __future__ import annotations

import functools
import importlib
import io
import pickle
import sys
import types
from typing import Any

import torch

__all__ = ["GraphPickler", "dumps", "reference_of", "resolve"]

# Namespaces searched by identity for an object whose own module and name do not find it.
_NAMESPACES = ("torch", "torch.nn.functional", "torch.functional", "torch._C._nn",
               "torch._C._VariableFunctions", "torch._C._fft", "torch._C._linalg",
               "torch._C._special", "torch.fft", "torch.linalg", "torch.special", "operator",
               "builtins", "math")
_PLAIN = frozenset({int, float, str, bytes, bool, type(None), tuple, list, dict, slice})
_CALLABLES = (types.FunctionType, types.BuiltinFunctionType, types.MethodWrapperType,
              types.MethodDescriptorType, types.WrapperDescriptorType,
              types.GetSetDescriptorType, types.MemberDescriptorType,
              types.ClassMethodDescriptorType, functools.partial)


def resolve(kind: str, where: Any, path: str) -> Any:
    """The object a reference names, in this process (the inverse of ``reference_of``)."""
    if kind == "attr":
        obj: Any = importlib.import_module(where)
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj
    if kind == "op":
        packet = getattr(getattr(torch.ops, where), path.split(".")[0])
        return getattr(packet, path.split(".")[1]) if "." in path else packet
    if kind == "slot":  # a descriptor in a class's own namespace
        return vars(where)[path]
    if kind == "bound":  # a method-wrapper: a slot bound to its object
        return getattr(where, path)
    raise ValueError(f"unknown reference kind {kind!r}")


def reference_of(obj: Any) -> tuple[str, Any, str] | None:
    """Where ``obj`` can be found by another process with torch installed, as ``resolve``'s
    arguments; None when plain pickle finds it itself, or when nothing does."""
    if isinstance(obj, torch._ops.OpOverload):
        return ("op", obj.namespace, f"{obj._opname}.{obj._overloadname}")
    if isinstance(obj, torch._ops.OpOverloadPacket):
        namespace, name = obj._qualified_op_name.split("::")
        return ("op", namespace, name)
    if isinstance(obj, torch._ops.HigherOrderOperator):
        return ("op", obj.namespace, obj.name())  # type: ignore[no-untyped-call]
    if isinstance(obj, types.MethodWrapperType):
        return ("bound", obj.__self__, obj.__name__)
    if isinstance(obj, (types.GetSetDescriptorType, types.MemberDescriptorType)):
        return ("slot", obj.__objclass__, obj.__name__)
    if _found_by_pickle(obj):
        return None
    module, own_name = getattr(obj, "__module__", None), getattr(obj, "__name__", None)
    if isinstance(module, str) and isinstance(own_name, str) and _attr(module, own_name) is obj:
        return ("attr", module, own_name)
    found = _index(module).get(id(obj)) if isinstance(module, str) else None
    for namespace in _NAMESPACES:
        if found is not None:
            break
        found = _index(namespace).get(id(obj))
    if found is not None:
        return ("attr", *found)
    # A method defined in Python on a class other than the one its qualified name says
    # (``torch.Tensor.pow`` is ``TensorBase.pow`` of ``torch._tensor``).
    slot = next((k for k, v in vars(torch.Tensor).items() if v is obj), None)
    return ("slot", torch.Tensor, slot) if slot is not None else None


def _found_by_pickle(obj: Any) -> bool:
    """Whether pickle's own lookup (``__module__`` + ``__qualname__``) returns ``obj``."""
    if isinstance(obj, functools.partial) or not hasattr(obj, "__qualname__"):
        return isinstance(obj, functools.partial)  # a partial pickles its parts
    module = getattr(obj, "__module__", None)
    if module is None and getattr(obj, "__self__", None) is not None:
        return True  # a C method of a type (``torch.conv2d``): reduced through its __self__
    if not isinstance(module, str):
        return False
    return _attr(module, obj.__qualname__) is obj


def _attr(module: str, path: str) -> Any:
    if "<locals>" in path:
        return None
    try:
        return resolve("attr", module, path)
    except (ImportError, AttributeError, ValueError):
        return None


def _index(module: str) -> dict[int, tuple[str, str]]:
    """id -> (module, name) for the callables a loaded module holds (imports nothing new)."""
    mod = sys.modules.get(module)
    return {} if mod is None else _index_of(mod)


@functools.cache
def _index_of(mod: types.ModuleType) -> dict[int, tuple[str, str]]:
    module = mod.__name__
    index: dict[int, tuple[str, str]] = {}
    for name, value in list(vars(mod).items()):
        if callable(value) and not isinstance(value, type):
            index.setdefault(id(value), (module, name))
    return index


class GraphPickler(pickle.Pickler):
    """A pickler that sends functions and operators by reference where plain pickle cannot."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) in _PLAIN or isinstance(obj, torch.Tensor):
            return NotImplemented
        if isinstance(obj, (*_CALLABLES, torch._ops.OperatorBase, torch._ops.OpOverloadPacket)):
            ref = reference_of(obj)
            if ref is not None:
                return resolve, ref
        return NotImplemented


def dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    GraphPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()
