"""Public API: ``hotswap.compile``, ``backend``, ``prepare``, ``status``, ``wait``, ``runtime``,
``shutdown``, and the ``torch.compile(backend="hotswap")`` entry point."""

from __future__ import annotations

import dataclasses
import importlib
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from hotswap import compat
from hotswap.counting import bump
from hotswap.engine import threads
from hotswap.engine.coordinator import Coordinator
from hotswap.engine.journey import Statuses
from hotswap.engine.loading.warmup import start_warmup, wait_warmup
from hotswap.engine.options import MODES, Options, split_torch_options
from hotswap.engine.runtime import Runtime
from hotswap.engine.runtime import runtime as _runtime
from hotswap.errors import WaitTimeout
from hotswap.system import heap

__all__ = ["backend", "compile", "hotswap_backend", "prepare", "runtime", "shutdown", "status",
           "wait"]

_by_compiled: weakref.WeakKeyDictionary[Any, Coordinator] = weakref.WeakKeyDictionary()
_all: weakref.WeakSet[Coordinator] = weakref.WeakSet()
_entry_point: dict[str, Coordinator] = {}
# hotswap.compile's backends, one per (options, the model's code): dynamo keeps what it
# compiled per code object, guarded by the backend, so a new backend per compile meant a new
# trace of the same code each time, and past torch._dynamo.config.recompile_limit (8) the
# calls of every further model ran plain eager. Held for good, as dynamo holds every backend.
_shared: dict[tuple[Any, ...], Coordinator] = {}
# Recompile limits hit where no hotswap backend could be told apart: every status shows them.
_unattributed: dict[tuple[str, str], tuple[int, compat.RecompileLimitHit]] = {}
_lock = threading.Lock()


def backend(**options: Any) -> Coordinator:
    """A dynamo backend: ``torch.compile(model, backend=hotswap.backend(mode="async"))``.

    Takes the options of :func:`compile` except ``dynamic`` and ``fullgraph`` (torch.compile's).
    """
    _watch_limits()
    coordinator = Coordinator(Options.create(**options))
    _all.add(coordinator)
    return coordinator


def _options_key(options: Options) -> tuple[Any, ...]:
    """Options as a key: equal for options that compile alike. A tier's config is a dict
    (its items, sorted, stand for it); a ``distributed.Client`` executor is not hashable and
    stands for itself (the registry holds it, so its id is not reused)."""
    key: list[Any] = []
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if f.name == "tiers":
            value = tuple((t.name, repr(sorted(t.config.items())), t.cudagraphs) for t in value)
        elif f.name == "executor" and value is not None and not isinstance(value, str):
            value = ("object", id(value))
        key.append((f.name, value))
    return tuple(key)


def _code_of(model: Any) -> Any:
    """What dynamo's cache of ``model``'s frames depends on: a module's class (its forward),
    a function's code (every closure made by one ``def`` shares it)."""
    if isinstance(model, torch.nn.Module):
        return type(model)
    return getattr(model, "__code__", None) or type(model)


def _shared_backend(options: Options, model: Any) -> Coordinator:
    """The backend ``hotswap.compile`` gives ``model``: the one every earlier model of the
    same code got with equal options (a new one after ``torch._dynamo.reset()``)."""
    key = (_options_key(options), _code_of(model))
    with _lock:
        coordinator = _shared.get(key)
        if coordinator is not None and not coordinator.reset_by_dynamo:
            return coordinator
    coordinator = Coordinator(options)  # starts a pool: outside the lock
    with _lock:
        current = _shared.get(key)
        if current is not None and not current.reset_by_dynamo:
            return current  # another thread made one meanwhile: the first one stands
        _shared[key] = coordinator
        _all.add(coordinator)
    return coordinator


