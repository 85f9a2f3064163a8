"""hotswap's use of torch internals, where the versions it supports (2.11 and 2.13) differ
or may: inductor's standalone compile and its saved artifacts, inductor's timed events,
dynamo's compile callbacks and recompile limits, intra-op threads. Keep version checks here.

Both versions expose ``torch._inductor.standalone_compile(gm, inputs, dynamic_shapes=...,
options=...)`` and ``CompiledArtifact.save/load(path=..., format="binary")``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

__all__ = [
    "TORCH_VERSION", "Buffer", "RecompileLimitHit", "UnsaveableArtifact", "artifact_from_bytes",
    "artifact_to_bytes", "dynamo_trace_start", "inductor_events", "intra_op_threads",
    "mark_static_inputs", "on_dynamo_compiles", "reset_with_dynamo", "standalone_compile",
    "static_input_indices",
    "watch_dynamo_traces", "watch_recompile_limits",
]

log = logging.getLogger("hotswap")

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

# Bytes as artifacts and their files arrive: a worker's result is a view into the pool's
# receive buffer, and nothing copies it out.
Buffer = bytes | bytearray | memoryview


def standalone_compile(gm: torch.fx.GraphModule, inputs: list[Any],
                       config_patches: dict[str, Any], *, dynamic: bool = False,
                       donate: bool = False) -> Any:
    """Compile for saving. ``dynamic``: the graph's placeholders carry symbolic fake values.
    ``donate``: inductor may take ``gm`` as it is instead of a deep copy, so the artifact
    reads and updates the very tensors ``gm`` holds.

    Training graphs must lower their backward now, while the artifact recorder runs: 2.13's
    standalone_compile forces that itself; on 2.11 the backward is lowered lazily (on GPU) and
    the saved artifact has no AOTAutograd entry, so force it here where the flag exists.
    """
    from torch._functorch import config as functorch_config
    from torch._inductor import standalone_compile as compile_

    patches = {}
    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        patches["force_non_lazy_backward_lowering"] = True
    donated: dict[str, Any] = {}
    if donate and _takes_donation():
        donated["donate_graph_module"] = True
    copied = contextlib.nullcontext() if donated else _marks_survive_copies(gm)
    with functorch_config.patch(patches), copied:
        return compile_(gm, inputs,
                        dynamic_shapes="from_graph" if dynamic else "from_example_inputs",
                        options={"config_patches": dict(config_patches)}, **donated)


@functools.cache
def _takes_donation() -> bool:
    """standalone_compile takes ``donate_graph_module`` (torch 2.13; 2.11 deep-copies)."""
    from torch._inductor import standalone_compile as compile_

    return "donate_graph_module" in inspect.signature(compile_).parameters


@contextlib.contextmanager
def _marks_survive_copies(gm: torch.fx.GraphModule) -> Iterator[None]:
    """Meanwhile, a deep copy of ``gm`` (inductor's, where it takes no donation) gets
    ``mark_static_inputs``'s marks too: a GraphModule's deep copy keeps its graph's node meta
    but drops the module's other attributes and the nodes' (AOTAutograd would then read every
    input as dynamic)."""
    sources = getattr(gm, "_param_name_to_source", None)
    if sources is None or not hasattr(gm, "_register_deepcopy_hook"):
        yield
        return

    def mark(copied: torch.fx.GraphModule) -> None:
        hooks = getattr(copied, "_deepcopy_hooks", [])
        if mark in hooks:  # the copy is pickled for inductor's caches
            hooks.remove(mark)
        copied._param_name_to_source = sources
        for node in copied.graph.find_nodes(op="placeholder"):
            node._dynamo_source = None

    gm._register_deepcopy_hook(mark)
    try:
        yield
    finally:
        gm._unregister_deepcopy_hook(mark)


def _param_keys(gm: torch.fx.GraphModule) -> list[str]:
    """The names AOTAutograd lifts from ``gm`` as its first inputs: its parameters, then its
    buffers (``aot_module_simplified``'s ``params_buffers``)."""
    return list({**dict(gm.named_parameters(remove_duplicate=False)),
                 **dict(gm.named_buffers(remove_duplicate=False))})


def static_input_indices(gm: torch.fx.GraphModule, n_inputs: int) -> list[int]:
    """The inputs AOTAutograd treats as static (addresses fixed: inductor neither checks nor
    copies them per call), read off ``gm`` as it reads them off a dynamo graph: ``gm``'s own
    parameters and buffers, then placeholders dynamo marked. Empty for a graph not from
    dynamo."""
    from torch._functorch._aot_autograd import frontend_utils

    keys = dict.fromkeys(_param_keys(gm)).keys()
    read = frontend_utils._try_get_metadata_from_dynamo
    try:  # 2.13 takes the arguments' descriptors too (read for exported graphs only)
        _, static = read(gm, keys, len(keys) + n_inputs, [])
    except TypeError:
        _, static = read(gm, keys, len(keys) + n_inputs)  # type: ignore[call-arg]
    return list(static)


def mark_static_inputs(gm: torch.fx.GraphModule, static: list[bool]) -> bool:
    """Mark ``gm`` (a dynamo graph rebuilt elsewhere, its meta gone) as dynamo does, so that
    AOTAutograd finds the placeholders flagged in ``static`` static, and the tensors ``gm``
    holds too (as dynamo's own). False, and ``gm`` left unmarked, where this torch reads
    them otherwise."""
    from torch._dynamo.source import ConstantSource

    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    names = _param_keys(gm)
    gm.meta["dynamo_compile_id"] = gm.meta.get("dynamo_compile_id")
    gm._param_name_to_source = {  # type: ignore[assignment]
        name: ConstantSource(f"hotswap.{name}") for name in names}
    for node, flag in zip(placeholders, static, strict=True):
        node._dynamo_source = None
        if flag:
            node.meta.setdefault("tensor_dict", {})["_dynamo_static_input_type"] = "unguarded"
    want = [*range(len(names)), *(len(names) + i for i, flag in enumerate(static) if flag)]
    try:
        ok = static_input_indices(gm, len(placeholders)) == want
    except Exception as e:  # an internal API
        log.debug("hotswap: static inputs not marked: %s: %s", type(e).__name__, e)
        ok = False
    if not ok:
        del gm.meta["dynamo_compile_id"], gm._param_name_to_source
        for node in placeholders:
            node.meta.get("tensor_dict", {}).pop("_dynamo_static_input_type", None)
    return ok


def compile_saveable(gm: torch.fx.GraphModule, inputs: list[Any],
                     config_patches: dict[str, Any], *, dynamic: bool = False) -> bytes:
    """``gm`` is donated (the worker's landed graph, used once): inductor's deep copy would
    drop the attributes that mark dynamo's static inputs (``mark_static_inputs``)."""
    return artifact_to_bytes(standalone_compile(gm, inputs, config_patches, dynamic=dynamic,
                                                donate=True))


class UnsaveableArtifact(RuntimeError):
    """Inductor compiled the graph, but its caches kept nothing to save (graphs with
    ``torch.cond`` and other control-flow operators: "Can't cache HigherOrderOperator")."""


def scratch_dir() -> str | None:
    """A worker's scratch directory (removed with it, however it ends), elsewhere None."""
    from hotswap.workers import scratch

    return os.environ.get(scratch.ENV)


def artifact_to_bytes(artifact: Any) -> bytes:
    with tempfile.TemporaryDirectory(prefix="hotswap-art-", dir=scratch_dir()) as tmp:
        path = os.path.join(tmp, "artifact.bin")
        try:
            artifact.save(path=path, format="binary")
        except RuntimeError as e:
            if "no artifact to save" not in str(e) and "no aot_autograd artifacts" not in str(e):
                raise
            raise UnsaveableArtifact(
                f"inductor compiled this graph but AOTAutograd kept nothing to save, so it "
                f"cannot travel back from a worker (torch: {e})") from e
        with open(path, "rb") as f:
            return f.read()


def artifact_from_bytes(data: Buffer) -> Callable[..., Any]:
    """Load a saved artifact, writing nothing that is on disk already: a warm start on a full
    disk must still load. ``CompiledArtifact.load`` reads a path, so the bytes go to an
    in-memory file (Linux) rather than a temporary one; it then writes the inductor and
    AOTAutograd cache entries the artifact carries, which ``_populate_missing`` leaves alone
    where the very bytes are there already."""
    from torch._inductor.standalone_compile import CompiledArtifact

    with _artifact_path(data) as path, _skipping_present_entries():
        loaded: Callable[..., Any] = CompiledArtifact.load(path=path, format="binary")
        return loaded


@contextlib.contextmanager
def _artifact_path(data: Buffer) -> Iterator[str]:
    """A path that reads as ``data``: an anonymous in-memory file where the OS has them (no
    disk, and nothing left behind however the process ends), else a temporary file."""
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is not None and os.path.isdir("/proc/self/fd"):
        try:
            fd = memfd_create("hotswap-artifact", getattr(os, "MFD_CLOEXEC", 0))
        except OSError:
            pass
        else:
            with open(fd, "wb") as f:
                f.write(data)
                f.flush()
                yield f"/proc/self/fd/{fd}"
            return
    with tempfile.TemporaryDirectory(prefix="hotswap-art-", dir=scratch_dir()) as tmp:
        path = os.path.join(tmp, "artifact.bin")
        with open(path, "wb") as f:
            f.write(data)
        yield path


# The cache entries a saved artifact carries that ``CompiledArtifact.load`` writes to disk, by
# artifact type: the class whose ``_get_tmp_dir_for_key(key)`` folder holds the entry, in a
# file named by the SHA-256 of its content (2.11 and 2.13 alike). Other types are written.
_ENTRY_CACHES = {
    "inductor": ("torch._inductor.codecache", "FxGraphCache"),
    "aot_autograd": ("torch._functorch._aot_autograd.autograd_cache", "AOTAutogradCache"),
}
_skipping = threading.local()
_populate_lock = threading.Lock()
_populate_hooked = False


@contextlib.contextmanager
def _skipping_present_entries() -> Iterator[None]:
    """Inside the block, this thread's ``load_cache_artifacts`` writes only entries that are
    missing (or differ): the load that follows reads them from disk either way, and rewriting
    one that is there failed with ENOSPC on a full disk, leaving a 0-byte temporary file of
    inductor's beside it on every start. Other threads' calls are not changed."""
    global _populate_hooked
    try:
        from torch.compiler._cache import CacheArtifactManager
    except ImportError:
        yield
        return
    with _populate_lock:
        if not _populate_hooked:
            real = CacheArtifactManager.populate_caches

            def populate_caches(artifacts: Any) -> Any:
                if getattr(_skipping, "active", False):
                    return _populate_missing(artifacts)
                return real(artifacts)

            CacheArtifactManager.populate_caches = staticmethod(populate_caches)  # type: ignore[method-assign]
            _populate_hooked = True
    _skipping.active = True
    try:
        yield
    finally:
        _skipping.active = False


def _populate_missing(artifacts: dict[str, list[Any]]) -> Any:
    """``CacheArtifactManager.populate_caches``, less the writes of entries already there."""
    from torch.compiler._cache import CacheInfo

    info = CacheInfo()
    for artifact in (a for group in artifacts.values() for a in group):
        info.add(artifact)
        if not _entry_present(artifact):
            artifact.populate_cache()
        elif artifact.type() == "inductor":
            # 2.13 also emits the entry's triton kernels here (writing only those missing);
            # 2.11 does it at lookup and has no such method.
            emit = getattr(_entry_cache(artifact), "_emit_triton_bundle", None)
            if emit is not None:
                emit(artifact.content)
    return info


def _entry_cache(artifact: Any) -> Any:
    import importlib

    module, name = _ENTRY_CACHES[artifact.type()]
    return getattr(importlib.import_module(module), name)


def _entry_present(artifact: Any) -> bool:
    """Whether the entry ``artifact`` would write is on disk with these very bytes."""
    if artifact.type() not in _ENTRY_CACHES:
        return False
    try:
        from torch._inductor.codecache import sha256_hash

        content = artifact.content
        path = os.path.join(_entry_cache(artifact)._get_tmp_dir_for_key(artifact.key),
                            sha256_hash(content))
        with open(path, "rb") as f:
            return os.fstat(f.fileno()).st_size == len(content) and f.read() == content
    except (OSError, ImportError, AttributeError):  # missing, or another torch's layout
        return False


def compiled_with(compiled: Any) -> tuple[str, dict[str, Any]] | None:
    """(backend name, its keyword arguments: mode, options) of what ``torch.compile(...,
    backend="name")`` returned, where this torch lets us see it; else None."""
    ctx = getattr(compiled, "dynamo_ctx", None)  # a module; a function keeps it in its closure
    for cell in getattr(compiled, "__closure__", None) or ():
        if ctx is not None:
            break
        with contextlib.suppress(ValueError):  # an empty cell
            if hasattr(cell.cell_contents, "callback"):
                ctx = cell.cell_contents
    backend = getattr(ctx, "callback", None)
    for _ in range(8):  # CatchErrorsWrapper -> ConvertFrame -> ... -> _TorchCompileWrapper
        if backend is None:
            return None
        name, kwargs = getattr(backend, "compiler_name", None), getattr(backend, "kwargs", None)
        if isinstance(name, str) and isinstance(kwargs, dict):
            return name, kwargs
        backend = getattr(backend, "_torchdynamo_orig_backend", None)
    return None


def current_compile_id() -> str:
    """Dynamo's compile id of the frame being compiled now ("" outside a compile)."""
    try:
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
    except Exception:  # an internal API
        return ""
    return str(compile_id) if compile_id is not None else ""


def under_compile_id(compile_id: str) -> contextlib.AbstractContextManager[Any]:
    """Run a compile as part of the caller's frame ``compile_id`` (structured trace logs,
    tlparse); nothing when it is empty or this torch cannot parse it."""
    try:
        from torch._guards import CompileContext, CompileId, compile_context

        parsed = CompileId.from_string(compile_id) if compile_id else None
    except Exception:  # an internal API
        parsed = None
    if parsed is None:
        return contextlib.nullcontext()
    return compile_context(CompileContext(parsed))


@contextlib.contextmanager
def intra_op_threads(num_threads: int | None) -> Iterator[None]:
    """Run with the caller's intra-op thread count. Inductor's C++ code generation reads it
    (a kernel for one thread is not parallelized; one for fewer threads than cores hardcodes
    ``num_threads``), and CPU benchmarks must time what the caller will run."""
    if num_threads is None or num_threads == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def inductor_events(min_s: float = 1e-4) -> Iterator[list[tuple[str, float, float]]]:
    """Collect inductor's own timed events (``dynamo_timed``: lowering, codegen, autotuning,
    C++/triton compiles, artifact save) as ``(name, start_s, end_s)`` on the monotonic clock.

    Every ``dynamo_timed`` block ends in ``ChromiumEventLogger.log_event_end(name, end_ns,
    metadata, start_ns, ...)``; we observe that call on the process's logger for the duration
    of the block (but for a worker's work beside its jobs: its header build, jobs/compile.py).
    Where the logger differs (another torch), nothing is collected.
    """
    events: list[tuple[str, float, float]] = []
    try:
        from torch._dynamo.utils import get_chromium_event_logger

        logger = get_chromium_event_logger()
        original = logger.log_event_end
    except (ImportError, AttributeError):
        yield events
        return
    offset_ns = time.time_ns() - time.monotonic_ns()  # dynamo_timed reads time.time_ns()
    min_ns = int(min_s * 1e9)

    from hotswap.workers.child import is_beside_jobs

    def log_event_end(event_name: str, time_ns: int, *args: Any, **kwargs: Any) -> Any:
        start_ns = kwargs.get("start_time_ns", args[1] if len(args) > 1 else None)
        if (isinstance(start_ns, int) and time_ns - start_ns >= min_ns
                and not is_beside_jobs()):  # a worker's work beside the job: not its
            events.append((str(event_name), (start_ns - offset_ns) / 1e9,
                           (time_ns - offset_ns) / 1e9))
        return original(event_name, time_ns, *args, **kwargs)

    logger.log_event_end = log_event_end  # type: ignore[method-assign]
    try:
        yield events
    finally:
        with contextlib.suppress(AttributeError):
            del logger.log_event_end  # the class's method shows through again


_trace_starts = threading.local()
_watch_lock = threading.Lock()


def _trace_compiling(started: bool) -> None:
    if started:
        _trace_starts.start_s = time.monotonic()


def watch_dynamo_traces() -> None:
    """Note when dynamo starts compiling a frame (per thread), so the backend can time the
    trace that led to it. Idempotent; ``torch._dynamo.reset()`` drops it (call again after:
    the backend does at each graph). A torch without the callback API records nothing."""
    on_dynamo_compiles(_trace_compiling)


def dynamo_trace_start() -> float | None:
    """When dynamo started the compile now calling the backend in this thread (or None),
    once: a second backend call of the same compile, or one whose compile started while no
    callback was registered, gets None rather than an older compile's start."""
    start: float | None = getattr(_trace_starts, "start_s", None)
    _trace_starts.start_s = None
    return start


@dataclass(frozen=True)
class RecompileLimitHit:
    """Dynamo hit one of its recompile limits: a frame it would have compiled once more runs
    plain eager from now on (2.11 and 2.13: ``recompile_limit``, 8 by default, per code object,
    or ``accumulated_recompile_limit``; ``cache_size_limit`` in older torch)."""

    limit_name: str   # the config name: torch._dynamo.config.<limit_name>
    limit: Any
    function: str     # "'forward' (model.py:12)"
    reason: str       # the last guard that failed, as dynamo words it
    backend: Any      # the torch.compile backend of the call (innermost), or None if unknown

    def note(self, times: int) -> str:
        """What ``hotswap.status`` says of it: what happened, and the fix."""
        reason = self.reason if len(self.reason) <= 300 else self.reason[:297] + "..."
        return (f"dynamo hit torch._dynamo.config.{self.limit_name} ({self.limit}) for "
                f"{self.function} {times} time(s): those calls run plain eager, outside "
                f"hotswap (last reason: {reason}). Raise "
                f"torch._dynamo.config.{self.limit_name}, or mark the dimension that changes "
                "dynamic")


_limit_watchers: list[Callable[[RecompileLimitHit], None]] = []
_HIT_PREFIX = "torch._dynamo hit config."


class _RecompileLimitFilter(logging.Filter):
    """Dynamo says so in one WARNING on ``torch._dynamo.convert_frame`` (the same words and
    arguments from 2.1 to 2.13): its arguments are the limit's config name, its value, the
    function and the last failed guard. The filter lets the record through."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(_HIT_PREFIX):
            args = record.args if isinstance(record.args, tuple) else ()
            if len(args) >= 4:
                hit = RecompileLimitHit(str(args[0]), args[1], str(args[2]), str(args[3]),
                                        _compiling_backend())
                for watcher in list(_limit_watchers):
                    with contextlib.suppress(Exception):  # never in the way of dynamo's call
                        watcher(hit)
        return True


def watch_recompile_limits(watcher: Callable[[RecompileLimitHit], None]) -> None:
    """Call ``watcher(hit)`` whenever dynamo hits a recompile limit in this process (in the
    thread that hit it). Idempotent per watcher. Where dynamo's logger is turned below
    WARNING (``TORCH_LOGS="-dynamo"``) nothing is seen."""
    with _watch_lock:
        if watcher in _limit_watchers:
            return
        if not _limit_watchers:
            logging.getLogger("torch._dynamo.convert_frame").addFilter(_RecompileLimitFilter())
        _limit_watchers.append(watcher)


def on_dynamo_compiles(callback: Callable[[bool], None]) -> None:
    """Have dynamo call ``callback(True)`` as it begins compiling and ``callback(False)`` as
    it ends (``torch._dynamo.callback_handler``: a frame's compile, a lazy backward's, a CUDA
    graph's recording; process-wide, compiles that overlap counted as one, so the two may
    come on different threads). Idempotent; ``torch._dynamo.reset()`` drops it (call again
    after). Nothing where this torch has no such handler."""
    import torch._dynamo

    handler = getattr(torch._dynamo, "callback_handler", None)
    if handler is None:
        return
    start, end = _compile_callbacks.setdefault(callback, (
        lambda *_: callback(True), lambda *_: callback(False)))
    if start not in handler.start_callbacks:
        handler.register_start_callback(start)
    if end not in handler.end_callbacks:
        handler.register_end_callback(end)


# callback -> the (start, end) functions registered for it (registered once each)
_compile_callbacks: dict[Callable[[bool], None], tuple[Callable[[Any], None],
                                                       Callable[[Any], None]]] = {}


def reset_with_dynamo(backend: Any) -> None:
    """Have ``torch._dynamo.reset()`` (``torch.compiler.reset()``) call ``backend.reset()``.
    Dynamo calls it on the backends given to ``torch.compile`` since its last reset
    (``eval_frame.cached_backends``, in every torch 2.x); a backend whose model, compiled
    before a reset, is called again gets graphs without being given again: adding it here
    lets the next reset reach it too."""
    from torch._dynamo import eval_frame

    backends = getattr(eval_frame, "cached_backends", None)
    if isinstance(backends, dict):
        backends.setdefault(id(backend), backend)


def _compiling_backend() -> Any:
    """The backend of the frame dynamo is compiling in this thread: ``compiler_fn`` of
    convert_frame's ``_compile`` (its name in every torch 2.x), unwrapped as
    ``eval_frame.innermost_backend`` does; None where it is not found."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_compile" and "compiler_fn" in frame.f_code.co_varnames:
            backend = frame.f_locals.get("compiler_fn")
            for _ in range(8):
                inner = getattr(backend, "_torchdynamo_orig_backend", None)
                if inner is None:
                    return backend
                backend = inner
            return backend
        frame = frame.f_back
    return None
