"""The serving process loads artifacts; it never builds anything to do so.

Loading a CPU artifact finds each C++ kernel's library by a key made of its source and its
compiler command line, and the command line carries the CPU's vector ISA as inductor's probe
picked it. A process that never probed ran the probe at its first load: g++ and a Python
subprocess per ISA, over a second of CPU in the user's process. Worse, a probe whose compiler
was killed halfway (any kill of the process's children) answered "no AVX-512" for the rest of
the process: every later kernel's key missed the worker's library, was rebuilt here with the
wrong flags, and failed (``'at::vec' has not been declared``), so no CPU graph of that process
left eager again. And before it looks for a kernel's library, inductor prepares the kernel's
precompiled header, which runs the preprocessor over it even when it is built already.

So what a worker's probes found travels with its artifact (``probes()``, packed into the
entry) and the serving process takes it as its own (``adopt()``): the vector ISAs, and the
precompiled headers the worker built (a header on disk is used as it is). Same machine, same
compiler (the cache stamp holds the CPU's capability), and a worker killed mid-probe never
sends one. A load runs with inductor's compile pool off, so a kernel that did not arrive is
built on the loading thread, where the counter sees it.

``load_compiler_runs`` (a counter) is every process a load or the load-path warm-up started
in this process, a compiler's version query aside: 0 when everything arrived built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import platform
import shutil
import sys
import threading
from collections.abc import Iterator
from typing import Any

from hotswap.counting import bump

__all__ = ["adopt", "count_compiler_runs", "cpp_sources", "load_config", "probe_vec_isa",
           "probes", "record_precompiled_headers", "reprobe_if_cut_short", "uncounted"]

_SPAWN_EVENTS = frozenset({"subprocess.Popen", "os.posix_spawn", "os.spawn", "os.system",
                           "os.exec", "os.fork"})
_watched = threading.local()
_hook_lock = threading.Lock()
_hooked = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in _SPAWN_EVENTS and _depth() and not _version_query(args):
        bump("load_compiler_runs")


def _depth() -> int:
    depth: int = getattr(_watched, "depth", 0)
    return depth


def _version_query(args: tuple[Any, ...]) -> bool:
    """``g++ --version``: inductor asks once per process which compiler it has (milliseconds,
    nothing built); not counted."""
    argv = args[1] if len(args) > 1 else None
    return isinstance(argv, (list, tuple)) and len(argv) == 2 and argv[1] in ("--version", "-v")


@contextlib.contextmanager
def count_compiler_runs() -> Iterator[None]:
    """Count the processes this thread starts inside the block as ``load_compiler_runs``."""
    global _hooked
    with _hook_lock:
        if not _hooked:
            sys.addaudithook(_audit)  # for good: audit hooks cannot be removed
            _hooked = True
    _watched.depth = _depth() + 1
    try:
        yield
    finally:
        _watched.depth -= 1


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Processes this thread starts inside the block are not a load's compiler runs (within a
    ``count_compiler_runs`` block: hotswap's own helpers, such as a bytecode compile)."""
    depth = _depth()
    _watched.depth = 0
    try:
        yield
    finally:
        _watched.depth = depth


def load_config() -> dict[str, Any]:
    """Inductor settings for a load: no compile pool (not part of a kernel's key)."""
    from torch._inductor import config

    return {"compile_threads": 1} if "compile_threads" in config.get_config_copy() else {}


# ------------------------------------------------------------- what a worker's probes found

_adopt_lock = threading.Lock()
# This process's answer to inductor's valid_vec_isa_list(), where hotswap gave it one (probed
# here as far as it was read, or adopted from a worker's probes)
_answer: ProbedAsRead | None = None
# (header, the kernel's hashable command line) -> the precompiled header inductor built for it
_headers: dict[tuple[str, str], str] = {}
_headers_hooked = False


# What of ``probes()`` is the vector-ISA answer (the workers' shared file holds these alone)
_ISA_KEYS = ("vec_isa", "vec_isa_probed")
# What a probe may find beside an ISA's name: features checked by a build of their own (the
# ISA's compiler flags then carry one more -m option).
_ISA_FEATURES = ("_is_avx512_bf16_supported", "_is_amx_fp16_supported")


