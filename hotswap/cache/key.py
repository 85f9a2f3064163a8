"""Cache keys: deterministic across processes, covering everything that changes an artifact.

Pickled GraphModules are not deterministic bytes, so the key hashes the graph's generated code,
the bytes of the tensors it holds, the input metadata (symbolic sizes included), the grad mode,
the tier's config, and the environment stamp (torch build, triton, devices, format version).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
from collections.abc import Iterable
from typing import Any

import torch

from hotswap.cache.store import FORMAT_VERSION
from hotswap.orchestrator.transport import get_attr_value

__all__ = ["cache_key", "environment_stamp", "prepare_stamp"]


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
    triton_version = _triton_version()
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
            "triton": triton_version, "gpus": gpus,
            "cpu": torch.backends.cpu.get_cpu_capability()}


def prepare_stamp() -> None:
    """Look the versions up ahead of the first graph (call it off the user's thread)."""
    _triton_version()


def _tensor_digest(t: torch.Tensor) -> str:
    data = t.detach().to("cpu").contiguous()
    raw = ctypes.string_at(data.data_ptr(), data.numel() * data.element_size())
    return f"{data.dtype}{tuple(data.shape)}:{hashlib.sha256(raw).hexdigest()}"


def _hash_graph(h: Any, gm: torch.fx.GraphModule) -> None:
    """The generated code and held tensors of ``gm`` and of the subgraphs it holds (the bodies
    of higher-order operators: two graphs may differ only there)."""
    h.update(gm.code.encode())
    for node in gm.graph.find_nodes(op="get_attr"):
        value = get_attr_value(gm, str(node.target))
        if isinstance(value, torch.Tensor):
            h.update(_tensor_digest(value).encode())
        elif isinstance(value, torch.fx.GraphModule):
            _hash_graph(h, value)


def cache_key(gm: torch.fx.GraphModule, inputs: Iterable[Any], grad_enabled: bool,
              tier_config: dict[str, Any], stamp: dict[str, Any],
              num_threads: int | None = None) -> str:
    h = hashlib.sha256()
    _hash_graph(h, gm)
    h.update(repr(tuple(inputs)).encode())
    described = {"grad": grad_enabled, "config": tier_config, "stamp": stamp}
    if num_threads is not None:  # CPU graphs: C++ kernels are generated for a thread count
        described["threads"] = num_threads
    h.update(json.dumps(described, sort_keys=True, default=repr).encode())
    return h.hexdigest()
