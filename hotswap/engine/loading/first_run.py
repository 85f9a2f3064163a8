"""A loaded GPU artifact's first run, on hotswap's thread, before it serves.

An artifact's first call does work its later ones do not: CUDA loads each kernel's module at
its first launch (lazy loading), inductor's runtime sets up each kernel's launcher, and the
caching allocator grows to the graph's working set: 50-80 ms for GPT-2's default tier on the
H200, against 1-3 ms for a later call. Done in the user's first call after the swap, that
was a stall of its own; so a tier loaded for a CUDA graph first runs once here, on the
scheduler's thread, on copies of the graph's example inputs (``FirstRun``), and only then
swaps in.

What is copied and what is not: a tensor input that is a parameter is used as it is (it is
the model's, alive as long as the model is, and a copy of every weight would double the
model's memory); every other tensor input is cloned (its strides kept) when the graph is
first seen, so the run reads what the user's first call passed without holding the user's
tensors. Nothing runs where that is not safe:

- a graph that may update one of its inputs in place (a method or function whose name ends
  in ``_``, an item assignment, an augmented operator, ``out=`` or ``inplace=True``, on an
  input or on anything that may be a view of one): its run would write to a parameter. An
  update of a tensor the graph made itself is fine (``hidden += residual`` after a
  convolution, as ResNet's blocks do): a tensor is the graph's own where an op that always
  returns new memory (``_FRESH``) made it, or an in-place update of one;
- a graph that draws random numbers (``rand*``, ``bernoulli``, ``multinomial``, dropout in
  training, ...): its run would draw from the device's generator, which the user's thread
  shares, and shift the user's random stream;
- a graph with an input that is not a parameter and needs grad, or with grad enabled and a
  parameter that needs grad: the run would build an autograd graph nobody uses. (With grad
  enabled and nothing needing grad, as a model served without ``torch.no_grad()`` calls it,
  the user's calls build none either, and the graph gets its run: without it, GPT-2's first
  compiled call in the user's thread took 50-115 ms on the H100, its cuDNN attention plan and
  kernel loads among them, against 1.4-3 ms after);
- inputs on the CPU only (no lazy kernel loading there, and a run competes with the caller's
  calls for the cores), or non-parameter inputs over ``MAX_COPY_BYTES``;
- a CUDA-graph tier (``CudaGraphed``): its capture must happen in the serving thread.

The run goes on the stream the user's thread had current when the graph was first seen (the
copies were made on it, so they are ready in stream order), and waits for an event recorded
after the run, not for the device. Not a stream of its own: the caching allocator hands a
freed block only to allocations on the stream that allocated it, so a run on a side stream
left the user's stream to grow its own blocks in the user's first compiled call (53-94 ms for
GPT-2's default tier on the H100, its cudaMalloc calls among them). The copies go when the
graph is final (``GraphJourney``); all graphs' copies together stay under ``MAX_COPY_BYTES``
(a graph past it gets none). A run that fails is logged and the tier swaps in as it would
have; its first user call then pays what the run would have. A CUDA graph the user captures in
another thread with the global capture mode (``torch.cuda.graph``'s default) while a tier
loads may see the load's CUDA calls refused; capture with
``capture_error_mode="thread_local"`` where tiers may load.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["LAZY_DEVICES", "MAX_COPY_BYTES", "FirstRun"]

log = logging.getLogger("hotswap")

# The most every graph's copied inputs together may take (bytes, all devices).
MAX_COPY_BYTES = 256 * 2**20
_held_lock = threading.Lock()
_held_bytes = 0  # what the live FirstRun objects' copies take
# Torch-level calls that draw random numbers (dropout only in training: checked apart).
_RANDOM = ("rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
           "bernoulli", "multinomial", "normal", "poisson", "uniform", "exponential",
           "geometric", "cauchy", "log_normal", "rrelu", "native_dropout")
_DROPOUTS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
             "feature_alpha_dropout")
_IN_PLACE = frozenset({operator.setitem, operator.iadd, operator.isub, operator.imul,
                       operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
                       operator.iand, operator.ior, operator.ixor, operator.ilshift,
                       operator.irshift, operator.imatmul})
# Ops that return new memory, never a view of an argument (an in-place update of what they
# return touches no input). Ops that may return an argument itself (dropout with p=0 or not
# training, ``contiguous``, ``to``, ``reshape``) or a view of one are not here.
_FRESH = frozenset({
    "add", "sub", "mul", "truediv", "floordiv", "div", "matmul", "mm", "bmm", "baddbmm",
    "addmm", "linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm",
    "relu", "relu6", "leaky_relu", "gelu", "silu", "mish", "elu", "selu", "celu", "hardswish",
    "hardsigmoid", "hardtanh", "softplus", "tanh", "sigmoid", "softmax", "log_softmax", "exp",
    "log", "sqrt", "rsqrt", "pow", "neg", "abs", "erf", "sin", "cos", "clamp", "where",
    "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_max_pool2d", "cat", "stack", "sum",
    "mean", "amax", "amin", "cumsum", "scaled_dot_product_attention", "embedding", "clone",
})
# Device kinds whose first run pays work later runs do not (a graph on none of them is not run).
LAZY_DEVICES = ("cuda",)


class FirstRun:
    """Copies of a graph's example inputs, to run each of its loaded tiers once before it
    serves. ``capture`` returns None where a run would not be safe or worth it."""

    def __init__(self, inputs: tuple[Any, ...], devices: tuple[torch.device, ...],
                 size: int = 0) -> None:
        self._inputs = inputs
        self._size = size
        cuda = [d for d in devices if d.type == "cuda"]  # others: the CPU, in tests
        # The user's stream: the copies were made on it, and the user's calls allocate on it.
        self._stream = torch.cuda.current_stream(cuda[0]) if cuda else None

    def __del__(self) -> None:
        global _held_bytes
        with _held_lock:
            _held_bytes -= getattr(self, "_size", 0)

    @classmethod
    def capture(cls, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> FirstRun | None:
        """Copies for a graph's first runs, or None (no run: not safe, not worth it, or an
        error meanwhile: it is never the user's call's)."""
        try:
            return cls._capture(gm, example_inputs)
        except Exception as e:
            log.debug("hotswap: no first run before serving: %s: %s", type(e).__name__, e)
            return None

    @classmethod
    def _capture(cls, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
                 ) -> FirstRun | None:
        global _held_bytes
        if _updates_in_place(gm) or _draws_random(gm):
            return None
        grad = torch.is_grad_enabled()
        copied: list[Any] = []
        devices: set[torch.device] = set()
        size = 0
        for x in example_inputs:
            if isinstance(x, torch.Tensor):
                if x.requires_grad and (grad or not isinstance(x, torch.nn.Parameter)):
                    return None
                if _is_fake(x):
                    return None
                if x.device.type in LAZY_DEVICES:
                    devices.add(x.device)
                if isinstance(x, torch.nn.Parameter):
                    copied.append(x)
                    continue
                size += x.untyped_storage().nbytes()
                if _held_bytes + size > MAX_COPY_BYTES:  # before copying, not after
                    return None
                copied.append(x.detach().clone())
            elif isinstance(x, bool | int | float):
                copied.append(x)
            else:  # a symbolic size, an opaque object: not something to replay
                return None
        if not devices:
            return None
        with _held_lock:
            if _held_bytes + size > MAX_COPY_BYTES:
                return None
            _held_bytes += size
        return cls(tuple(copied), tuple(sorted(devices, key=str)), size)

    def run(self, fn: Any, recorder: contextlib.AbstractContextManager[Any] | None = None
            ) -> float:
        """Call ``fn`` once on the copies, on the user's CUDA stream, and wait for the run
        alone (an event after it); the seconds it took. ``recorder``: a context (a
        ``per_thread.PlanRecorder``) the call runs in."""
        start = time.monotonic()
        done = None
        with contextlib.ExitStack() as scope:
            scope.enter_context(torch.no_grad())
            if recorder is not None:
                scope.enter_context(recorder)
            if self._stream is not None:
                scope.enter_context(torch.cuda.stream(self._stream))
                if torch.cuda.is_current_stream_capturing():  # the user's capture: not ours
                    raise RuntimeError("the user's stream is capturing a CUDA graph")
            fn(*self._inputs)
            if self._stream is not None:
                if torch.cuda.is_current_stream_capturing():  # began during the run
                    log.warning("hotswap: a tier's first run went on a stream the user began "
                                "to capture meanwhile: capture on a stream of your own "
                                "(torch.cuda.graph's default) where tiers may load")
                done = self._stream.record_event()
        if done is not None:
            done.synchronize()
        return time.monotonic() - start


def _calls(gm: torch.fx.GraphModule) -> Iterator[tuple[Any, str]]:
    """(node, the name of what it calls) of every call in the graph."""
    for node in gm.graph.nodes:
        if node.op in ("call_method", "call_function"):
            name = node.target if isinstance(node.target, str) else getattr(
                node.target, "__name__", "")
            yield node, str(name)


def _updates_in_place(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph may update an input in place: an in-place method or function
    (``add_``, ``copy_``), an item assignment or augmented operator, ``out=`` or
    ``inplace=True``, on a tensor that is not certainly the graph's own (``_FRESH``)."""
    own: set[torch.fx.Node] = set()  # tensors the graph made: no input's memory
    for node, name in _calls(gm):
        in_place = (name.endswith("_") and not name.endswith("__")) or \
            node.target in _IN_PLACE or name in ("__setitem__", "setitem") or \
            name.startswith("__i") or node.kwargs.get("inplace") is True
        out = node.kwargs.get("out")
        updated = [*(node.args[:1] if in_place else ()), *([] if out is None else [out])]
        targets: list[Any] = []
        for target in updated:  # a list of tensors too (``_foreach_add_``, fused optimizers)
            targets += target if isinstance(target, list | tuple) else [target]
        if any(not isinstance(t, torch.fx.Node) or t not in own for t in targets):
            return True
        if targets or (name in _FRESH and not in_place and out is None):
            own.add(node)  # an update of the graph's own tensor returns it
    return False


def _draws_random(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph draws random numbers (dropout: unless its ``training`` is False)."""
    for node, name in _calls(gm):
        if name in _RANDOM:
            return True
        if name in _DROPOUTS:
            training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
            if training is not False:
                return True
    return False


def _is_fake(x: torch.Tensor) -> bool:
    """A tensor without real storage (fake, meta): nothing to run on."""
    return x.device.type == "meta" or type(x).__name__ == "FakeTensor"