def probes() -> dict[str, Any]:
    """What this process's probes found, for an entry: the vector ISAs (each as the probe
    left it: name, width, extra features and the compiler flags they make; plain values, no
    pickle; with ``vec_isa_probed``, how many of the CPU's candidates were probed, where the
    probe stopped short of them all: ``ProbedAsRead``) and the precompiled headers built.
    Empty where nothing was probed (a GPU-only compile)."""
    from torch._inductor import cpu_vec_isa

    found: dict[str, Any] = {}
    answer = _answer
    if answer is not None:  # as far as this process probed: a later reader probes on
        with answer._lock:  # one reading, whatever another thread probes meanwhile
            found["vec_isa"] = [_isa_record(isa) for isa in answer.known()]
            if not answer.complete:
                found["vec_isa_probed"] = answer.probed
    else:
        isas = cpu_vec_isa.valid_vec_isa_list
        cache_info = getattr(isas, "cache_info", None)
        if cache_info is not None and cache_info().currsize:
            found["vec_isa"] = [_isa_record(isa) for isa in isas()]
    with _adopt_lock:
        if _headers:
            found["headers"] = [[h, c, p] for (h, c), p in _headers.items()]
    return found


def _isa_record(isa: Any) -> dict[str, Any]:
    return {"name": str(isa), "bits": int(isa.bit_width()), "flags": isa.build_arch_flags(),
            "features": {f: bool(getattr(isa, f)) for f in _ISA_FEATURES if hasattr(isa, f)}}


def _isa_from(record: Any, cpu_vec_isa: Any) -> Any:
    """The ISA object of this torch that ``record`` (``_isa_record``) names, set up as the
    probe left it; ValueError if this torch has none that builds with the same flags."""
    if not (isinstance(record, dict) and isinstance(record.get("name"), str)
            and isinstance(record.get("bits"), int) and isinstance(record.get("flags"), str)
            and isinstance(record.get("features"), dict)
            and all(f in _ISA_FEATURES and isinstance(v, bool)
                    for f, v in record["features"].items())):
        raise ValueError(f"probes: {record!r} is not a vector ISA record")
    for known in cpu_vec_isa.supported_vec_isa_list:
        if str(known) != record["name"]:
            continue
        isa = known
        if known.bit_width() != record["bits"]:  # SVE comes in widths: one object per width
            try:
                isa = dataclasses.replace(known, _bit_width=record["bits"])
            except (TypeError, ValueError, AssertionError):
                continue
        for feature, value in record["features"].items():
            setattr(isa, feature, value)
        if isa.build_arch_flags() == record["flags"]:
            return isa
    raise ValueError(f"probes: this torch has no vector ISA {record['name']!r} of "
                     f"{record['bits']} bits building with {record['flags']!r}")


def adopt(found: dict[str, Any]) -> None:
    """Take a worker's ``probes()`` (on this machine) as this process's own answers, in place
    of running them here (or of answers an earlier kill cut short). Malformed: ValueError."""
    vec_isa, headers = found.get("vec_isa"), found.get("headers", [])
    probed = found.get("vec_isa_probed")
    if vec_isa is not None and not isinstance(vec_isa, list):
        raise ValueError(f"probes: vec_isa is a {type(vec_isa).__name__}, not a list")
    if probed is not None and not (isinstance(vec_isa, list) and type(probed) is int
                                   and probed >= len(vec_isa)):
        raise ValueError(f"probes: vec_isa_probed {probed!r} does not count the ISAs found")
    if not (isinstance(headers, list) and all(
            isinstance(h, list) and len(h) == 3 and all(isinstance(x, str) for x in h)
            for h in headers)):
        raise ValueError("probes: headers is not a list of [header, command line, path]")
    from torch._inductor import cpu_vec_isa

    with _adopt_lock:
        if vec_isa is not None:
            isas = [_isa_from(record, cpu_vec_isa) for record in vec_isa]
            candidates = _promised(cpu_vec_isa)
            upto = len(candidates) if probed is None else probed
            if probed is not None and probed > len(candidates):
                raise ValueError(f"probes: {probed} ISAs probed, this CPU has "
                                 f"{len(candidates)} to probe")
            if candidates:  # the ISAs found: this CPU's candidates, in order, among those probed
                at = [next((i for i, c in enumerate(candidates) if c is isa), -1) for isa in isas]
                if any(i < 0 or i >= upto for i in at) or at != sorted(set(at)):
                    raise ValueError(f"probes: {[str(i) for i in isas]} are not this CPU's "
                                     f"candidates in order among the first {upto} probed")
            # Answers of one machine agree where both probed, but for a check a kill failed:
            # the one probed further stays, and of two as far, the one that found more.
            if (_answer is None or _answer.probed < upto
                    or (_answer.probed == upto and len(_answer.known()) < len(isas))):
                _install(cpu_vec_isa, ProbedAsRead(candidates, isas, upto))
        _headers.update({(h, c): p for h, c, p in headers})
    if headers:
        record_precompiled_headers()


