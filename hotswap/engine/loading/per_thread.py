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
plan's own. In a process that loads the tier from the cache, the plans are known before the
call dynamo compiles ends: the process that first ran the tier stored its calls beside the
entry (``pack_calls``, a signed cache entry of their own), and that call makes them in the
caller's thread (``make_calls``), where a second or more of tracing is already paid, instead
of in one of the calls that follow. A process that compiles the tier pays them in one call of
the tier before, as above.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import msgpack
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["MAX_PLANNED_BYTES", "PLANNED", "PLANNED_DEVICES", "PLANNING_CALLS_PER_PLAN",
           "PerThread", "PlanRecorder", "make_calls", "pack_calls", "planned_on", "unpack_calls"]

log = logging.getLogger("hotswap")

# Calls the tier before may answer while threads make the tier's plans, per plan: then the
# tier serves every thread (one that has not made them pays them in its next call).
PLANNING_CALLS_PER_PLAN = 4
# Ops whose CUDA kernels build a cuDNN execution plan cached per thread.
PLANNED = frozenset({
    "aten::convolution", "aten::_convolution", "aten::cudnn_convolution",
    "aten::cudnn_convolution_transpose", "aten::_scaled_dot_product_cudnn_attention",
})
# The device kinds whose calls are stored and made ahead (the tests add the CPU's, to see the
# path without a GPU).
PLANNED_DEVICES = ("cuda",)
# The most a stored call's empty tensors may take, all together (``unpack_calls``).
MAX_PLANNED_BYTES = 1 << 30
_FORMAT = 1
Call = tuple[Any, tuple[Any, ...], dict[str, Any]]


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

    @classmethod
    def of(cls, shape: tuple[int, ...], stride: tuple[int, ...], offset: int,
           dtype: torch.dtype, device: torch.device) -> _Layout:
        layout = cls.__new__(cls)
        layout.shape, layout.stride, layout.offset = shape, stride, offset
        layout.dtype, layout.device = dtype, device
        return layout

    def key(self) -> tuple[Any, ...]:
        return (self.shape, self.stride, self.offset, self.dtype, self.device)

    def nbytes(self) -> int:
        return (int(self.offset) + self._span()) * self.dtype.itemsize

    def _span(self) -> int:
        if not all(self.shape):
            return 0
        return int(sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))) + 1

    def empty(self) -> torch.Tensor:
        base = torch.empty(self.offset + self._span(), dtype=self.dtype, device=self.device)
        return base.as_strided(self.shape, self.stride, self.offset)


class PlanRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """While active (on one thread), notes each call of a ``PLANNED`` op with the layouts of
    its tensors; ``calls`` holds what ``PerThread`` replays."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calls: list[Call] = []
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

    def __init__(self, fn: Callable[..., Any], calls: list[Call]) -> None:
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
        if not _make(self.calls[index]):
            self._done.next = len(self.calls)
        return True


def _make(call: Call) -> bool:
    """Make ``call`` on this thread, on empty tensors of its layouts; False if it failed."""
    func, args, kwargs = call

    def fill(x: Any) -> Any:
        return x.empty() if isinstance(x, _Layout) else x

    try:
        with torch.no_grad():
            func(*tree_map(fill, args), **tree_map(fill, kwargs))
    except Exception as e:
        log.debug("hotswap: a thread's plan for %s not made ahead: %s: %s", func,
                  type(e).__name__, e)
        return False
    return True


def make_calls(calls: Iterable[Call]) -> int:
    """Make each call on this thread (the plans it builds are this thread's), on empty
    tensors, without autocast (the stored dtypes are the plans'); how many were made. Never
    raises."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with contextlib.ExitStack() as scope:
        scope.enter_context(unset_fake_temporarily())  # real tensors, whatever a tracer left on
        scope.enter_context(torch.autocast("cpu", enabled=False))
        if torch.cuda.is_available():
            scope.enter_context(torch.autocast("cuda", enabled=False))
        return sum(_make(call) for call in calls)


class _Unpackable(Exception):
    """A call's argument the stored form has no place for."""


def planned_on(devices: Iterable[str]) -> bool:
    """Whether a graph on ``devices`` ("cuda:0", ...) may have calls stored and made ahead."""
    return any(d.split(":")[0] in PLANNED_DEVICES for d in devices)


def pack_calls(calls: Iterable[Call]) -> bytes | None:
    """The calls (``PlanRecorder.calls``) whose tensors are all on devices of the
    ``PLANNED_DEVICES`` kinds, as a cache entry keeps them (msgpack of names, layouts and
    plain values); None where no call is left."""
    kinds = set(PLANNED_DEVICES)

    def pack(x: Any) -> Any:
        if isinstance(x, _Layout):
            if x.device.type not in kinds:
                raise _Unpackable(x.device)
            return {"t": [list(x.shape), list(x.stride), x.offset, _dtype_name(x.dtype),
                          str(x.device)]}
        if isinstance(x, torch.dtype):
            return {"d": _dtype_name(x)}
        if isinstance(x, list | tuple):
            return [pack(v) for v in x]
        if x is None or isinstance(x, bool | int | float | str):
            return x
        raise _Unpackable(type(x).__name__)

    packed = []
    for func, args, kwargs in calls:
        if not any(isinstance(x, _Layout) for x in (*args, *kwargs.values())):
            continue
        try:
            packed.append([str(func), pack(list(args)), {k: pack(v) for k, v in kwargs.items()}])
        except _Unpackable:
            continue
    if not packed:
        return None
    return bytes(msgpack.packb({"format": _FORMAT, "calls": packed}, use_bin_type=True))


def unpack_calls(entries: Iterable[bytes | bytearray | memoryview]) -> list[Call]:
    """The calls of entries ``pack_calls`` made, each once (two tiers may store one call),
    each the default overload of a ``PLANNED`` op of this torch, each tensor on a device of
    the ``PLANNED_DEVICES`` kinds that this process has. A call that is not, or whose tensors
    (its outputs too, as its meta kernel says) would take more than ``MAX_PLANNED_BYTES``, is
    left out. Never raises: an entry of no known form gives no calls."""
    kinds = set(PLANNED_DEVICES)
    calls: list[Call] = []
    seen: set[str] = set()
    for data in entries:
        try:
            stored = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
            rows = stored.get("calls") if isinstance(stored, dict) and \
                stored.get("format") == _FORMAT else None
            if not isinstance(rows, list):
                raise ValueError("not an entry of stored calls")
        except Exception as e:
            log.debug("hotswap: stored plans not read: %s: %s", type(e).__name__, e)
            continue
        for row in rows:
            try:
                call = _unpack_call(row, kinds)
                key = _key(call)
                if key in seen:
                    continue
                if _bytes(call) > MAX_PLANNED_BYTES:
                    raise ValueError(f"over {MAX_PLANNED_BYTES} bytes of tensors")
            except Exception as e:  # of another torch, a device this process lacks, ...
                log.debug("hotswap: a stored plan left out: %s: %s", type(e).__name__, e)
                continue
            seen.add(key)
            calls.append(call)
    return calls


def _key(call: Call) -> str:
    func, args, kwargs = call

    def key(x: Any) -> Any:
        return x.key() if isinstance(x, _Layout) else x

    return repr((str(func), tree_map(key, args), tree_map(key, kwargs)))


def _bytes(call: Call) -> int:
    """What ``call`` allocates: its tensors' storage, and its outputs' as its meta kernel
    computes them (ValueError where it has none)."""
    func, args, kwargs = call
    layouts = [x for x in tree_leaves((args, kwargs)) if isinstance(x, _Layout)]

    def meta(x: Any) -> Any:
        if not isinstance(x, _Layout):
            return x
        return torch.empty_strided(x.shape, x.stride, dtype=x.dtype, device="meta")

    try:
        with torch.no_grad():
            out = func(*tree_map(meta, args), **tree_map(meta, kwargs))
    except Exception as e:
        raise ValueError(f"no meta kernel to size it: {type(e).__name__}") from e
    outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    return sum(x.nbytes() for x in layouts) + sum(t.numel() * t.element_size() for t in outputs)


def _unpack_call(row: Any, kinds: set[str]) -> Call:
    name, args, kwargs = row
    namespace, op, overload = str(name).split(".")
    if overload != "default":
        raise ValueError(f"{name}: only default overloads are made")
    func = getattr(getattr(getattr(torch.ops, namespace), op), overload)
    if func._schema.name not in PLANNED:
        raise ValueError(f"{name} builds no plan")
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise ValueError("not a stored call")

    def unpack(x: Any) -> Any:
        if isinstance(x, dict):
            if "t" in x:
                shape, stride, offset, dtype, device = x["t"]
                where = torch.device(device)
                if where.type not in kinds or not _has(where):
                    raise ValueError(f"no device {where}")
                sizes = tuple(int(n) for n in shape)
                steps = tuple(int(n) for n in stride)
                if len(sizes) != len(steps) or min((*sizes, *steps, int(offset)), default=0) < 0:
                    raise ValueError("not a layout")
                return _Layout.of(sizes, steps, int(offset), _dtype(dtype), where)
            if "d" in x:
                return _dtype(x["d"])
            raise ValueError("not a stored value")
        if isinstance(x, list):
            return [unpack(v) for v in x]
        if x is None or isinstance(x, bool | int | float | str):
            return x
        raise ValueError(f"not a stored value: {type(x).__name__}")

    return func, tuple(unpack(x) for x in args), {str(k): unpack(v) for k, v in kwargs.items()}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"no dtype {name!r}")
    return dtype


def _has(device: torch.device) -> bool:
    if device.type == "cpu":
        return True
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return device.index is None or device.index < torch.cuda.device_count()

