"""The bytecode of an artifact's generated modules, compiled in the worker and carried with
the entry, so that the serving process does not compile their sources.

Loading an artifact runs inductor's generated wrapper module: inductor writes its source to
its cache and compiles it (``compile_tasks._reload_python_module``). ``compile()`` holds the
GIL for the whole compile, and a GPT-2 wrapper is 260 KB of source: the largest call beside
the load took 58-70 ms (H100), where the bench's probe (tools/lateness.py) saw that module
compiled. The worker compiled the very same source when it loaded the module to finish its
compile; its code object travels with the entry (``record()``, marshalled, with the worker's
probes), and the serving process takes it for a source of the same digest (``adopt()``):
``marshal.loads`` of it is a few ms.

The seam is the name ``compile`` in inductor's ``compile_tasks`` module: hotswap sets it to
``_compile`` there (``install()``), which answers a source it holds bytecode for and passes
everything else to the builtin. A torch that no longer compiles there simply compiles as
before. Only sources of at least ``MIN_BYTES`` travel (a small module compiles in
milliseconds), only between processes of one Python bytecode version and optimization
level (``importlib.util.MAGIC_NUMBER``, ``-O``), and only in entries, which are signed like
the artifact whose pickles a load runs anyway.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import importlib.util
import marshal
import sys
import threading
from collections.abc import Iterator
from types import CodeType
from typing import Any

__all__ = ["MIN_BYTES", "adopted", "install", "record", "recording"]

MIN_BYTES = 32 * 1024
# Bytecode is for one Python bytecode version and optimization level (-O drops asserts)
_MAGIC = f"{importlib.util.MAGIC_NUMBER.hex()}-O{sys.flags.optimize}"

_lock = threading.Lock()
_codes: dict[str, bytes] = {}  # digest of a source -> its marshalled code (serving process)
_recorded: dict[str, bytes] | None = None  # a worker's job: what it compiled


def _digest(source: str | bytes) -> str:
    return hashlib.sha256(source.encode() if isinstance(source, str) else source).hexdigest()


def _retarget(code: CodeType, filename: str) -> CodeType:
    """``code`` and the code objects inside it, as compiled from ``filename`` (what a
    traceback through the module shows)."""
    consts = tuple(_retarget(c, filename) if isinstance(c, CodeType) else c
                   for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _compile(source: Any, filename: Any, mode: str, *args: Any, **kwargs: Any) -> Any:
    """``compile`` for inductor's module loader: a source this process holds bytecode for is
    answered from it; in a worker's job, what it compiles is kept for the entry."""
    big = (mode == "exec" and isinstance(source, str | bytes) and len(source) >= MIN_BYTES
           and not args and set(kwargs) <= {"dont_inherit"})
    if not big:
        return builtins.compile(source, filename, mode, *args, **kwargs)
    digest = _digest(source)
    with _lock:
        data = _codes.pop(digest, None)
    if data is not None:
        try:
            return _retarget(marshal.loads(data), str(filename))
        except (ValueError, EOFError, TypeError):  # unreadable: compiled here after all
            pass
    code = builtins.compile(source, filename, mode, *args, **kwargs)
    with _lock:
        if _recorded is not None:
            _recorded[digest] = marshal.dumps(code)
    return code


def install() -> bool:
    """Put ``_compile`` where inductor loads its generated modules; False where this torch
    has no such place."""
    try:
        from torch._inductor.runtime import compile_tasks
    except ImportError:
        return False
    if not hasattr(compile_tasks, "_reload_python_module"):
        return False
    compile_tasks.compile = _compile  # type: ignore[attr-defined]
    return True


@contextlib.contextmanager
def recording() -> Iterator[dict[str, bytes]]:
    """Workers, around a job's compile: the generated modules it compiles, by digest."""
    global _recorded
    found: dict[str, bytes] = {}
    install()
    with _lock:
        _recorded = found
    try:
        yield found
    finally:
        with _lock:
            _recorded = None


def record(found: dict[str, bytes]) -> dict[str, Any]:
    """For an entry's probes: ``recording()``'s bytecode ({} where there is none)."""
    return {"code": [_MAGIC, dict(found)]} if found else {}


@contextlib.contextmanager
def adopted(probes: dict[str, Any]) -> Iterator[int]:
    """Inside the block (a load), this process takes an entry's bytecode for the generated
    modules it compiles (``record``); yields how many it holds (0 where none, or another
    Python's). What the load did not use is dropped after it."""
    pair = probes.get("code")
    codes: dict[str, bytes] = {}
    if isinstance(pair, list) and len(pair) == 2 and pair[0] == _MAGIC \
            and isinstance(pair[1], dict):
        codes = {k: v for k, v in pair[1].items()
                 if isinstance(k, str) and isinstance(v, bytes)}
    if not codes or not install():
        yield 0
        return
    with _lock:
        _codes.update(codes)
    try:
        yield len(codes)
    finally:
        with _lock:
            for digest in codes:
                _codes.pop(digest, None)
