"""What a loaded tier's first call does in each thread that calls it, and no other thread can
do for it: cuDNN's execution plans.

PyTorch keeps cuDNN's plans in thread-local caches (convolutions, cuDNN attention: execution
plans are not guaranteed thread-safe), so a tier's first run on hotswap's thread
(first_run.py) builds them for that thread alone, and the user's first call on the tier builds
them again, in the user's thread: on the H100, GPT-2's first compiled call took 52-106 ms
(six cuDNN attention calls, about 7 ms each, 44 ms of it) where its second took 2 ms, with or
without a first run on another thread; ResNet-18's 70 ms.

So the first run also notes each call of an op that builds such a plan (``PLANNED``): the op,
and its tensors' sizes, strides, offsets, dtypes and devices (``PlanRecorder``). After the swap,
each calling thread makes that call itself once per call of the tier's predecessor, on empty
tensors laid out the same way (``PerThread.step``), while the predecessor still answers its
calls: one plan per user call (a few milliseconds each) instead of all of them in one call.
A thread that has made them all is served by the tier. Threads that first call the graph
after the first thread finished pay their own plans in their first call, as before.

The first cuDNN call in a thread also starts cuDNN there (its handle, its libraries' state):
GPT-2's first attention call took 55 ms where the five after it took 0.1-0.4 ms. That part
needs no plan of the tier's, so it happens when a CUDA graph with convolutions or attention
arrives, in the caller's thread, within the call dynamo is compiling (seconds long already),
on tiny tensors (``prime_cudnn``), once per thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

__all__ = ["PLANNED", "PerThread", "PlanRecorder", "prime_cudnn"]

log = logging.getLogger("hotswap")

_primed = threading.local()  # .done: this thread started cuDNN
# Calls of a dynamo graph that run cuDNN on CUDA tensors (by the callee's name).
_CONVOLUTIONS = ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                 "conv_transpose3d", "convolution")
_ATTENTION = ("scaled_dot_product_attention",)
# Ops whose CUDA kernels build a cuDNN execution plan cached per thread.
PLANNED = frozenset({
    "aten::convolution", "aten::_convolution", "aten::cudnn_convolution",
    "aten::cudnn_convolution_transpose", "aten::_scaled_dot_product_cudnn_attention",
})


class _Layout:
    """A tensor argument, as its layout alone (its values do not choose a plan)."""

    __slots__ = ("device", "dtype", "offset", "shape", "stride")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.stride = tuple(t.shape), tuple(t.stride())
        self.offset, self.dtype, self.device = t.storage_offset(), t.dtype, t.device

    def empty(self) -> torch.Tensor:
        span = sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True)) + 1
        base = torch.empty(self.offset + (span if all(self.shape) else 0), dtype=self.dtype,
                           device=self.device)
        return base.as_strided(self.shape, self.stride, self.offset)


class PlanRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """While active (on one thread), notes each call of a ``PLANNED`` op with the layouts of
    its tensors; ``calls`` holds what ``PerThread`` replays."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func._schema.name in PLANNED:
            def layout(x: Any) -> Any:
                return _Layout(x) if isinstance(x, torch.Tensor) else x

            self.calls.append((func, tree_map(layout, args), tree_map(layout, kwargs)))
        return func(*args, **kwargs)


class PerThread:
    """A loaded tier, and the calls its first call makes that each thread must make once
    itself (``step``). Calling it calls the tier."""

    def __init__(self, fn: Callable[..., Any], calls: list[tuple[Any, tuple[Any, ...],
                                                                 dict[str, Any]]]) -> None:
        self.fn = fn
        self.calls = calls
        self._done = threading.local()  # .next: this thread's next call to make

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def step(self) -> bool:
        """Make this thread's next call, on empty tensors of the recorded layouts; False once
        this thread has made them all (or one failed: the rest is left to the tier's first
        call, as without them). Never raises."""
        index = getattr(self._done, "next", 0)
        if index >= len(self.calls):
            return False
        self._done.next = index + 1
        func, args, kwargs = self.calls[index]

        def fill(x: Any) -> Any:
            return x.empty() if isinstance(x, _Layout) else x

        try:
            with torch.no_grad():
                func(*tree_map(fill, args), **tree_map(fill, kwargs))
        except Exception as e:
            self._done.next = len(self.calls)
            log.debug("hotswap: a thread's plan for %s not made ahead: %s: %s", func,
                      type(e).__name__, e)
        return True


def prime_cudnn(gm: torch.fx.GraphModule, example_inputs: Any) -> None:
    """Start cuDNN in this thread (a tiny convolution, a tiny cuDNN attention) where ``gm``
    runs convolutions or attention on CUDA tensors; once per thread, and never raises."""
    if getattr(_primed, "done", False):
        return
    cuda = [x for x in example_inputs if isinstance(x, torch.Tensor) and x.is_cuda]
    if not cuda:
        return
    names = {str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes
             if n.op in ("call_function", "call_method", "call_module")}
    convolution = any(n in names for n in _CONVOLUTIONS) or any(
        isinstance(m, torch.nn.modules.conv._ConvNd) for m in gm.modules())
    attention = any(n in names for n in _ATTENTION)
    if not (convolution or attention) or not torch.backends.cudnn.is_available():  # type: ignore[no-untyped-call]
        return
    _primed.done = True
    device = cuda[0].device
    half = next((x.dtype for x in cuda if x.dtype in (torch.float16, torch.bfloat16)),
                torch.bfloat16)
    try:
        with torch.no_grad():
            if convolution and torch.backends.cudnn.enabled:
                x = torch.zeros(1, 8, 4, 4, device=device, dtype=half)
                torch.nn.functional.conv2d(x, torch.zeros(8, 8, 1, 1, device=device, dtype=half))
            cudnn_attention = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention",
                                      None)
            if attention and cudnn_attention is not None and \
                    torch.backends.cuda.cudnn_sdp_enabled():  # type: ignore[no-untyped-call]
                q = torch.zeros(1, 1, 8, 64, device=device, dtype=half)
                cudnn_attention(q, q, q, None, False)
    except Exception as e:
        log.debug("hotswap: cuDNN not started ahead in this thread: %s: %s",
                  type(e).__name__, e)