def compile(
    model: Any,
    *,
    mode: str | None = None,
    tiers: Any = None,
    workers: int | None = None,
    cache_dir: str | None = None,
    timeout_s: float | None = None,
    verify: bool = False,
    on_failure: str = "stay",
    dynamic: bool | None = None,
    fullgraph: bool = False,
    gate: bool = True,
    gate_threshold: float | None = None,
    force_tier: str | None = None,
    profile_dir: str | None = None,
    executor: Any = None,
    cache_url: str | None = None,
    worker_devices: Any = None,
    regions: str | None = None,
    options: dict[str, Any] | None = None,
) -> Any:
    """Compile ``model`` (a module or function) like ``torch.compile``, without blocking.

    mode: "progressive" (default; HOTSWAP_MODE): eager at once, then each tier of the ladder
          as workers finish it; "async": eager, then one tier; "subprocess": the first call
          waits for a worker's artifact; "inprocess": plain inductor in this process.
    tiers: preset names ("default", "max-autotune", "max-autotune-no-cudagraphs") or
          {"name": ..., "config": {inductor config patches}}; HOTSWAP_TIERS as "a,b".
    on_failure: "stay" (a failed tier leaves the graph where it is; see status) or "raise".
    verify: compare a new tier's first output with the previous tier's; reject on mismatch.
    gate: progressive mode benchmarks each later tier against the serving one (in a worker)
          and swaps only if it is ``gate_threshold`` faster (default 0.02, i.e. 2 %;
          HOTSWAP_GATE_THRESHOLD); a tier kept out shows in ``status(...).kept`` with numbers.
    profile_dir: record a profile of this run there (HOTSWAP_PROFILE_DIR): every stage of every
          graph and tier, every call, tier benchmarks and kernel breakdowns; read it with
          ``hotswap profile report DIR``.
    executor: where compiles and gate benchmarks run: None or "local" (the worker pool), a
          Dask scheduler ("dask://host:8786") or a ``distributed.Client`` (HOTSWAP_EXECUTOR).
    cache_url: a Redis store the fleet shares ("redis://host:6379/0"; HOTSWAP_CACHE_URL),
          signed with the key in HOTSWAP_CACHE_KEY_FILE; the local cache stays in front.
    worker_devices: the GPU each local worker compiles and benchmarks on (["cuda:1"]: off the
          serving GPU; HOTSWAP_WORKER_DEVICES).
    regions: "auto" (default; HOTSWAP_REGIONS): in progressive (and in async where jobs go
          to the compile service, with HOTSWAP_PARTS=1), a graph that repeats a block (a
          transformer's layers) is first served region by region, each distinct block
          compiled once, until the whole graph replaces it (a rung of its own,
          "default-regions"); "on": in async always; "off": never. docs/regions.md. In async
          with the compile service, the tier compiles in two parts at once on two warm
          workers instead (HOTSWAP_PARTS; docs/service.md).
    options: inductor config patches, as ``torch.compile(options=...)`` takes them
          ({"max_autotune": True, "epilogue_fusion": False}): applied to every tier, over the
          tier's own config where both set a key, as torch applies them over its mode's;
          "triton.cudagraphs" makes every tier serve through CUDA graphs. One tier's own
          config goes in ``tiers``.
    """
    if not callable(model):
        raise ValueError(f"hotswap.compile takes a torch.nn.Module or a function, got {model!r}")
    made = Options.create(mode=mode, tiers=tiers, workers=workers, cache_dir=cache_dir,
                          timeout_s=timeout_s, verify=verify, on_failure=on_failure,
                          dynamic=dynamic, fullgraph=fullgraph, gate=gate,
                          gate_threshold=gate_threshold, force_tier=force_tier,
                          profile_dir=profile_dir, executor=executor, cache_url=cache_url,
                          worker_devices=worker_devices, regions=regions, options=options)
    _watch_limits()
    coordinator = _shared_backend(made, model)
    compiled = torch.compile(model, backend=coordinator, dynamic=made.dynamic,
                             fullgraph=made.fullgraph)
    with _lock:
        _by_compiled[compiled] = coordinator
    return compiled


