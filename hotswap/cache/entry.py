"""An entry's bytes: what a worker packs, and what reads it (stdlib and msgpack only: the
compile service, which never imports torch, merges the parts of a graph compiled in parts)::

    b"HSE1" | u32 header length | msgpack {"artifact": size, "files": [[path, size], ...],
                                           "probes": {...}, "regions": plan, "part": plan}
            | artifact bytes | each file's bytes, in header order

engine/loading/artifacts.py loads entries; engine/loading/regions.py serves a region plan.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

__all__ = ["Buffer", "check_plan", "layout", "merge_parts", "pack_entry"]

Buffer = bytes | bytearray | memoryview

_MAGIC = b"HSE1"
_HEAD = struct.Struct("!4sI")


def pack_entry(artifact: bytes, files: dict[str, bytes],
               probes: dict[str, Any] | None = None,
               regions: dict[str, Any] | None = None, *,
               part: dict[str, Any] | None = None) -> bytes:
    """The artifact plus the kernel files the compile produced, as one entry; ``probes`` is
    what the compiling process's probes found (``load_guard.probes()``). ``regions``: the
    artifact is the distinct pieces of a graph compiled region by region, one after another,
    and this the plan that serves the graph with them (loading/regions.py). ``part``: the
    artifact is one part of a graph compiled in parts, and this the plan of the parts
    (jobs/regions.py ``compile_part``): such an entry is only ever read by ``merge_parts``."""
    fields: dict[str, Any] = {"artifact": len(artifact),
                              "files": [[path, len(data)] for path, data in files.items()]}
    if probes:
        fields["probes"] = probes
    if regions is not None:
        fields["regions"] = regions
    if part is not None:
        fields["part"] = part
    header = msgpack.packb(fields, use_bin_type=True)
    return b"".join([_HEAD.pack(_MAGIC, len(header)), header, artifact, *files.values()])


def merge_parts(entries: list[Buffer]) -> bytes:
    """One entry of a graph compiled in parts (``pack_entry(part=...)``, one per part, in any
    order): the parts' artifacts one after another, their files, and the region plan that
    calls them in turn (loading/regions.py); or, where a job compiled the whole graph instead
    (jobs/compile.py ``_compile_part``), that entry as it is. ValueError if the parts do not
    make a whole (a part missing or twice, plans that disagree)."""
    wholes, found = [], []
    for entry in entries:
        view = memoryview(entry)
        offset, size, probes_of, spans, plan, part = _read(view)
        if part is not None:
            found.append((part, view, offset, size, probes_of, spans))
        elif size > 0:
            wholes.append(view)
    if wholes:
        return bytes(wholes[0])
    found.sort(key=lambda item: int(item[0]["part"]))
    if not found:
        raise ValueError("no part of the graph was compiled")
    first = found[0][0]
    if [int(p[0]["part"]) for p in found] != list(range(int(first["parts"]))) or any(
            (p[0]["steps"], p[0]["outputs"], p[0]["inputs"])
            != (first["steps"], first["outputs"], first["inputs"]) for p in found):
        raise ValueError("the compiled parts do not make one graph: "
                         f"{[p[0]['part'] for p in found]} of {first['parts']}")
    artifacts: list[memoryview] = []
    files: dict[str, memoryview] = {}
    for _, view, offset, size, _, spans in found:
        artifacts.append(view[offset:offset + size])
        for path, at, n in spans:
            # Two parts may carry one file: each worker ships what was written in inductor's
            # folder while it compiled, the other's work too, and a library the other was
            # still linking comes cut short. The longest copy is the finished one (files
            # named for their content; a write that renames into place is never seen short).
            # A linker that sizes its output before writing it (gold) could leave a copy of
            # full length unfinished: the first part's copy is kept then.
            if path not in files or n > len(files[path]):
                files[path] = view[at:at + n]
    plan = {"inputs": first["inputs"], "sizes": [len(a) for a in artifacts],
            "steps": first["steps"], "outputs": first["outputs"]}
    check_plan(plan, sum(len(a) for a in artifacts))
    probes = _merged_probes([p[4] for p in found])
    return pack_entry(b"".join(artifacts), files, probes, plan)  # type: ignore[arg-type]


def _merged_probes(each: list[dict[str, Any]]) -> dict[str, Any]:
    """One entry's probes of the parts' (engine/loading/load_guard.py ``probes``,
    source_key.py, precompiled.py): the vector ISAs as the worker that probed furthest found
    them (the list and how far it got go together: a load checks one against the other), and
    every part's precompiled headers and generated modules' bytecode."""
    def reach(probes: Any) -> tuple[bool, int]:
        probed = probes.get("vec_isa_probed")
        return "vec_isa" in probes and probed is None, probed if isinstance(probed, int) else 0

    merged: dict[str, Any] = dict(max(each, key=reach))
    headers = {tuple(h): h for p in each for h in p.get("headers", []) if isinstance(h, list)}
    if headers:
        merged["headers"] = list(headers.values())
    codes = [p["code"] for p in each if "code" in p]
    if codes and all(_same_code(codes[0], c) for c in codes):
        merged["code"] = [codes[0][0], {k: v for c in codes for k, v in c[1].items()}]
    return merged


def _same_code(a: Any, b: Any) -> bool:
    """Whether two entries' bytecode records (precompiled.record) are of one Python."""
    return all(isinstance(x, list) and len(x) == 2 and isinstance(x[1], dict) for x in (a, b)) \
        and a[0] == b[0]


