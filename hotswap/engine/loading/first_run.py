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

- a graph that updates a tensor in place (a method or function whose name ends in ``_``):
  its run would write to a parameter, or differ from the user's;
- a graph with an input that needs grad, or compiled with grad enabled: the run would build
  an autograd graph nobody uses;
- inputs on the CPU only (no lazy kernel loading there, and a run competes with the caller's
  calls for the cores), or non-parameter inputs over ``MAX_COPY_BYTES``;
- a CUDA-graph tier (``CudaGraphed``): its capture must happen in the serving thread.

The copies go when the graph is final (``GraphJourney``). A run that fails is logged and the
tier swaps in as it would have; its first user call then pays what the run would have.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["LAZY_DEVICES", "MAX_COPY_BYTES", "FirstRun"]

log = logging.getLogger("hotswap")

# The most a graph's copied inputs may take (bytes, all devices together).
MAX_COPY_BYTES = 256 * 2**20
# Device kinds whose first run pays work later runs do not (a graph on none of them is not run).
LAZY_DEVICES = ("cuda",)


class FirstRun:
    """Copies of a graph's example inputs, to run each of its loaded tiers once before it
    serves. ``capture`` returns None where a run would not be safe or worth it."""

    def __init__(self, inputs: tuple[Any, ...], devices: tuple[torch.device, ...]) -> None:
        self._inputs = inputs
        self._devices = devices

    @classmethod
    def capture(cls, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> FirstRun | None:
        if torch.is_grad_enabled() or _updates_in_place(gm):
            return None
        copied: list[Any] = []
        devices: set[torch.device] = set()
        size = 0
        for x in example_inputs:
            if isinstance(x, torch.Tensor):
                if x.requires_grad and not isinstance(x, torch.nn.Parameter):
                    return None
                if _is_fake(x):
                    return None
                if x.device.type in LAZY_DEVICES:
                    devices.add(x.device)
                if isinstance(x, torch.nn.Parameter):
                    copied.append(x)
                    continue
                size += x.untyped_storage().nbytes()
                if size > MAX_COPY_BYTES:
                    return None
                copied.append(x.detach().clone())
            elif isinstance(x, bool | int | float):
                copied.append(x)
            else:  # a symbolic size, an opaque object: not something to replay
                return None
        if not devices:
            return None
        return cls(tuple(copied), tuple(sorted(devices, key=str)))

    def run(self, fn: Any) -> float:
        """Call ``fn`` once on the copies and wait for the devices; the seconds it took."""
        start = time.monotonic()
        with torch.no_grad():
            fn(*self._inputs)
        for device in self._devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return time.monotonic() - start


def _updates_in_place(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph calls an in-place method or function (``add_``, ``copy_``, ...)."""
    for node in gm.graph.nodes:
        if node.op not in ("call_method", "call_function"):
            continue
        name = node.target if isinstance(node.target, str) else getattr(
            node.target, "__name__", "")
        if name.endswith("_") and not name.endswith("__"):
            return True
        if node.kwargs.get("out") is not None or node.kwargs.get("inplace") is True:
            return True
    return False


def _is_fake(x: torch.Tensor) -> bool:
    """A tensor without real storage (fake, meta): nothing to run on."""
    return x.device.type == "meta" or type(x).__name__ == "FakeTensor"