_sources_lock = threading.Lock()
_sources: list[str] | None = None
_write_hooked = False


@contextlib.contextmanager
def cpp_sources() -> Iterator[list[str]]:
    """Workers: the C++ sources inductor writes (or finds written) inside the block, so that
    the libraries built from them travel with the entry even when an earlier compile in this
    worker built them (a max-autotune tier shares most kernels with the default tier: shipped
    by modification time alone, its entry lacked them and a fresh process rebuilt ten)."""
    global _sources, _write_hooked
    from torch._inductor import codecache

    from hotswap.workers.child import is_beside_jobs

    with _sources_lock:
        if not _write_hooked:
            real = codecache.write

            def write(*args: Any, **kwargs: Any) -> tuple[str, str]:
                key, path = real(*args, **kwargs)
                if is_beside_jobs():  # work beside the job: not the job's
                    return key, path
                with _sources_lock:
                    if _sources is not None and str(path).endswith(".cpp"):
                        _sources.append(str(path))
                return key, path

            codecache.write = write
            _write_hooked = True
        found: list[str] = []
        _sources = found
    try:
        yield found
    finally:
        with _sources_lock:
            _sources = None


def record_precompiled_headers() -> None:
    """Remember every precompiled header inductor builds here (workers ship the list), and
    answer from the list where it names a header that is built: preparing one runs the
    preprocessor over it first, built or not."""
    global _headers_hooked
    from torch._inductor import codecache

    from hotswap.engine.loading.kernel_files import header_finished

    real: Any = None  # inductor's, once hooked below

    def precompile_header(header: str, hashable_cmd_line: str, **command: Any) -> str:
        with _adopt_lock:
            known = _headers.get((header, hashable_cmd_line))
        if known and any(header_finished(known + ext) for ext in (".gch", ".pch")):
            return known
        path = str(real(header, hashable_cmd_line, **command))
        with _adopt_lock:
            _headers[(header, hashable_cmd_line)] = path
        return path

    with _adopt_lock:  # installed before another thread may find it hooked and go on
        real = getattr(codecache, "_precompile_header", None)
        if _headers_hooked or real is None:
            return
        _headers_hooked = True
        codecache._precompile_header = precompile_header  # type: ignore[assignment]


# How long a worker waits for another's probe of the same ISAs before probing itself.
PROBE_LOCK_WAIT_S = 120.0


def probe_vec_isa(shared_dir: str | None = None) -> None:
    """Workers: the vector ISAs inductor may build for, probed once per machine, and only as
    far as inductor reads them (``ProbedAsRead``).

    Inductor's probe builds a program per ISA and loads each in a Python process; in a job on
    the busy 2-core box it took 12.6 s, with the pool's other worker probing the same ISAs
    beside it. So the answer is shared: under a lock, the first worker probes and writes
    what it found to ``shared_dir`` (default: a private folder in inductor's cache directory,
    ``shared_answers_dir``), and every other worker of the machine, now or later, takes that
    answer as its own (``adopt``), under a key of torch's build, this CPU's flags and the
    compiler. Without a trusted folder (another user owns it, say), each worker probes for
    itself, as before."""
    import filelock
    from torch._inductor import cpu_vec_isa

    if _answered(cpu_vec_isa):
        return  # probed (and checked) already in this worker: every later job lands here
    answer = _answer_path(shared_dir)
    if answer is None:
        _probe_here(cpu_vec_isa)
        return
    try:
        with filelock.FileLock(str(answer) + ".lock", timeout=PROBE_LOCK_WAIT_S):
            if _answered(cpu_vec_isa):
                return  # another thread of this worker probed while this one waited
            if _adopt_answer(answer, cpu_vec_isa):
                return
            _probe_here(cpu_vec_isa)
            if _answer is not None and _answer.all_passed:  # one cut short is not shared
                _write_answer(answer, probes())
    except (OSError, filelock.Timeout):  # a lock held too long, a folder gone: probe here
        if not _answered(cpu_vec_isa):
            _probe_here(cpu_vec_isa)