def layout(view: memoryview) -> tuple[int, int, dict[str, Any], list[tuple[str, int, int]],
                                       dict[str, Any] | None]:
    """Where an entry's artifact starts, its size, the probes, (path, offset, size) of each
    file, and the region plan if any; ValueError if malformed or a part of a graph (what
    ``merge_parts`` alone reads)."""
    offset, size, probes, spans, plan, part = _read(view)
    if part is not None:
        raise ValueError("artifact entry is one part of a graph compiled in parts, not a "
                         "graph's entry")
    return offset, size, probes, spans, plan


def _read(view: memoryview) -> tuple[int, int, dict[str, Any], list[tuple[str, int, int]],
                                     dict[str, Any] | None, dict[str, Any] | None]:
    """``_layout``'s, and the part's plan where the entry is one part of a graph."""
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
    part = header.get("part")
    if part is not None and not (isinstance(part, dict) and {"part", "parts", "steps",
                                                             "outputs", "inputs"} <= set(part)):
        raise ValueError("artifact entry has a malformed part plan")
    if offset + artifact_size + sum(n for _, n in sizes) != len(view):
        raise ValueError("artifact entry is truncated or has trailing bytes")
    spans, at = [], offset + artifact_size
    for path, n in sizes:
        spans.append((path, at, n))
        at += n
    return offset, artifact_size, probes, spans, plan, part


def check_plan(plan: Any, artifact_size: int) -> dict[str, Any]:
    """``plan`` if well formed for an artifact of ``artifact_size`` bytes, else ValueError."""
    try:
        n_inputs, sizes, steps = int(plan["inputs"]), list(plan["sizes"]), list(plan["steps"])
        outputs = [int(o) for o in plan["outputs"]]
        made = set(range(n_inputs))
        for piece, ins, outs in steps:
            if not 0 <= int(piece) < len(sizes) or any(int(i) not in made for i in ins):
                raise ValueError(f"step {piece, ins, outs} reads a value not made before it")
            if any(int(o) < n_inputs or int(o) in made for o in outs) or \
                    len(set(outs)) != len(outs):
                raise ValueError(f"step {piece, ins, outs} makes a value made before it")
            made.update(int(o) for o in outs)
        if any(o != -1 and o not in made for o in outputs):
            raise ValueError("an output is never made")
        if sum(int(n) for n in sizes) != artifact_size or any(int(n) <= 0 for n in sizes):
            raise ValueError("the pieces' sizes do not add up to the artifact")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"artifact entry has a malformed region plan: {e}") from e
    return {"inputs": n_inputs, "sizes": [int(n) for n in sizes], "outputs": outputs,
            "steps": [(int(p), [int(i) for i in ins], [int(o) for o in outs])
                      for p, ins, outs in steps]}