def prepare(*, workers: int | None = None, devices: Iterable[str] | None = None,
            wait: bool = False, timeout_s: float | None = None,
            worker_devices: Any = None, executor: Any = None) -> bool:
    """Start the compile workers and warm this process's load path now, so that the first
    swap neither waits for nor competes with one-time costs (a worker's start: its imports,
    then the CUDA context or the CPU vector-ISA probe; here: about 1.5 s of imports). Call it
    first thing, before building the model, so a worker's start overlaps with the model's
    construction; ``hotswap.compile`` does the same on its own, later. Without ``wait`` the
    pool's first worker starts (it grows on demand: docs/pool.md); ``wait=True`` starts and
    waits for all of them.

    workers, worker_devices: the pool to start (as ``hotswap.compile(...)``); executor: a
    cluster to connect to instead (as ``hotswap.compile(executor=...)``). devices: those the
    graphs will run on (default "cuda" when available, else "cpu"). wait: block until the
    workers are ready and the warm-up is done, or ``timeout_s`` passes. Returns whether
    everything is ready (always True without ``wait``).
    """
    options = Options.create(workers=workers, worker_devices=worker_devices,
                             executor=executor)  # the same checks as compile()
    if devices is None:
        devices = ["cuda"] if torch.cuda.is_available() else ["cpu"]
    devices = [str(d) for d in devices]
    unknown = [d for d in devices if d.split(":")[0] not in ("cpu", "cuda")]
    if unknown:
        raise ValueError(f"devices must be 'cpu' or 'cuda[:N]', got {unknown}")
    # With a cluster (executor=, HOTSWAP_EXECUTOR): connect to it instead of starting workers.
    cluster = _runtime.cluster(options.executor) if options.executor is not None else None
    pool = _runtime.pool(workers, options.worker_devices) if cluster is None else None
    importlib.import_module("torch._dynamo")  # here, before the warm-up thread (warmup.py)
    _watch_limits()  # a reset thaws what the warm-up freezes
    compat.on_dynamo_compiles(threads.dynamo_compiling)  # the warm-up defers to the traces
    start_warmup(devices)
    if not wait:
        return True
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining() -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    if pool is not None:
        ready = pool.wait_ready(remaining())
    else:
        assert cluster is not None
        ready = cluster.client(remaining()) is not None
    return wait_warmup(devices, remaining()) and ready


# torch.compile's ``mode=`` through ``backend="hotswap"``: the top of the ladder it climbs.
# (torch passes no mode for "default" or none; then hotswap's own default ladder applies.)
TORCH_MODES: dict[str, tuple[str, ...]] = {
    "default": ("default",),
    "max-autotune": ("default", "max-autotune"),
    "max-autotune-no-cudagraphs": ("default", "max-autotune-no-cudagraphs"),
    # CUDA graphs captured in the serving process after the swap (cudagraphs.py)
    "reduce-overhead": ("default", "reduce-overhead"),
}


def _torch_mode_options(mode: str) -> dict[str, Any]:
    if mode in MODES:
        raise ValueError(f"mode={mode!r} is torch.compile's mode= ({', '.join(TORCH_MODES)}): "
                         "it picks the top tier. hotswap's scheduling mode goes in options: "
                         f"torch.compile(m, backend='hotswap', options={{'mode': {mode!r}}})")
    if mode not in TORCH_MODES:
        raise ValueError(f"unknown torch.compile mode {mode!r}; hotswap takes "
                         f"{list(TORCH_MODES)}")
    return {"tiers": list(TORCH_MODES[mode])}


def _entry_key(options: dict[str, Any] | None, mode: str | None
               ) -> tuple[str, dict[str, Any]]:
    """The entry point's coordinator key and ``Options.create``'s keywords: hotswap's own
    options by name, every other key an inductor config patch (options.py)."""
    opts = dict(options or {})
    if mode is not None:
        opts.update(_torch_mode_options(mode))
    return repr(sorted(opts.items())), split_torch_options(opts)


def hotswap_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], *,
                    options: dict[str, Any] | None = None, mode: str | None = None) -> Any:
    """``torch.compile(m, backend="hotswap", mode=..., options={...})``, registered as an
    entry point. ``mode`` is torch.compile's: it picks the top of the ladder; hotswap's own
    options (its scheduling ``mode`` among them) go in ``options``, beside inductor config
    keys (``hotswap.compile``'s ``options``), which every tier compiles under."""
    _watch_limits()
    key, opts = _entry_key(options, mode)
    with _lock:
        coordinator = _entry_point.get(key)
        if coordinator is None:
            coordinator = _entry_point[key] = Coordinator(Options.create(**opts))
            _all.add(coordinator)
    return coordinator(gm, example_inputs)


def _coordinators(compiled: Any) -> list[Coordinator]:
    if compiled is None:
        with _lock:
            return list(_all)
    if isinstance(compiled, Coordinator):
        return [compiled]
    with _lock:
        found = _by_compiled.get(compiled)
        by_name = list(_entry_point.values())
    if found is not None:
        return [found]
    if hasattr(compiled, "_torchdynamo_orig_callable") and by_name:
        # torch.compile(..., backend="hotswap"): its graphs went to the entry point's
        # coordinator of its mode and options (shared by every model compiled with those);
        # where torch does not show them (a compiled function), to every such coordinator.
        backend = compat.compiled_with(compiled)
        if backend is not None and backend[0] == "hotswap":
            try:
                key, _ = _entry_key(backend[1].get("options"), backend[1].get("mode"))
            except ValueError:  # a mode hotswap refused: none of its graphs got this far
                return []
            with _lock:
                mine = _entry_point.get(key)
            return [mine] if mine is not None else []
        return by_name
    raise ValueError(f"this {type(compiled).__name__} was not compiled by hotswap; pass what "
                     "hotswap.compile or torch.compile(..., backend='hotswap') returned, a "
                     "hotswap.backend(...) object, or nothing for every graph")


