"""Inductor's kernel templates, compiled once per machine instead of once per process.

Importing inductor's kernel modules builds its kernel templates (``TritonTemplate(...)`` at
module level: mm, bmm, convolution, flex attention, ...), each a Jinja2 template compiled
from its source: Jinja2 lexes, parses and generates a Python module in Python, then
``compile()`` holds the GIL for the generated source (up to 40 KB). On the CPU box 23
templates took 0.17-0.18 s of the load path's 0.86-0.94 s of imports (torch 2.13), and twice
that under 3.11's trace function, which the warm-up's imports run under beside the user's
calls; on the GPU machine each large one was a GIL hold of its own in the serving process.

``install()`` makes inductor's Jinja2 environment (``codegen.common.jinja2_env()``, the one
every ``_template_from_string`` uses) a ``_CachingEnvironment`` (``_caching_class``), whose ``compile`` keeps
what it compiles in hotswap's cache::

    <cache dir>/templates-<implementation>-<version>/<digest>.code     mode 0700 / 0600

and takes it from there the next time: the first process that compiles a template (a compile
worker, or the serving process's warm-up) writes it, every later one reads it. A process whose
folder lacks one reads it from the compile service's (``bytecode.offer_templates``: its
status names the folder its workers write) and keeps a copy in its own. The digest
covers the source and everything Jinja2's code generation reads besides it, looked at on
each compile: the environment's settings, its ``undefined`` class, the filters and tests
registered then (Jinja2 runs filters on constants while it compiles), the Jinja2, torch and
Python bytecode versions. An environment with extensions, or a setting that is a function,
compiles as before. A file holds a format tag and the SHA-256 of the marshalled code after
it; one that does not match (cut short, damaged) is compiled again and written over.

A code object read is executed, so the folder is used only where the cache is this user's
and writable by no one else (``hotswap.cache.trust``), and each file only if this user owns
it and no one else may write it. A torch without that environment, or a Jinja2 without
``Environment.compile``, is left as it is, and so is every process where
``HOTSWAP_PYCACHE=off``. Nothing here raises: the templates then compile as before.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import logging
import marshal
import os
import sys
import threading
from pathlib import Path
from types import CodeType
from typing import Any

from hotswap import settings
from hotswap.cache.store import write_atomic
from hotswap.cache.trust import check_private_dir, check_way, open_private
from hotswap.system import bytecode

__all__ = ["counts", "folder", "install"]

log = logging.getLogger("hotswap")

_FORMAT = b"hotswap-template-1\n"
_DIGEST_BYTES = 32
# Code objects are for one Python bytecode version and optimization level (-O drops asserts)
_MAGIC = f"{importlib.util.MAGIC_NUMBER.hex()}-O{sys.flags.optimize}"
# What Jinja2's code generation reads from its environment besides the source
_SETTINGS = ("block_start_string", "block_end_string", "variable_start_string",
             "variable_end_string", "comment_start_string", "comment_end_string",
             "line_statement_prefix", "line_comment_prefix", "trim_blocks", "lstrip_blocks",
             "newline_sequence", "keep_trailing_newline", "optimized", "is_async",
             "autoescape", "finalize")

_lock = threading.Lock()
_folder: Path | None = None  # where install() found the folder usable
# templates taken from a folder (of them, from the compile service's), and compiled here
_counts = {"read": 0, "offered": 0, "compiled": 0}


def counts() -> dict[str, int]:
    """How many templates this process read from a folder (``offered``: of those, from the
    compile service's) and compiled itself."""
    return dict(_counts)


def folder() -> Path | None:
    """This Python's template folder in hotswap's cache, made and checked (None: it cannot be
    used here, this Python keeps no bytecode, or HOTSWAP_PYCACHE is off)."""
    try:
        settings.pycache()  # a value it does not know raises, said below
        where = bytecode.templates_folder()
        return bytecode.claim_folder(where) if where is not None else None
    except (OSError, ValueError) as e:  # trust.UntrustedPath is a PermissionError
        log.debug("hotswap: inductor's templates compile as before: %s", e)
        return None


# The compile service's template folders (``bytecode.offer_templates``: its status names the
# one its workers write), each checked once, as the cache's own folders are: a template this
# process's own folder lacks is read from one of them, then kept in its own.
_trusted: dict[Path, bool] = {}


def _from_offered(name: str) -> CodeType | None:
    for where in bytecode.offered_templates():
        trusted = _trusted.get(where)
        if trusted is None:
            try:
                check_private_dir(where)
                check_way(where.parent)
                trusted = True
            except FileNotFoundError:  # its workers have not made it yet: looked at again
                continue
            except (OSError, ValueError) as e:  # UntrustedPath is a PermissionError
                log.debug("hotswap: the compile service's templates are not read: %s", e)
                trusted = False
            _trusted[where] = trusted
        if trusted and where != _folder and (code := _read(where / name)) is not None:
            return code
    return None


def install() -> bool:
    """Make inductor's Jinja2 environment keep its compiled templates (once per process);
    whether it does. Never raises."""
    global _folder
    try:
        from torch._inductor.codegen import common

        make_env = getattr(common, "jinja2_env", None)
        env = make_env() if callable(make_env) else None
        if env is None:
            return False
        with _lock:
            caching = _caching_class()
            if type(env) is caching:
                return True
            if type(env) is not caching.__base__:  # someone's subclass: left alone
                return False
            where = folder()
            if where is None:
                return False
            _folder = where
            env.__class__ = caching
        return True
    except Exception as e:  # the templates compile as before, that is all
        log.debug("hotswap: inductor's templates compile as before: %s: %s",
                  type(e).__name__, e)
        return False


def _named(value: Any) -> str:
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}"