class ProbedAsRead:
    """This process's answer to inductor's ``valid_vec_isa_list()``: the ISAs of
    ``candidates`` (those the CPU claims, in inductor's order of preference) that build and
    load, each checked by inductor itself (``bool(isa)``), but only as far as the answer is
    read.

    Inductor checks every candidate before its pick reads the first that passes: on our
    2-core box (AMX, AVX-512 VNNI, AVX-512, AVX2) 10 compiler runs and 9.3 s, where the pick
    of a default tier reads the first, 2.9 s. A tier that sets ``cpp.simdlen`` or an
    ``ATEN_CPU_CAPABILITY`` reads on, and the probe goes on; ``len()`` probes them all (side
    by side). ``valid``/``probed``: an answer adopted from a worker that probed the first
    ``probed`` candidates and found ``valid``."""

    def __init__(self, candidates: list[Any], valid: list[Any] | None = None,
                 probed: int = 0) -> None:
        self.candidates = list(candidates)
        self.probed = probed
        self._valid = list(valid or [])
        self._lock = threading.RLock()

    @property
    def complete(self) -> bool:
        return self.probed >= len(self.candidates)

    @property
    def all_passed(self) -> bool:
        """Whether every candidate probed so far passed (none failed, by a kill or not)."""
        with self._lock:
            return len(self._valid) == self.probed

    def known(self) -> list[Any]:
        with self._lock:
            return list(self._valid)

    def _next(self) -> None:
        """Probe the next candidate (the caller holds the lock)."""
        isa = self.candidates[self.probed]
        if isa:
            self._valid.append(isa)
        self.probed += 1

    def _until(self, found: int) -> None:
        """Probe the next candidates, one by one, until ``found`` have passed or none is
        left."""
        with self._lock:
            while len(self._valid) < found and not self.complete:
                self._next()

    def probe_through(self, probed: int) -> None:
        """Probe the next candidates, one by one, until the first ``probed`` are."""
        with self._lock:
            while self.probed < min(probed, len(self.candidates)):
                self._next()

    def _all(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        with self._lock:
            rest = self.candidates[self.probed:]
            if len(rest) > 1:
                with ThreadPoolExecutor(len(rest), thread_name_prefix="hotswap-probe") as pool:
                    passed = list(pool.map(bool, rest))
            else:
                passed = [bool(isa) for isa in rest]
            self._valid += [isa for isa, ok in zip(rest, passed, strict=True) if ok]
            self.probed = len(self.candidates)

    def __bool__(self) -> bool:
        self._until(1)
        return bool(self._valid)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int) and index >= 0:
            self._until(index + 1)
        else:
            self._all()
        return self._valid[index]

    def __iter__(self) -> Iterator[Any]:
        at = 0
        while True:
            with self._lock:
                self._until(at + 1)
                if at >= len(self._valid):
                    return
                isa = self._valid[at]
            yield isa
            at += 1

    def __len__(self) -> int:
        self._all()
        return len(self._valid)

    def __repr__(self) -> str:
        return (f"ProbedAsRead({[str(i) for i in self.known()]}, probed {self.probed} of "
                f"{len(self.candidates)})")


def _install(cpu_vec_isa: Any, answer: ProbedAsRead) -> None:
    """Make ``answer`` inductor's ``valid_vec_isa_list()`` (its pick reads the module's)."""
    global _answer
    _answer = answer
    cpu_vec_isa.valid_vec_isa_list = functools.cache(lambda: answer)


def _answered(cpu_vec_isa: Any) -> bool:
    """Whether this process has the ISAs already (probed, or another's answer adopted)."""
    if _answer is not None:
        return True
    cache_info = getattr(cpu_vec_isa.valid_vec_isa_list, "cache_info", None)
    return cache_info is not None and bool(cache_info().currsize)


def shared_answers_dir() -> str:
    """Where workers share the probe's answer: beside what inductor caches of the probe (the
    programs it built), in its cache directory; a cold inductor cache probes again."""
    from hotswap.executors.local import inductor_cache_dir

    return os.path.join(inductor_cache_dir(), "hotswap-probes")


