"""What the coordinator keeps per graph to compile it again, and how job errors are told."""

from __future__ import annotations

from typing import NamedTuple

import torch

from hotswap.counting import bump
from hotswap.engine.options import Tier
from hotswap.engine.shipping.inputs import describe_inputs
from hotswap.engine.shipping.transport import mutated_attributes, submodule_reason
from hotswap.engine.shipping.wire import CompileRequest, InputMeta
from hotswap.errors import CompileFailed, JobTimeout, MemoryLimitExceeded, SerializationFailed, WorkerCrashed

__all__ = ["GraphRequest", "count_error", "cpu_threads", "devices_of", "portable_inputs",
           "reason_of", "unsaveable"]


class GraphRequest(NamedTuple):
    """A graph as its compile jobs ship it (built once, in the user's call)."""

    graph_bytes: bytes
    inputs: tuple[InputMeta, ...]
    grad_enabled: bool
    num_threads: int | None  # the caller's intra-op threads, for graphs that run on the CPU

    compile_id: str = ""     # dynamo's, of the frame the graph came from (wire.py says why)

    def compile_request(self, graph_id: str, tier: Tier) -> CompileRequest:
        return CompileRequest(graph_id, tier.name, dict(tier.config), self.graph_bytes,
                              self.inputs, self.grad_enabled, self.num_threads,
                              self.compile_id)


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
    return torch.get_num_threads() if not devices or "cpu" in devices else None


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
