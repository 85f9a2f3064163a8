"""Compiled artifacts as they travel and rest: the worker's bytes plus its kernel files.

A cache entry, a worker's result, a gate benchmark job and a load all use the same packed
form (an *entry*), so an artifact that was stored is byte for byte one that was loaded here
(or by a worker's benchmark). The worker packs it; the user's process only reads it::

    b"HSE1" | u32 header length | msgpack {"artifact": size, "files": [[path, size], ...]}
            | artifact bytes | each file's bytes, in header order

The parts are read as views into the entry, never copied out: in the user's process every
copy of a GPU artifact (tens of MB) holds the GIL for milliseconds, stalling the calls
being served. (msgpack's bin type would copy each part when unpacked.)
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import msgpack

from hotswap import compat
from hotswap.compat import Buffer
from hotswap.counting import bump
from hotswap.engine.loading import kernel_files, load_guard, precompiled, source_key
from hotswap.engine.loading.cudagraphs import CudaGraphed, split_cudagraphs
from hotswap.engine.loading.regions import Regional, check_plan

__all__ = ["entry_parts", "load_entry", "pack_entry", "shared_spans"]

_MAGIC = b"HSE1"
_HEAD = struct.Struct("!4sI")
# Inductor's precompiled headers: torch's C++ headers prepared once per set of compiler flags
# (a 149 MiB file on x86), alike for every kernel built with those flags, and shipped by the
# first compile in a fresh inductor cache. A cache stores them once (``shared_spans``).
_SHARED_DIR = kernel_files.HEADERS_DIR + "/"
_SHARED_MIN_BYTES = 64 * 1024


def pack_entry(artifact: bytes, files: dict[str, bytes],
               probes: dict[str, Any] | None = None,
               regions: dict[str, Any] | None = None) -> bytes:
    """The artifact plus the kernel files the compile produced, as one entry; ``probes`` is
    what the compiling process's probes found (``load_guard.probes()``). ``regions``: the
    artifact is the distinct pieces of a graph compiled region by region, one after another,
    and this the plan that serves the graph with them (loading/regions.py)."""
    fields: dict[str, Any] = {"artifact": len(artifact),
                              "files": [[path, len(data)] for path, data in files.items()]}
    if probes:
        fields["probes"] = probes
    if regions is not None:
        fields["regions"] = regions
    header = msgpack.packb(fields, use_bin_type=True)
    return b"".join([_HEAD.pack(_MAGIC, len(header)), header, artifact, *files.values()])


def entry_parts(entry: Buffer) -> tuple[memoryview, dict[str, memoryview]]:
    """(artifact, {path: file}) of an entry, as views into it. ValueError if malformed."""
    artifact, files, _, _ = _unpack(entry)
    return artifact, files


def shared_spans(entry: Buffer) -> list[tuple[int, int]]:
    """(offset, length) in ``entry`` of each kernel file many entries ship alike (inductor's
    precompiled headers): what ``ArtifactCache.put(shared=...)`` stores once. ValueError if
    ``entry`` is malformed."""
    _, _, _, spans, _ = _layout(memoryview(entry))
    return [(offset, n) for path, offset, n in spans
            if path.startswith(_SHARED_DIR) and n >= _SHARED_MIN_BYTES]


def _unpack(entry: Buffer) -> tuple[memoryview, dict[str, memoryview], dict[str, Any],
                                    dict[str, Any] | None]:
    view = memoryview(entry)
    offset, artifact_size, probes, spans, plan = _layout(view)
    files = {path: view[at:at + n] for path, at, n in spans}
    return view[offset:offset + artifact_size], files, probes, plan


def _layout(view: memoryview) -> tuple[int, int, dict[str, Any], list[tuple[str, int, int]],
                                       dict[str, Any] | None]:
    """Where an entry's artifact starts, its size, the probes, (path, offset, size) of each
    file, and the region plan if any; ValueError if malformed."""
    if len(view) < _HEAD.size:
        raise ValueError("not a hotswap artifact entry (too short)")
    magic, header_len = _HEAD.unpack_from(view)
    if magic != _MAGIC:
        raise ValueError(f"not a hotswap artifact entry (starts with {bytes(magic)!r})")
    offset = _HEAD.size + header_len
    try:
        header = msgpack.unpackb(view[_HEAD.size:offset], raw=False)
        artifact_size = int(header["artifact"])
        sizes = [(str(path), int(n)) for path, n in header["files"]]
        probes = header.get("probes", {})
        if not isinstance(probes, dict):
            raise TypeError(f"probes is a {type(probes).__name__}")
    except Exception as e:
        raise ValueError(f"artifact entry has an unreadable header: {e}") from e
    plan = header.get("regions")
    if plan is not None:
        plan = check_plan(plan, artifact_size)
    if offset + artifact_size + sum(n for _, n in sizes) != len(view):
        raise ValueError("artifact entry is truncated or has trailing bytes")
    spans, at = [], offset + artifact_size
    for path, n in sizes:
        spans.append((path, at, n))
        at += n
    return offset, artifact_size, probes, spans, plan


def load_entry(entry: Buffer, config_patches: Mapping[str, Any] | None = None) -> Any:
    """Put the entry's kernel files where this process's inductor looks (when it lacks them:
    a separate TORCHINDUCTOR_CACHE_DIR), take what the compiling process's probes found, then
    load it under the inductor config its tier compiled with, building nothing
    (load_guard.py; a compiler it does run counts as ``load_compiler_runs``).

    The config matters at load: the artifact's wrapper names its C++ kernels by source, and
    inductor finds (or builds) each kernel's library under the compiler flags this process's
    config picks now. Loaded under another config, a tier compiled with ``cpp.simdlen=1``
    missed the worker's library and was rebuilt with the machine's vector ISA flags."""
    from torch._inductor import config

    config_patches, cudagraphs = split_cudagraphs(dict(config_patches or {}))
    artifact, files, probes, plan = _unpack(entry)
    if files:
        kernel_files.restore(files)
    if probes:
        load_guard.adopt(probes)
        source_key.adopt(probes)  # torch's source hash: not computed here again
    with load_guard.count_compiler_runs(), precompiled.adopted(probes), config.patch(
            {**config_patches, **load_guard.load_config()}):
        if plan is None:
            fn = compat.artifact_from_bytes(artifact)
        else:
            fn = Regional([compat.artifact_from_bytes(part) for part in _parts(artifact, plan)],
                          plan)
            bump("regional_loads")
            bump("regional_pieces", len(plan["steps"]))
            bump("regional_compiled", len(plan["sizes"]))
    return CudaGraphed(fn) if cudagraphs else fn


def _parts(artifact: memoryview, plan: dict[str, Any]) -> list[memoryview]:
    parts, at = [], 0
    for n in plan["sizes"]:
        parts.append(artifact[at:at + n])
        at += n
    return parts
