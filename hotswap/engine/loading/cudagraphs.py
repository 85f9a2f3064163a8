"""CUDA graphs for a loaded tier, captured in the serving process after the swap.

torch.compile's ``mode="reduce-overhead"`` wraps inductor's output in CUDA graphs when it
compiles. An artifact hotswap loads comes from another process, and inductor loads such
artifacts with CUDA graphs off (``CompiledArtifact.load``). So a tier marked ``cudagraphs``
(the ``reduce-overhead`` preset) is wrapped here instead, in the process that serves it:

    call 1 on the tier   runs the artifact as it is (its lazy initialization, autotuning
                         caches), and notes each argument's address
    call 2               arguments whose address did not change (parameters, buffers: dynamo
                         passes them each call) are used in place; the others get a buffer of
                         their own. One run on a side stream, then the capture, on the caller's
                         thread (``thread_local`` capture: other threads may use the device
                         meanwhile). 1.3 ms (MLP) to 3.4 ms (GPT-2) on the H200.
    later calls          copy the arguments that moved into their buffers, replay, and return
                         the outputs (below)

A replay overwrites the outputs of the one before. torch's CUDA graph trees hand out the
graph's own memory and make an output that a later replay overwrote raise when read; hotswap
never overwrites what the caller still holds, and copies nothing where it can:

    copying              the first replays return copies of the outputs (one device-to-device
                         copy each, 0.021 ms for GPT-2's 33.5 MB of logits on the H100)
    lending              once the copies a call returned are gone by the call after next (the
                         caller keeps at most the last output, as ``out = model(x)`` in a loop
                         does), replays return the graph's own outputs, and a second graph, in
                         a memory pool of its own, is captured the first time the caller still
                         holds the first's: the two take turns, each replayed only when no
                         tensor on its outputs' memory is held outside hotswap (the storages'
                         use counts, read before each replay)
    back to copying      a call that finds both graphs' outputs held (the caller keeps more,
                         ``outs.append(model(x))``) lets both graphs go (their memory goes
                         with the caller's tensors) and captures a new one, whose replays
                         return copies again

The second graph costs a memory pool of its own (the graph's activations and outputs once
more), and each capture, as torch.cuda.graph's, synchronizes the device and empties the
allocator's cache first (once per graph, in the call that captures). A lent output is the
graph's memory: read it on another stream and the caller must order that stream before its
next call on this graph (``torch.cuda.current_stream().wait_stream(other)``), as
``record_stream`` cannot hold a replay back.

An output on an argument's memory (the graph returns an input or a view of one) is copied on
every replay: the next call's arguments are copied into that memory.

A call whose arguments differ from the captured ones in shape, stride, dtype, device or a
non-tensor value, or whose in-place arguments moved, runs the artifact as it is. Graphs that
cannot be captured run as they are, for good (logged once): an argument off the GPU, gradients
to track, an argument the graph writes to (its writes would land in the buffer, not in the
caller's tensor), or a capture that raises.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from hotswap.engine.options import CUDAGRAPHS_KEY, PARTS_KEY, REGIONS_KEY

__all__ = ["CUDAGRAPHS_KEY", "CudaGraphed", "split_cudagraphs"]

log = logging.getLogger("hotswap")


def split_cudagraphs(config: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
    """(the inductor config alone, whether the tier serves through CUDA graphs). A tier's
    other hotswap keys (REGIONS_KEY, PARTS_KEY) go too: its entry says itself how it loads."""
    config = dict(config or {})
    config.pop(REGIONS_KEY, None)
    config.pop(PARTS_KEY, None)
    return config, bool(config.pop(CUDAGRAPHS_KEY, False))


def _layout(x: torch.Tensor) -> Any:
    return (x.shape, x.stride(), x.dtype, x.device)


def _uses(ref: StorageWeakRef) -> int:
    return int(torch._C._storage_Use_Count(ref.cdata))


class Outputs:
    """The outputs a captured graph writes on each replay, and what holds them: returned as
    copies, or lent (the graph's own memory) while nothing outside holds an earlier loan."""

    def __init__(self, out: Any, arguments: Sequence[Any]) -> None:
        self._leaves, self._spec = pytree.tree_flatten(out)
        on_arguments = {a.untyped_storage().data_ptr() for a in arguments
                        if isinstance(a, torch.Tensor)}
        # an output on an argument's memory is copied whatever the mode (next paragraph)
        self._copied = [isinstance(x, torch.Tensor)
                        and x.untyped_storage().data_ptr() in on_arguments for x in self._leaves]
        refs: dict[int, StorageWeakRef] = {}
        for x, copied in zip(self._leaves, self._copied, strict=True):
            if isinstance(x, torch.Tensor) and not copied:
                refs.setdefault(x.untyped_storage().data_ptr(),
                               StorageWeakRef(x.untyped_storage()))  # type: ignore[no-untyped-call]
        self._refs = list(refs.values())
        self._own = [_uses(r) for r in self._refs]  # the use counts of hotswap's own tensors

    def free(self) -> bool:
        """Nothing outside holds a tensor on these outputs' memory: a replay may overwrite it."""
        return all(_uses(r) <= own for r, own in zip(self._refs, self._own, strict=True))

    def hand_out(self, lend: bool) -> Any:
        """The outputs after a replay: aliases of the graph's own (``lend``) or copies."""
        self._own = [_uses(r) for r in self._refs]  # free, so only ours count now
        return pytree.tree_unflatten(
            [(x.detach() if lend and not copied else x.clone())
             if isinstance(x, torch.Tensor) else x
             for x, copied in zip(self._leaves, self._copied, strict=True)], self._spec)


class CudaGraphed:
    """A loaded tier's callable, served through a CUDA graph from its second call."""

    def __init__(self, fn: Callable[..., Any], graph_id: str = "") -> None:
        self._fn = fn
        self._graph_id = graph_id
        self._lock = threading.Lock()
        self._calls = 0
        self._first: list[int | None] = []        # each argument's address at call 1
        self._graphs: list[tuple[torch.cuda.CUDAGraph, Outputs]] = []  # one, or two lending
        self._static: list[Any] = []
        self._moved: list[int] = []               # arguments copied into a buffer each call
        self._pinned: list[tuple[int, int]] = []  # arguments read in place: their addresses
        self._values: list[tuple[int, Any]] = []  # non-tensor arguments, as captured
        self.lending = False                      # replays return the graph's own outputs
        self._may_lend = True                     # False once a second graph failed
        # the copies the last two calls returned (while copying): gone by the call after
        # next, the caller keeps at most one output and the graphs may lend theirs
        self._copies: collections.deque[list[StorageWeakRef]] = collections.deque(maxlen=2)
        self.why_not = ""                         # why it runs without a graph, once known

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def __call__(self, *args: Any) -> Any:
        if self._graphs:
            return self._replay(args)
        if self.why_not:
            return self._fn(*args)
        with self._lock:
            self._calls += 1
            calls = self._calls
        if calls == 1:
            self.why_not = self._ineligible(args)
            self._first = [a.data_ptr() if isinstance(a, torch.Tensor) else None for a in args]
            return self._fn(*args)
        with self._lock:  # one capture, whichever thread gets here first
            if not self._graphs and not self.why_not:
                try:
                    self._capture(args)
                except Exception as e:
                    self._refuse(f"capture failed: {type(e).__name__}: {e}")
        return self._replay(args) if self._graphs else self._fn(*args)

    def _ineligible(self, args: Sequence[Any]) -> str:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors or any(t.device.type != "cuda" for t in tensors):
            return "an argument is not on a CUDA device"
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return "gradients are tracked (CUDA graphs serve inference here)"
        return ""

    def _refuse(self, why: str) -> None:
        self.why_not = why
        log.info("graph %s: serving without CUDA graphs: %s", self._graph_id, why)

    def _capture(self, args: Sequence[Any]) -> None:
        moved = [i for i, a in enumerate(args)
                 if isinstance(a, torch.Tensor) and a.data_ptr() != self._first[i]]
        static = list(args)
        for i in moved:
            static[i] = args[i].clone()
        before = [static[i].clone() for i in moved]
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._fn(*static)  # allocations settle before the capture
        torch.cuda.current_stream().wait_stream(side)
        if any(not torch.equal(static[i], b) for i, b in zip(moved, before, strict=True)):
            self._refuse("the graph writes to an argument")
            return
        self._static, self._moved = static, moved
        self._pinned = [(i, a.data_ptr()) for i, a in enumerate(args)
                        if isinstance(a, torch.Tensor) and i not in moved]
        self._values = [(i, a) for i, a in enumerate(args) if not isinstance(a, torch.Tensor)]
        self._graphs.append(self._record())
        log.debug("graph %s: captured in a CUDA graph (%d argument(s) copied per call)",
                  self._graph_id, len(moved))

    def _record(self) -> tuple[torch.cuda.CUDAGraph, Outputs]:
        """A capture of the tier on the static arguments, in a memory pool of its own."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = self._fn(*self._static)
        return graph, Outputs(out, self._static)

    def _replay(self, args: Sequence[Any]) -> Any:
        if len(args) != len(self._static) or any(
                args[i].data_ptr() != ptr for i, ptr in self._pinned) or any(
                args[i] != value for i, value in self._values) or any(
                _layout(args[i]) != _layout(self._static[i]) for i in self._moved):
            return self._fn(*args)  # not what was captured: as it is, this call
        with self._lock:
            chosen = self._free_graph()
            if chosen is None and len(self._graphs) > 1:  # the caller holds both graphs'
                chosen = self._recapture()                # outputs: copies from now on
            if chosen is None:  # a second graph failed while the first's outputs are held
                self.lending = False
                return self._fn(*args)
            graph, outputs = chosen
            for i in self._moved:
                arg, buffer = args[i], self._static[i]
                if arg.data_ptr() != buffer.data_ptr():
                    buffer.copy_(arg)
            graph.replay()
            if not self.lending:
                self.lending = self._may_lend and self._copies_gone()
            out = outputs.hand_out(self.lending)
            if not self.lending and self._may_lend:  # else nothing will read them
                self._copies.append([StorageWeakRef(x.untyped_storage())  # type: ignore[no-untyped-call]
                                     for x in pytree.tree_leaves(out)
                                     if isinstance(x, torch.Tensor)])
            return out

    def _free_graph(self) -> tuple[torch.cuda.CUDAGraph, Outputs] | None:
        """A graph no held output keeps from replaying; lending, the second one is captured
        when the first's outputs are held (a failed capture: none, and copying resumes)."""
        for chosen in self._graphs:
            if chosen[1].free():
                return chosen
        if not self.lending or len(self._graphs) > 1:
            return None
        try:
            self._graphs.append(self._record())
        except Exception as e:
            self._may_lend = False
            log.info("graph %s: a second CUDA graph failed (%s: %s); copying outputs",
                     self._graph_id, type(e).__name__, e)
            return None
        return self._graphs[-1]

    def _recapture(self) -> tuple[torch.cuda.CUDAGraph, Outputs] | None:
        """The caller keeps outputs of every graph (``outs.append(model(x))``): those graphs
        are let go (their memory stays with the caller's tensors until they go) and one new
        graph serves, returning copies. None: it could not be captured, and the tier runs
        without graphs from now on."""
        self.lending = False
        self._copies.clear()
        self._graphs = []
        try:
            self._graphs.append(self._record())
        except Exception as e:
            self._refuse(f"capture failed: {type(e).__name__}: {e}")
            return None
        log.debug("graph %s: its outputs are kept; a new graph returns copies", self._graph_id)
        return self._graphs[0]

    def _copies_gone(self) -> bool:
        """Copying: the copies returned two calls ago are gone (the caller keeps one output at
        most), so the graphs may lend theirs from this call on."""
        if len(self._copies) < 2 or not all(
                ref.expired() for ref in self._copies[0]):  # type: ignore[no-untyped-call]
            return False
        self._copies.clear()
        return True
