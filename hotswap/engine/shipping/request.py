"""What a graph needs before its tiers start (``prepare``: made once, in the backend call),
what the coordinator keeps per graph to compile it again, and how job errors are told."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from hotswap import compat
from hotswap.counting import bump
from hotswap.engine.options import Tier
from hotswap.engine.shipping.inputs import describe_inputs
from hotswap.engine.shipping.regions import region_labels
from hotswap.engine.shipping.transport import (
    mutated_attributes,
    origin_of,
    ship_graph,
    submodule_reason,
)
from hotswap.engine.shipping.wire import CompileRequest, InputMeta
from hotswap.errors import CompileFailed, JobTimeout, MemoryLimitExceeded, SerializationFailed, WorkerCrashed
from hotswap.system import cores

__all__ = ["GraphRequest", "Keys", "Prepared", "count_error", "cpu_threads", "devices_of",
           "portable_inputs", "prepare", "reason_of", "unsaveable"]

# A graph's cache keys, tier -> key: (graph, its inputs, grad mode, CPU threads) -> keys.
Keys = Callable[[torch.fx.GraphModule, "tuple[InputMeta, ...]", bool, "int | None"],
                Mapping[str, str]]


class GraphRequest(NamedTuple):
    """A graph as its compile jobs ship it (built once, in the user's call)."""

    graph_bytes: bytes
    inputs: tuple[InputMeta, ...]
    grad_enabled: bool
    num_threads: int | None  # the caller's intra-op threads, for graphs that run on the CPU

    compile_id: str = ""     # dynamo's, of the frame the graph came from (wire.py says why)
    regions: tuple[int, ...] = ()  # per node, its repeated region (shipping/regions.py)

    def compile_request(self, graph_id: str, tier: Tier, *,
                        measured: bool = False) -> CompileRequest:
        return CompileRequest(graph_id, tier.name, dict(tier.config), self.graph_bytes,
                              self.inputs, self.grad_enabled, self.num_threads,
                              self.compile_id, measured,
                              self.regions if tier.regions else (), tier.parts)


@dataclass(frozen=True)
class Prepared:
    """What a graph needs before its tiers start; its journey is made from it."""

    origin: str                                  # where the graph came from (cache labels)
    inputs: tuple[InputMeta, ...] | None = None  # None: not portable (compiled here, unstored)
    keys: Mapping[str, str] = field(default_factory=dict)  # tier -> cache key
    request: GraphRequest | None = None          # None: not shipped, compiled here
    here_because: str = ""                       # why it compiles here, not in a worker
    shipped_s: tuple[float, float] | None = None  # when the graph was made shippable

    @property
    def devices(self) -> set[str]:
        return devices_of(self.request) if self.request is not None else set()

    @property
    def weighable(self) -> bool:
        """Its calls can be weighed one window against another: static sizes (a dynamic
        graph's windows may hold calls of other sizes), and inference (a training graph's
        call times its forward alone, not the backward its tier compiled with it)."""
        if self.inputs is None or self.request is None:
            return False
        trains = self.request.grad_enabled and any(m.requires_grad for m in self.inputs)
        return not trains and not any(m.symbols for m in self.inputs)


def prepare(gm: torch.fx.GraphModule, example_inputs: list[object], *, keys: Keys,
            ship: bool, start_s: float | None = None, cut: bool = False) -> Prepared:
    """The graph's cache keys and, when ``ship``, the form a worker compiles it from; or why
    it compiles here. ``cut``: a tier compiles region by region, so label the graph's
    regions (a few ms). Reads the caller's grad mode and CPU threads, changes nothing."""
    start_s = time.monotonic() if start_s is None else start_s
    origin = origin_of(gm)
    described = portable_inputs(gm, example_inputs)
    if isinstance(described, str):  # no key: compiled here, not stored
        return Prepared(origin, here_because=described if ship else "")
    grad, threads = torch.is_grad_enabled(), cpu_threads(described)
    made = Prepared(origin, described, keys(gm, described, grad, threads))
    if not ship:
        return made
    try:
        graph_bytes = ship_graph(gm)
    except Exception as e:
        return replace(made,
                       here_because=f"this graph cannot be pickled ({type(e).__name__}: {e})")
    # The caller's grad mode decides whether AOTAutograd builds a backward graph.
    # Cut where it may be: static sizes, and inference (jobs/regions.py compiles no backward).
    cut = cut and not any(m.symbols or (grad and m.requires_grad) for m in described)
    request = GraphRequest(graph_bytes, described, grad, threads, compat.current_compile_id(),
                           region_labels(gm, [m.static for m in described]) if cut else ())
    return replace(made, request=request, shipped_s=(start_s, time.monotonic()))


def portable_inputs(gm: torch.fx.GraphModule,
                    example_inputs: list[object]) -> tuple[InputMeta, ...] | str:
    """The inputs' metadata if an artifact of this graph may be made apart from the user's
    tensors (in a worker, or stored in the cache for another process), else the reason not."""
    described = describe_inputs(gm, example_inputs)
    if isinstance(described, str):
        return described
    submodule = submodule_reason(gm)
    if submodule is not None:
        return submodule
    mutated = mutated_attributes(gm)
    if mutated:
        return (f"the graph updates tensors it holds as attributes in place "
                f"({', '.join(mutated[:3])}{', ...' if len(mutated) > 3 else ''}); an artifact "
                "compiled apart from them would update copies, so it stays eager")
    return described


def devices_of(request: GraphRequest) -> set[str]:
    return {m.device for m in request.inputs if m.is_tensor}


def cpu_threads(inputs: tuple[InputMeta, ...]) -> int | None:
    """The caller's intra-op thread count when the graph runs on the CPU (what its C++
    kernels are generated for); None for device graphs, whose artifacts do not depend on it."""
    devices = {m.device.split(":")[0] for m in inputs if m.is_tensor}
    if devices and "cpu" not in devices:
        return None
    # The caller's own count, also where dynamo compiles inside an eager answer that runs
    # with fewer threads (system/cores.py)
    return cores.own_threads(torch.get_num_threads())


_ERROR_COUNTERS = ((WorkerCrashed, "worker_crashes"), (JobTimeout, "job_timeouts"),
                   (MemoryLimitExceeded, "memory_limit_kills"),
                   (SerializationFailed, "serialization_failures"))


def count_error(error: BaseException | None) -> None:
    """Bump the counter of a job's failure kind (none for other errors)."""
    for kind, counter in _ERROR_COUNTERS:
        if isinstance(error, kind):
            bump(counter)
            return


def unsaveable(error: CompileFailed) -> bool:
    """The worker compiled the graph but inductor could not save the artifact."""
    return error.remote_type.rsplit(".", 1)[-1] == "UnsaveableArtifact"


def reason_of(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
