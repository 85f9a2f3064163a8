"""Graph targets travel by reference and resolve to the identical object in a fresh process."""

from __future__ import annotations

import builtins
import functools
import math
import operator
import pickle
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hotswap.engine.shipping import pickling


# A function reachable under a name that is not its own: plain pickle follows __qualname__
# (``_original``) and finds the wrapper, not this object.
def _original(x: torch.Tensor) -> torch.Tensor:
    return x


reexported = functools.wraps(_original)(lambda x: _original(x))

TARGETS: dict[str, Any] = {
    "boolean_dispatch": F.max_pool2d,               # qualname boolean_dispatch.<locals>.fn
    "boolean_dispatch_1d": F.max_pool1d,
    "reexport": reexported,
    "builtin": builtins.getattr,
    "c_type_method": torch.Tensor.add,             # method_descriptor of TensorBase
    "c_type_slot": torch.Tensor.__getitem__,        # wrapper_descriptor
    "c_type_getset": vars(torch._C.TensorBase)["shape"],
    "python_tensor_method": torch.Tensor.pow,       # defined as TensorBase.pow in torch._tensor
    "torch_c_nn": torch._C._nn.gelu,
    "variable_functions": torch.conv2d,
    "operator": operator.iadd,
    "math": math.sqrt,
    "op_overload": torch.ops.aten.add.Tensor,
    "op_packet": torch.ops.aten.add,
    "higher_order": torch.ops.higher_order.cond,
    "checkpoint_hop": torch.ops.higher_order.tag_activation_checkpoint,
}


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_target_resolves_to_the_identical_object(name: str) -> None:
    target = TARGETS[name]
    assert pickle.loads(pickling.dumps(target)) is target


def test_plain_pickle_cannot_send_the_hard_ones() -> None:
    """What the reference pickler is for (if torch ever fixes these, this says so)."""
    for name in ("boolean_dispatch", "op_overload", "higher_order", "reexport"):
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError, RuntimeError)):
            assert pickle.loads(pickle.dumps(TARGETS[name])) is TARGETS[name]


def test_every_public_torch_callable_round_trips() -> None:
    """Every callable of the namespaces graphs call into comes back as itself."""
    failed = []
    for namespace in (torch, F, torch.Tensor, torch._C._nn, torch.linalg, torch.fft, operator):
        for key in dir(namespace):
            try:
                value = getattr(namespace, key)
            except Exception:
                continue
            if not callable(value) or isinstance(value, type):
                continue
            try:
                back = pickle.loads(pickling.dumps(value))
            except Exception as e:
                failed.append(f"{key}: {e}")
                continue
            if back is not value and back != value:
                failed.append(f"{key}: not the same object")
    assert not failed, failed[:10]


def test_references_resolve_in_another_process() -> None:
    """The worker's side: a fresh interpreter that imported nothing but torch."""
    names = ["boolean_dispatch", "python_tensor_method", "op_overload", "higher_order",
             "c_type_getset"]
    payload = pickling.dumps([TARGETS[n] for n in names])
    code = ("import pickle, sys, torch, torch.nn.functional as F\n"
            "objs = pickle.loads(sys.stdin.buffer.read())\n"
            "want = [F.max_pool2d, torch.Tensor.pow, torch.ops.aten.add.Tensor, "
            "torch.ops.higher_order.cond, vars(torch._C.TensorBase)['shape']]\n"
            "print(all(a is b for a, b in zip(objs, want, strict=True)))\n")
    out = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True,
                         check=True, timeout=120)
    assert out.stdout.decode().strip() == "True", out.stderr.decode()[-2000:]


def test_a_local_function_is_refused_by_pickle() -> None:
    def local(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickling.dumps(local)
