"""Inductor's kernel templates, compiled once per machine instead of once per process.

Importing inductor's kernel modules builds its kernel templates (``TritonTemplate(...)`` at
module level: mm, bmm, convolution, flex attention, ...), each a Jinja2 template compiled
from its source: Jinja2 lexes, parses and generates a Python module in Python, then
``compile()`` holds the GIL for the generated source (up to 40 KB). On the CPU box 23
templates took 0.17-0.18 s of the load path's 0.86-0.94 s of imports (torch 2.13), and more
beside the user's calls, where the warm-up yields; on the GPU machine each large one was a
GIL hold of its own in the serving process (the bench's probe saw them compiled).

``install()`` gives inductor's Jinja2 environment (``codegen.common.jinja2_env()``, the one
every ``_template_from_string`` uses) a ``compile`` that keeps what it compiles, marshalled,
in hotswap's cache::

    <cache dir>/templates-<implementation>-<version>/<digest>.code     mode 0700 / 0600

keyed by the template's source, Jinja2's version, the environment's settings and Python's
bytecode version, and takes it from there the next time: the first process that compiles a
template (a compile worker, or the serving process's warm-up) writes it, every later one
reads it. A code object read is executed, so the folder is used only where the cache is this
user's and writable by no one else (``hotswap.cache.trust``), and each file only if this user
owns it and no one else may write it; anything else compiles as before. A torch without that
environment, or a Jinja2 without ``Environment.compile``, is left as it is, and so is every
process where ``HOTSWAP_PYCACHE=off``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import marshal
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import CodeType
from typing import Any

from hotswap import settings
from hotswap.cache.root import claim_root, default_cache_dir
from hotswap.cache.store import FORMAT_VERSION
from hotswap.cache.trust import ensure_private_dir, open_private

__all__ = ["folder", "install"]

log = logging.getLogger("hotswap")

# Code objects are for one Python bytecode version and optimization level (-O drops asserts)
_MAGIC = f"{importlib.util.MAGIC_NUMBER.hex()}-O{sys.flags.optimize}"
# What Jinja2's code generation reads from its environment besides the source
_SETTINGS = ("block_start_string", "block_end_string", "variable_start_string",
             "variable_end_string", "comment_start_string", "comment_end_string",
             "line_statement_prefix", "line_comment_prefix", "trim_blocks", "lstrip_blocks",
             "newline_sequence", "keep_trailing_newline", "optimized", "is_async",
             "autoescape", "finalize")

_lock = threading.Lock()
_installed: set[int] = set()  # id() of the environments given the cached compile


def folder() -> Path | None:
    """This Python's template folder in hotswap's cache, made and checked (None: it cannot be
    used here, this Python keeps no bytecode, or HOTSWAP_PYCACHE is off)."""
    tag = sys.implementation.cache_tag
    if not tag:
        return None
    try:
        if settings.pycache() == "off":
            return None
        root = claim_root(default_cache_dir(), FORMAT_VERSION)
        path = root / f"templates-{tag}"
        ensure_private_dir(path)
    except (OSError, ValueError) as e:  # trust.UntrustedPath is a PermissionError
        log.debug("hotswap: inductor's templates compile as before: %s", e)
        return None
    return path


def install() -> bool:
    """Give inductor's Jinja2 environment the cached compile (once per process); whether it
    has it."""
    try:
        from torch._inductor.codegen import common
    except ImportError:
        return False
    make_env = getattr(common, "jinja2_env", None)
    env = make_env() if callable(make_env) else None
    compile_source = getattr(env, "compile", None)
    if env is None or not callable(compile_source):
        return False
    with _lock:
        if id(env) in _installed:
            return True
        key = _settings_key(env)
        where = folder() if key is not None else None
        if key is None or where is None:
            return False
        env.compile = _CachedCompile(compile_source, where, key)
        _installed.add(id(env))
    return True


def _settings_key(env: Any) -> str | None:
    """The environment's settings as text, or None where one is a function of the user's (a
    ``finalize``, an ``autoescape`` callback, an extension: their code is not in the key)."""
    import jinja2

    values = [getattr(env, name, None) for name in _SETTINGS]
    if any(callable(v) for v in values) or getattr(env, "extensions", None):
        return None
    return repr((jinja2.__version__, _MAGIC, type(env).__qualname__, values))


class _CachedCompile:
    """``Environment.compile`` for a template's source alone (what ``from_string`` asks),
    through the folder; any other call goes to Jinja2's own."""

    def __init__(self, compile_source: Any, where: Path, settings: str) -> None:
        self._compile, self._where, self._settings = compile_source, where, settings
        self.read = self.compiled = 0  # templates taken from the folder, and compiled here

    def __call__(self, source: Any, name: str | None = None, filename: str | None = None,
                 raw: bool = False, defer_init: bool = False) -> Any:
        if not isinstance(source, str) or name is not None or filename is not None or raw \
                or defer_init:
            return self._compile(source, name, filename, raw, defer_init)
        digest = hashlib.sha256(f"{self._settings}\0{source}".encode()).hexdigest()
        path = self._where / f"{digest}.code"
        code = _read(path)
        if code is not None:
            self.read += 1
            return code
        code = self._compile(source)
        self.compiled += 1
        if isinstance(code, CodeType):
            _write(path, code)
        return code


def _read(path: Path) -> CodeType | None:
    try:
        fd = open_private(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as e:  # another user's, or writable by others: not run, compiled instead
        log.debug("hotswap: a template's code in the cache was refused: %s", e)
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    try:
        code = marshal.loads(data)
    except (EOFError, ValueError, TypeError):  # cut short: compiled again, written over
        return None
    return code if isinstance(code, CodeType) else None


def _write(path: Path, code: CodeType) -> None:
    """Write it whole under a temporary name, then rename (a reader never sees half)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(marshal.dumps(code))
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:  # a full disk costs the next process the compile, nothing else
        log.debug("hotswap: could not keep a template's code: %s", e)