class _Forget:
    """Reset with dynamo (``torch.compiler.reset()``): the recompile limits hit so far go with
    the graphs (each coordinator forgets its own), idle workers may exit, and the heap the
    load path's warm-up froze is the collector's again (hotswap.system.heap), and no compile
    of dynamo's is under way (its reset drops the callback that would say one ended)."""

    def reset(self) -> None:
        with _lock:
            _unattributed.clear()
        _runtime.release_idle()
        heap.thaw()
        threads.dynamo_compiling(False)


_forget = _Forget()


def _watch_limits() -> None:
    compat.watch_recompile_limits(_recompile_limit_hit)
    compat.reset_with_dynamo(_forget)


def _recompile_limit_hit(hit: compat.RecompileLimitHit) -> None:
    """Dynamo hit a recompile limit: tell the entry point's backend of the call, or every
    status where the call's backend is unknown (a Coordinator's own are its own: coordinator.py)."""
    target = getattr(hit.backend, "compiler_fn", hit.backend)  # torch.compile's wrapper
    if isinstance(target, Coordinator):
        return
    if target is hotswap_backend:
        kwargs = getattr(hit.backend, "kwargs", {})
        try:
            key, _ = _entry_key(kwargs.get("options"), kwargs.get("mode"))
        except ValueError:
            return
        with _lock:
            mine = _entry_point.get(key)
        if mine is not None:
            mine.recompile_limit_hit(hit)
            return
    elif target is not None:
        return  # another backend's: none of hotswap's business
    bump("recompile_limits")
    with _lock:
        seen = (hit.limit_name, hit.function)
        _unattributed[seen] = (_unattributed.get(seen, (0, hit))[0] + 1, hit)


def status(compiled: Any = None) -> Statuses:
    """Each graph's tier, pending tiers and failures, now (never blocks). ``compiled``: what
    ``hotswap.compile`` returned (the graphs of every model of its code compiled with the same
    options: they share one backend), a ``hotswap.backend(...)`` object, what
    ``torch.compile(..., backend="hotswap")`` returned (every graph compiled that way), or
    None (every graph). ``print(...)`` shows one line per graph, then ``notes``: where dynamo
    hit its recompile limit, so that calls ran plain eager, outside hotswap."""
    coordinators = _coordinators(compiled)
    return Statuses((s for c in coordinators for s in c.status()), notes=_notes(coordinators))


def _notes(coordinators: list[Coordinator]) -> list[str]:
    with _lock:
        unattributed = list(_unattributed.values())
    return ([n for c in coordinators for n in c.notes()]
            + [hit.note(times) for times, hit in unattributed])


def wait(compiled: Any = None, timeout_s: float | None = None, *,
         raise_on_timeout: bool = False) -> Statuses:
    """Block until no tier is pending for any graph of ``compiled`` and the cache entries of
    the tiers that arrived are written (or ``timeout_s`` passes; then, with
    ``raise_on_timeout``, raise ``hotswap.WaitTimeout``)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    coordinators = _coordinators(compiled)
    statuses = Statuses()
    with threads.user_waiting():  # the loads it waits for do not defer to other calls
        for c in coordinators:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            statuses += c.wait(remaining)
    statuses.notes = _notes(coordinators)
    if raise_on_timeout and not (all(s.final for s in statuses)
                                 and all(c.entries_written() for c in coordinators)):
        raise WaitTimeout(timeout_s, statuses)
    return statuses


def runtime() -> Runtime:
    """What hotswap runs in this process: its worker pools (``worker_pids()``, ``restarts``)."""
    return _runtime


def shutdown(wait: bool = True) -> None:
    """Stop hotswap's workers now (interpreter exit does it too). Tiers still compiling fail
    quietly and their graphs keep the tier they serve; a later compile starts new workers.
    With ``wait``, then wait (up to 10 s) for every thread hotswap started to end; those
    still running then are named in a warning."""
    _runtime.shutdown(wait=wait)