def _answer_path(shared_dir: str | None) -> Any:
    """The answer file for this torch, CPU and compiler in a folder this user alone may
    write (made if missing), or None where there is none."""
    import hashlib
    import json
    from pathlib import Path

    from hotswap.cache.trust import ensure_private_dir

    folder = Path(shared_dir or shared_answers_dir())
    try:
        ensure_private_dir(folder)
    except OSError:
        return None
    key = hashlib.sha256(json.dumps(_machine_key(), sort_keys=True).encode()).hexdigest()
    return folder / f"vec_isa-{key[:32]}.msgpack"


def _machine_key() -> dict[str, Any]:
    """What a probe's answer depends on: torch's build, this CPU's flags, the compiler."""
    import torch
    from torch._inductor import config, cpu_vec_isa

    key: dict[str, Any] = {"torch": torch.__version__, "machine": platform.machine(),
                           "vec_isa_ok": getattr(config.cpp, "vec_isa_ok", None)}
    checker = getattr(cpu_vec_isa, "x86_isa_checker", None)
    with contextlib.suppress(Exception):
        key["cpu_flags"] = sorted(checker()) if checker is not None else []
    with contextlib.suppress(Exception):
        from torch._inductor import cpp_builder

        compiler = str(cpp_builder.get_cpp_compiler())
        path = shutil.which(compiler) or compiler
        st = os.stat(path)
        key["compiler"] = [os.path.realpath(path), st.st_size, st.st_mtime_ns]
    return key


def _adopt_answer(path: Any, cpu_vec_isa: Any) -> bool:
    """Take another worker's answer at ``path`` as this worker's; False where there is none
    (or it is malformed, or names an ISA this torch does not build with). An answer is the
    list of ISA records of a complete probe, or {"vec_isa": records, "vec_isa_probed": n} of
    one that stopped where its reads did (``ProbedAsRead``)."""
    import msgpack

    from hotswap.cache.trust import read_private

    try:
        answer = msgpack.unpackb(read_private(path), raw=False)
        if isinstance(answer, dict):
            adopt({k: answer[k] for k in _ISA_KEYS if k in answer})
        else:
            adopt({"vec_isa": answer})
    except (OSError, ValueError, TypeError, msgpack.UnpackException):
        return False
    cpu_vec_isa.pick_vec_isa()
    return True


def _write_answer(path: Any, found: dict[str, Any]) -> None:
    """Write a probe's answer for the other workers (whole or not at all)."""
    import msgpack

    from hotswap.engine.loading.kernel_files import write_new

    answer = {k: found[k] for k in _ISA_KEYS if k in found}
    if answer.get("vec_isa"):
        with contextlib.suppress(OSError):
            write_new(str(path), msgpack.packb(answer, use_bin_type=True), 0o600)


def _probe_here(cpu_vec_isa: Any) -> None:
    """Inductor's probe in this process, as far as its pick reads (``ProbedAsRead``, where
    the CPU's candidates are known: x86), then the pick as inductor always makes it."""
    candidates = _promised(cpu_vec_isa)
    if candidates:
        with _adopt_lock:
            _install(cpu_vec_isa, ProbedAsRead(candidates))
    cpu_vec_isa.pick_vec_isa()
    reprobe_if_cut_short()


def _promised(cpu_vec_isa: Any) -> list[Any]:
    """The ISAs whose CPU flags this (x86) machine has: what the probe checks."""
    checker = getattr(cpu_vec_isa, "x86_isa_checker", None)
    if (checker is None or platform.machine() not in ("x86_64", "AMD64")
            or sys.platform not in ("linux", "win32")):  # as inductor's own list
        return []
    flags = set(checker())
    return [isa for isa in cpu_vec_isa.supported_vec_isa_list
            if all(flag in flags for flag in str(isa).split())]


def reprobe_if_cut_short() -> None:
    """Workers: probe again, once, when an ISA the CPU has failed its build check. A build
    killed from outside fails the check for good in this process (inductor caches the
    answer); a compiler that cannot build for the ISA fails again, and that answer stands.
    Probed as far as the first probe went."""
    from torch._inductor import cpu_vec_isa

    answer = _answer
    if answer is None or answer.all_passed:
        return
    for cls in {type(isa) for isa in cpu_vec_isa.supported_vec_isa_list}:
        for klass in cls.__mro__:
            for name in ("__bool__", "_VecISA__bool__impl"):
                clear = getattr(klass.__dict__.get(name), "cache_clear", None)
                if clear is not None:
                    clear()
    again = ProbedAsRead(answer.candidates)
    again.probe_through(answer.probed)
    with _adopt_lock:
        _install(cpu_vec_isa, again)
