"""Compiled artifacts as they travel and rest: the worker's bytes plus its kernel files.

A cache entry, a worker's result, a gate benchmark job and a load all use the same packed
form (an *entry*), so an artifact that was stored is byte for byte one that was loaded here
(or by a worker's benchmark). The worker packs it; the user's process only reads it (its
bytes: entry.py).

The parts are read as views into the entry, never copied out: in the user's process every
copy of a GPU artifact (tens of MB) holds the GIL for milliseconds, stalling the calls
being served. (msgpack's bin type would copy each part when unpacked.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hotswap import compat
from hotswap.cache.entry import layout as _layout
from hotswap.cache.entry import merge_parts, pack_entry
from hotswap.compat import Buffer
from hotswap.counting import bump
from hotswap.engine.loading import kernel_files, load_guard, precompiled, source_key
from hotswap.engine.loading.cudagraphs import CudaGraphed, split_cudagraphs
from hotswap.engine.loading.regions import Regional

__all__ = ["entry_parts", "headers_in_place", "load_entry", "merge_parts", "pack_entry",
           "shared_spans"]

# Inductor's precompiled headers: torch's C++ headers prepared once per set of compiler flags
# (a 149 MiB file on x86), alike for every kernel built with those flags, and shipped by the
# first compile in a fresh inductor cache. A cache stores them once (``shared_spans``).
_SHARED_DIR = kernel_files.HEADERS_DIR + "/"
_SHARED_MIN_BYTES = 64 * 1024


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


def headers_in_place() -> Callable[[memoryview, int, int], bool]:
    """For a read from the cache (``ArtifactCache.get(have=...)``) that loads the entry here:
    whether a shared span is a precompiled header that is in place already, whole, so that
    ``load_entry`` would not write it: on a warm restart of the CPU box, 149 MiB read and
    hashed for nothing beside the user's calls. Such a span is left out of the entry (zeros,
    ``store.Unread``) and out of what ``load_entry`` restores."""
    found: dict[int, tuple[str, int]] = {}

    def have(payload: memoryview, offset: int, length: int) -> bool:
        if not found:
            try:
                _, _, _, spans, _ = _layout(payload)
            except ValueError:
                return False
            found.update({at: (path, n) for path, at, n in spans})
        path, n = found.get(offset, ("", -1))
        return n == length and kernel_files.header_in_place(path, n)

    return have


def _unpack(entry: Buffer) -> tuple[memoryview, dict[str, memoryview], dict[str, Any],
                                    dict[str, Any] | None]:
    view = memoryview(entry)
    offset, artifact_size, probes, spans, plan = _layout(view)
    unread = set(getattr(view.obj, "unread", ()))  # store.Unread: in place, not read
    files = {path: view[at:at + n] for path, at, n in spans if (at, n) not in unread}
    return view[offset:offset + artifact_size], files, probes, plan


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
