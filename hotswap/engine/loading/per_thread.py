"""What a loaded tier's first call does in each thread that calls it, and no other thread can
do for it: cuDNN's execution plans.

PyTorch keeps cuDNN's plans in thread-local caches (convolutions, cuDNN attention: execution
plans are not guaranteed thread-safe), so a tier's first run on hotswap's thread
(first_run.py) builds them for that thread alone, and the user's first call on the tier builds
them again, in the user's thread: on the H100, GPT-2's first compiled call took 52-106 ms
(44 ms of it in its cuDNN attention calls) where its second took 2 ms, with or without a first
run on another thread; ResNet-18's 70-169 ms. Made ahead as below, ResNet-18's 28 plans took
0.1-3.1 ms each, and its first compiled call 4.5 ms.

So the first run also notes each call of an op that builds such a plan (``PLANNED``): the op,
and its tensors' sizes, strides, offsets, dtypes and devices (``PlanRecorder``). After the swap,
each calling thread makes that call itself once per call of the tier's predecessor, on empty
tensors laid out the same way (``PerThread.step``), while the predecessor still answers its
calls: one plan per user call instead of all of them in one call. A call with the same op
and layouts as an earlier one is noted once (GPT-2's six attention calls: one). A thread that
has made them all is served by the tier; so is every thread once the tier before answered
``PLANNING_CALLS_PER_PLAN`` calls per plan, all threads together (a server with a thread per
request never has one thread make them all). Threads that call the graph after that pay their
own plans in their first call, as before.

The first plan of a kind costs the most: GPT-2's first attention plan took 41-68 ms in the
caller's thread, the same call again 0.1-0.5 ms. Starting cuDNN in that thread beforehand on
tiny tensors (593 ms, in the call dynamo compiles) did not make it cheaper: the cost is the
plan's own, in one call of the tier before, and is left there.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

__all__ = ["PLANNED", "PLANNING_CALLS_PER_PLAN", "PerThread", "PlanRecorder"]

log = logging.getLogger("hotswap")

# Calls the tier before may answer while threads make the tier's plans, per plan: then the
# tier serves every thread (one that has not made them pays them in its next call).
PLANNING_CALLS_PER_PLAN = 4
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
        self.dtype, self.device = t.dtype, t.device
        # where in its storage it starts, as far as a plan reads it: the address's alignment
        # (cuDNN's keys hold up to 16 bytes of it), not a prefix to allocate (a view deep in
        # a KV cache)
        self.offset = t.storage_offset() % max(1, 16 // t.element_size())

    def key(self) -> tuple[Any, ...]:
        return (self.shape, self.stride, self.offset, self.dtype, self.device)

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
        self._seen: set[str] = set()  # one call per op and layouts: the plan is built once

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func._schema.name in PLANNED:
            try:
                self._note(func, args, kwargs)
            except Exception as e:  # a tensor without strides, ...: the run goes on
                log.debug("hotswap: a call of %s not noted: %s: %s", func, type(e).__name__, e)
        return func(*args, **kwargs)

    def _note(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        def layout(x: Any) -> Any:
            return _Layout(x) if isinstance(x, torch.Tensor) else x

        def key(x: Any) -> Any:
            return x.key() if isinstance(x, _Layout) else x

        call = (func, tree_map(layout, args), tree_map(layout, kwargs))
        seen = repr((func, tree_map(key, call[1]), tree_map(key, call[2])))
        if seen not in self._seen:
            self._seen.add(seen)
            self.calls.append(call)


class PerThread:
    """A loaded tier, and the calls its first call makes that each thread must make once
    itself (``step``). Calling it calls the tier."""

    def __init__(self, fn: Callable[..., Any], calls: list[tuple[Any, tuple[Any, ...],
                                                                 dict[str, Any]]]) -> None:
        self.fn = fn
        self.calls = calls
        self._done = threading.local()  # .next: this thread's next call to make
        # Calls the tier before answers, all threads together: a server that starts a thread
        # per request never has one thread make them all, and a pool's threads share them.
        self._left = itertools.count(PLANNING_CALLS_PER_PLAN * len(calls), -1)

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def step(self) -> bool:
        """Make this thread's next call, on empty tensors of the recorded layouts; False once
        this thread has made them all (or one failed: the rest is left to the tier's first
        call, as without them). Never raises."""
        index = getattr(self._done, "next", 0)
        if index >= len(self.calls) or next(self._left) <= 0:
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

