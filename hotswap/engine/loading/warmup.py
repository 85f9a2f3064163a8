"""Warming this process's load path before the first artifact arrives.

A first load in a process pays once for what every later load reuses: inductor's runtime
imports (lowering, the kernel templates: about 1.4 s of interpreter time on CPU). (It used to
pay inductor's CPU vector-ISA probe and a hash of torch's sources too; loads now take the
worker's: load_guard.py, source_key.py.) Paid during the swap, that is seconds of delay; paid
while the user's calls run, it competes with them for the GIL and the CPU. So it is paid here,
once per process, on the scheduler's thread (threads.py), in steps per device kind:

    common   imports (where there is a GPU, triton's own source hash and its driver's
             start from the step's start, on a thread beside the imports: they import
             triton alone); torch's source hash only where this torch cannot take the
             worker's
    cpu      the C++ loading machinery's imports (nothing is probed or built to load:
             load_guard.py)
    cuda     triton's runtime imports; triton's hash with its backend (torch's, from
             triton's parts warmed beside the imports)

Every step yields the GIL to the user's calls (``threads.yielding_gil``): 2 ms of Python, then
4 ms asleep, and it stays off the GIL while a user call runs on eager; once a load waits for
it, it no longer rests but still defers to those calls (full speed once a thread of the user's
waits: ``prepare(wait=True)``); at the thread's normal priority. On Python 3.11 the check is a
trace function, which made a CPU warm restart's imports take 1.42 s against 0.86-0.94 s bare;
it stays: at full speed the caller's calls beside them took 45-56 ms (a core taken from each
op's parallel region), and running the thread under ``SCHED_IDLE`` during the calls cannot
be undone without privilege and leaves the GIL's holder starved where other processes keep
the cores busy (BENCHMARKS.md, 2026-12-06). The hashes ran at the lowest
(niceness 19, ``SCHED_IDLE``) until a CPU row showed the inversion: a thread at that priority
that holds the GIL waits for a core while the user's threads wait for it. GPT-2 on the 2-core
box with a caller every 2 ms: torch's source hash, 0.1 s of work, took 4.1 s, and calls
beside it 125-131 ms.

``hotswap.prepare()`` runs it (and starts the workers) at a moment the caller chooses, e.g.
before serving; otherwise a coordinator starts it on its first graph (dynamo is imported by
then), and loads wait for the step of their device so nothing runs twice. A load on the
scheduler's thread does not wait for a step queued behind it: it runs the step itself.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from hotswap.engine import threads
from hotswap.engine.loading import load_guard, source_key, templates
from hotswap.engine.loading.load_guard import count_compiler_runs
from hotswap.profiles.timeline import process_span
from hotswap.system import bytecode, heap

__all__ = ["start_warmup", "wait_warmup"]

log = logging.getLogger("hotswap")


# What the warm-up imports (the common step's, and the CUDA step's where there is a GPU).
_COMMON_MODULES = ("torch._dynamo", "torch._functorch._aot_autograd.autograd_cache",
                   "torch._inductor.codecache", "torch._inductor.compile_fx",
                   "torch._inductor.standalone_compile")
# What a load imports beyond those (the generated wrapper's imports, AOTAutograd's runtime),
# where this torch has them: imported at the load, after the warm-up, one was compiled from
# source beside the largest call of a GPT-2 swap (memory_planning, 26 KB; H100).
_LOAD_MODULES = ("torch._inductor.hooks", "torch._inductor.codegen.memory_planning",
                 "torch._functorch._aot_autograd.subclass_codegen")
_CUDA_MODULES = ("torch._inductor.runtime.triton_heuristics", "torch.utils._triton")


def _common() -> None:
    import torch

    # Inductor's modules as bytecode from hotswap's cache (compiled by a child process the
    # first time), where this process would compile them from source holding the GIL (an
    # environment without bytecode that writes none): bytecode.py. The child is no compiler
    # run of a load's (load_guard).
    modules = _COMMON_MODULES + (_CUDA_MODULES if torch.cuda.is_available() else ()) \
        + _LOAD_MODULES
    with load_guard.uncounted(), contextlib.ExitStack() as reading:
        with _stage("warmup:bytecode"):  # the child's compile, where there is one
            reading.enter_context(bytecode.read_for_imports(modules))
        with _stage("warmup:imports"):
            # Dynamo first: it and inductor import each other, and two threads entering that
            # cycle at different modules at once get a half-initialized module and an
            # ImportError (one of them could be the user's first call). Entering at dynamo,
            # as the user's thread does, makes one thread wait for the other instead.
            import torch._dynamo
            _freeze_heap()  # and between the largest (heap.py), the user's first trace's too
            templates.install()  # before inductor's kernel modules build their templates
            import torch._functorch._aot_autograd.autograd_cache
            import torch._inductor.codecache
            _freeze_heap()
            import torch._inductor.compile_fx  # what loading imports: lowering, templates, ...
            _freeze_heap()
            import torch._inductor.standalone_compile
            for name in _LOAD_MODULES:
                with contextlib.suppress(ImportError):  # not in every torch
                    importlib.import_module(name)
            if torch.cuda.is_available():
                import torch._inductor.runtime.triton_heuristics
                import torch.utils._triton

    # Torch's source hash: where this torch takes one from elsewhere, a load takes its
    # worker's (source_key.py); else it is hashed here, once per process.
    torch_key = getattr(torch._inductor.codecache, "torch_key", None)
    if torch_key is not None and not source_key.travels():
        with _stage("warmup:torch_key"):
            torch_key()


def _cpu() -> None:
    # What loading a C++ kernel imports. No probe and no compiler: loads take the worker's
    # vector-ISA probe with the artifact and find its kernels built (load_guard.py). Inductor
    # reads its include paths from cpp_extension, which imports setuptools: at the first
    # load otherwise.
    import torch._inductor.cpp_builder
    import torch._inductor.cpu_vec_isa
    import torch.utils.cpp_extension  # noqa: F401


class _TritonEarly:
    """Triton's own part of its hash (its sources) and its driver's start (which builds its C
    utilities into triton's cache with the C compiler, where they are not built yet), on a
    thread of their own from the warm-up's start, beside inductor's imports: they import
    triton alone, none of torch's modules. After the imports, they took 0.93 s on the way
    to a GPT-2 swap (H100, triton's cache cold), while the artifact waited. Only where the
    warm-up is for CUDA: the driver's start makes a CUDA context (on ``device``, or the
    current one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # why it failed (a load pays for it later)

    def start(self, device: int | None) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threads.start(self._run, args=(device,),
                                             name="hotswap-triton-warmup")

    @property
    def done(self) -> bool:
        """Whether it started and has ended."""
        with self._lock:
            thread = self._thread
        return thread is not None and not thread.is_alive()

    def wait(self) -> None:
        with self._lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self, device: int | None) -> None:
        def warm() -> None:
            import torch
            from triton.compiler.compiler import make_backend
            from triton.runtime.driver import driver

            if device is not None:  # a new thread's current device is 0
                torch.cuda.set_device(device)

            make_backend(driver.active.get_current_target()).hash()  # the ptxas version too
            try:  # where torch finds it (_inductor.runtime.triton_compat)
                from triton.runtime.cache import triton_key
            except ImportError:
                from triton.compiler.compiler import triton_key
            triton_key()

        try:
            # Triton's modules as bytecode too (the same folder as the imports beside it):
            # compiled from source here, each of its large modules held the GIL for tens of ms.
            with _stage("warmup:triton_driver"), load_guard.uncounted(), \
                    bytecode.read_for_imports(_COMMON_MODULES + _CUDA_MODULES + _LOAD_MODULES), \
                    threads.yielding_gil(unless=_warmup.needed, wanted_rest_s=0.0,
                                         full_speed=_warmup.blocking.is_set):
                warm()
        except Exception as e:  # the CUDA step pays for it, as before
            self.error = e
            log.debug("hotswap: warming triton beside the imports failed: %s: %s",
                      type(e).__name__, e)


_triton_early = _TritonEarly()


def _cuda() -> None:
    import torch._inductor.runtime.triton_heuristics
    import torch.utils._triton

    _triton_early.wait()  # one driver start, not two side by side
    # Triton's hash with its backend: what _TritonEarly left (0.6-0.9 s of a first CUDA load
    # on the H100 where it did not run).
    triton_hash = getattr(torch.utils._triton, "triton_hash_with_backend", None)
    if triton_hash is not None:
        with _stage("warmup:triton_hash"):
            triton_hash()


@contextlib.contextmanager
def _stage(name: str) -> Iterator[None]:
    """A part of a step, as a span of the process in a profile (hotswap profile, bench)."""
    start = time.monotonic()
    try:
        yield
    finally:
        process_span(name, start, time.monotonic())


_STEPS: dict[str, Callable[[], None]] = {"common": _common, "cpu": _cpu, "cuda": _cuda}


def _steps_for(devices: Iterable[str]) -> list[str]:
    kinds = {d.split(":")[0] for d in devices}
    return ["common", *(k for k in _STEPS if k != "common" and k in kinds)]


class _Warmup:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[str, threading.Event] = {}
        self._taken: set[str] = set()  # steps that started running (on whichever thread)
        # Set once a load (or prepare(wait=True)) waits for a step, or a task waits behind
        # one on the scheduler's thread: the steps rest less between their runs of Python
        # (threads.yielding_gil).
        self.wanted = threading.Event()
        # Set once a thread of the user's waits for a step (prepare(wait=True)): nobody's
        # calls to protect, so the steps run at full speed (the yielding hook alone costs
        # them about as much again).
        self.blocking = threading.Event()

    def start(self, devices: Iterable[str]) -> list[threading.Event]:
        devices = list(devices)
        cuda = [d for d in devices if d.split(":")[0] == "cuda"]
        if cuda:  # the CUDA step's slowest part, from now on beside the imports
            index = cuda[0].partition(":")[2]
            _triton_early.start(int(index) if index.isdigit() else None)
        events = []
        with self._lock:
            for step in _steps_for(devices):
                if step not in self._done:
                    self._done[step] = threading.Event()
                    threads.scheduler.submit(self._run, step)
                events.append(self._done[step])
        if threads.scheduler.here():  # a step queued behind this task would never come
            self.wanted.set()
            for step in _steps_for(devices):
                self._run(step)
        return events

    def needed(self) -> bool:
        """Whether someone waits for the warm-up now (and from then on)."""
        if not self.wanted.is_set() and threads.scheduler.waiting(besides=self._run):
            self.wanted.set()
        return self.wanted.is_set()

    def _run(self, step: str) -> None:
        with self._lock:
            if step in self._taken:
                return
            self._taken.add(step)
        t = time.monotonic()
        try:
            # Until a load waits for it (or a task queued behind it on the scheduler's thread:
            # a load that arrived meanwhile), it yields the GIL to the user's calls, beside
            # the scheduler's quick handoff.
            # Each step starts and ends by moving the heap out of the collector's full
            # passes: a step's imports would otherwise set off one over all of it (heap.py).
            _freeze_heap()
            with count_compiler_runs(), threads.yielding_gil(
                    unless=self.needed, wanted_rest_s=0.0, full_speed=self.blocking.is_set):
                _STEPS[step]()
        except Exception as e:  # a load pays for it later, that is all
            # Once the interpreter is exiting, steps fail for that reason alone.
            exiting = not threading.main_thread().is_alive()
            log.log(logging.DEBUG if exiting else logging.INFO,
                    "hotswap: warming the load path (%s) failed: %s: %s", step,
                    type(e).__name__, e)
        finally:
            try:
                _freeze_heap()
            finally:
                log.debug("hotswap: warm-up step %s took %.2f s", step, time.monotonic() - t)
                self._done[step].set()


_warmup = _Warmup()


def _freeze_heap() -> None:
    """Freeze the heap (heap.py). The next ``torch.compiler.reset()`` thaws it: hotswap's
    reset hook, which the user's thread registers with dynamo (api.py; never this thread:
    dynamo's reset iterates over what is registered)."""
    try:
        heap.freeze()
    except Exception as e:  # a collector left as it was costs pauses, nothing else
        log.debug("hotswap: freezing the heap failed: %s: %s", type(e).__name__, e)


def start_warmup(devices: Iterable[str] = ()) -> None:
    """Warm this process's load path for ``devices`` ("cpu", "cuda:0", ...) in the
    background; steps already done or under way are not repeated."""
    _warmup.start(devices)


def wait_warmup(devices: Iterable[str] = (), timeout_s: float | None = None) -> bool:
    """Start (if needed) and wait for the warm-up of ``devices``; False on timeout."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    _warmup.wanted.set()
    if threading.current_thread() not in threads.live():
        _warmup.blocking.set()  # the user's thread waits (prepare(wait=True))
    for event in _warmup.start(devices):
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not event.wait(remaining):
            return False
    return True
