"""What a compiled tier's cache key is made of, and the environment stamp entries carry.

Pickled GraphModules are not deterministic bytes, so a graph enters its key as a digest of its
generated code and of the tensors it holds (those of the subgraphs it holds included). The
other factors: the inputs' metadata (symbolic sizes included), the grad mode, the tier's
config, the caller's intra-op threads (CPU graphs) and the environment stamp. ``cache/key.py``
serializes them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
from collections.abc import Iterable
from typing import Any

import torch

from hotswap.cache.key import cache_key
from hotswap.cache.store import FORMAT_VERSION
from hotswap.engine.shipping.transport import get_attr_value
from hotswap.engine.shipping.wire import InputMeta

__all__ = ["environment_stamp", "graph_digest", "prepare_stamp", "tier_key", "verdict_key"]


@functools.lru_cache(maxsize=1)
def _triton_version() -> str | None:
    """From the package metadata (a scan of sys.path: tens of ms, so once per process)."""
    from importlib import metadata

    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None


def environment_stamp(devices: Iterable[str] = ()) -> dict[str, Any]:
    """What an artifact was built for; an entry with another stamp is never loaded. Cheap on
    purpose (it runs in the user's first call): versions and the build commit, not a source hash."""
    gpus = []
    for device in sorted(set(devices)):
        if device.startswith("cuda") and torch.cuda.is_available():
            index = torch.device(device).index or 0
            major, minor = torch.cuda.get_device_capability(index)
            gpus.append(f"{torch.cuda.get_device_name(index)} sm_{major}{minor}")
    # The CPU's vector capability: a CPU kernel built for AVX-512 must not load on an AVX2
    # machine sharing the cache (and loads take the worker's vector-ISA probe with the entry).
    return {"format": FORMAT_VERSION, "torch": torch.__version__,
            "torch_build": torch.version.git_version, "cuda": torch.version.cuda,
            "triton": _triton_version(), "gpus": gpus,
            "cpu": torch.backends.cpu.get_cpu_capability()}


def prepare_stamp() -> None:
    """Look the versions up ahead of the first graph (call it off the user's thread)."""
    _triton_version()


def _tensor_digest(t: torch.Tensor) -> str:
    data = t.detach().to("cpu").contiguous()
    raw = ctypes.string_at(data.data_ptr(), data.numel() * data.element_size())
    return f"{data.dtype}{tuple(data.shape)}:{hashlib.sha256(raw).hexdigest()}"


def graph_digest(gm: torch.fx.GraphModule) -> str:
    """The generated code and held tensors of ``gm`` and of the subgraphs it holds (the bodies
    of higher-order operators: two graphs may differ only there)."""
    h = hashlib.sha256()

    def walk(module: torch.fx.GraphModule) -> None:
        h.update(module.code.encode())
        for node in module.graph.find_nodes(op="get_attr"):
            value = get_attr_value(module, str(node.target))
            if isinstance(value, torch.Tensor):
                h.update(_tensor_digest(value).encode())
            elif isinstance(value, torch.fx.GraphModule):
                walk(value)

    walk(gm)
    return h.hexdigest()


def graph_signature(gm: torch.fx.GraphModule, example_inputs: Iterable[Any]) -> str:
    """The same graph in another run, or on another machine: its code and its inputs' shapes
    and dtypes (no tensor values, no versions). Profiles pair graphs of two runs by it."""
    h = hashlib.sha256(gm.code.encode())
    for x in example_inputs:
        h.update(repr((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor)
                      else type(x).__name__).encode())
    return h.hexdigest()[:16]


def tier_key(gm: torch.fx.GraphModule, inputs: Iterable[InputMeta], grad_enabled: bool,
             tier_config: dict[str, Any], stamp: dict[str, Any],
             num_threads: int | None = None) -> str:
    """The key of ``gm`` compiled under ``tier_config`` for these inputs, here."""
    factors = {"graph": graph_digest(gm), "inputs": [m.to_wire() for m in inputs],
               "grad": grad_enabled, "config": tier_config, "stamp": stamp}
    if num_threads is not None:  # CPU graphs: C++ kernels are generated for a thread count
        factors["threads"] = num_threads
    return cache_key(factors)


def verdict_key(tier_key: str) -> str:
    """The key of the gate's verdict on the artifact stored under ``tier_key``."""
    return cache_key({"verdict-of": tier_key})