def _key(env: Any) -> str | None:
    """What Jinja2's code generation reads besides the source, as text; None where some of it
    is the user's code in a form that cannot be named (a setting that is a function, an
    extension)."""
    values = [getattr(env, name, None) for name in _SETTINGS]
    if any(callable(v) for v in values) or getattr(env, "extensions", None):
        return None

    def registered(table: Any) -> list[tuple[str, str, str]]:
        return sorted((str(name), _named(fn), str(getattr(fn, "jinja_pass_arg", "")))
                      for name, fn in dict(table).items())

    return repr((_FORMAT, _version("jinja2"), _version("torch"), _MAGIC,
                 _named(type(env)), _named(env.undefined), values,
                 registered(env.filters), registered(env.tests)))


@functools.cache  # 0.8 ms a look-up: once per process, not per template
def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "?"


@functools.cache
def _caching_class() -> type:
    """``_CachingEnvironment``: made on first use (Jinja2 is imported with inductor, not with
    hotswap)."""
    import jinja2

    class _CachingEnvironment(jinja2.Environment):
        """Jinja2's environment whose ``compile`` of a template's source alone (what
        ``from_string`` asks) goes through the folder; an overlay is one too, and keys its
        own settings. Any other call is Jinja2's own."""

        def compile(self, source: Any, name: str | None = None,
                    filename: str | None = None, raw: bool = False,
                    defer_init: bool = False) -> Any:
            where = _folder
            key = None if where is None or not isinstance(source, str) or name is not None \
                or filename is not None or raw or defer_init else _key(self)
            if where is None or key is None:
                own: Any = super().compile  # its overloads, by raw's literal value
                return own(source, name, filename, raw, defer_init)
            text = f"{key}\0{source}".encode("utf-8", "surrogatepass")
            path = where / f"{hashlib.sha256(text).hexdigest()}.code"
            code = _read(path)
            if code is not None:
                _counts["read"] += 1
                return code
            code = _from_offered(path.name)
            if code is not None:
                _counts["read"] += 1
                _counts["offered"] += 1
                _write(path, code)
                return code
            code = super().compile(source)
            _counts["compiled"] += 1
            if isinstance(code, CodeType):
                _write(path, code)
            return code

    return _CachingEnvironment


def _read(path: Path) -> CodeType | None:
    """The code in ``path``; None where it is missing, refused, or not what was written."""
    try:
        fd = open_private(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as e:  # another user's, or writable by others: not run, compiled instead
        log.debug("hotswap: a template's code in the cache was refused: %s", e)
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        head = len(_FORMAT)
        digest, payload = data[head:head + _DIGEST_BYTES], data[head + _DIGEST_BYTES:]
        if not data.startswith(_FORMAT) or hashlib.sha256(payload).digest() != digest:
            return None  # cut short or damaged: compiled again, written over
        code = marshal.loads(payload)
    except Exception as e:
        log.debug("hotswap: a template's code in the cache could not be read: %s", e)
        return None
    return code if isinstance(code, CodeType) else None


def _write(path: Path, code: CodeType) -> None:
    """Write it whole under a temporary name, then rename (a reader never sees half)."""
    payload = marshal.dumps(code)
    try:
        write_atomic(path, _FORMAT, hashlib.sha256(payload).digest(), payload, durable=False)
    except OSError as e:  # a full disk costs the next process the compile, nothing else
        log.debug("hotswap: could not keep a template's code: %s", e)
