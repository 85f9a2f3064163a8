"""Every ``HOTSWAP_*`` environment variable hotswap reads, one reader each (stdlib only: every
layer may import it, and it imports nothing of hotswap).

A keyword argument of ``hotswap.compile`` wins over its variable; an unset or empty variable
means the default. A malformed number raises ``ValueError`` naming the variable and what it
takes; ``check_all()`` reads the ones not tied to an option, so that ``hotswap.compile`` fails
on them at once rather than in a worker or a background thread.

    variable                        default                 meaning
    HOTSWAP_MODE                    progressive             mode=: inprocess, subprocess, async,
                                                            progressive
    HOTSWAP_TIERS                   default,max-autotune    tiers=, as "a,b" (progressive; other
                                                            modes: default)
    HOTSWAP_REGIONS                 auto                    regions=: auto (progressive, and
                                                            async with the compile service,
                                                            first serve a graph that repeats a
                                                            block with each distinct block
                                                            compiled once), on (async always)
                                                            or off
    HOTSWAP_PARTS                   auto                    how many parts async's tier compiles
                                                            in at once where its jobs go to the
                                                            compile service: auto (2 where the
                                                            service keeps two workers warm), or
                                                            a number (1: whole graphs)
    HOTSWAP_TIMEOUT_S               600 (x3 autotuning)     timeout_s=: limit on a compile or a
                                                            wait on one, seconds > 0
    HOTSWAP_GATE_THRESHOLD          0.02                    gate_threshold=: how much faster a
                                                            tier must be to replace the serving one
    HOTSWAP_PROFILE_DIR             (none)                  profile_dir=: record a profile there
    HOTSWAP_CACHE_DIR               $XDG_CACHE_HOME/hotswap cache_dir=: the local artifact cache
                                    or ~/.cache/hotswap
    HOTSWAP_CACHE_MAX_BYTES         (no limit)              the local cache's size bound, bytes > 0
    HOTSWAP_EXECUTOR                local                   executor=: "local", or a Dask scheduler
                                                            (dask://, tcp://, tls://, inproc://)
    HOTSWAP_CACHE_URL               (none)                  cache_url=: the fleet's Redis store
    HOTSWAP_CACHE_KEY_FILE          (none)                  the key the fleet signs entries with
    HOTSWAP_CLAIM_TTL_S             30                      how long a fleet compile claim outlives
                                                            its holder's last renewal, seconds >= 1
    HOTSWAP_WORKERS                 one per two cores, 1-4  local compile workers, >= 1
    HOTSWAP_WORKER_DEVICES          (none)                  worker_devices=: "cuda:1,cuda:1", the
                                                            GPU each local worker uses, cycled
    HOTSWAP_WORKER_NICE             19                      compile workers' niceness, 0 to 19
    HOTSWAP_WORKER_IDLE             1                       compile workers under SCHED_IDLE, 0 or 1
    HOTSWAP_WORKER_YIELD            caller                  whom lowered local workers yield to:
                                                            caller (this process; raised while
                                                            other processes crowd them out) or
                                                            all
    HOTSWAP_WORKER_RSS_LIMIT_BYTES  (no limit)              a worker past it is killed, bytes > 0
    HOTSWAP_WORKER_IDLE_EXIT_S      300                     idle workers stop after it, seconds
                                                            >= 0 (0: never)
    HOTSWAP_SWITCH_INTERVAL_S       0.0002                  the GIL switch interval while hotswap
                                                            loads, seconds in (0, 1]
    HOTSWAP_GC_FREEZE               on                      on: the objects alive around the load
                                                            path's warm-up leave the cycle
                                                            collector's full passes (gc.freeze;
                                                            thawed at torch.compiler.reset());
                                                            off
    HOTSWAP_EAGER_THREADS           auto                    auto: while this process's compile
                                                            workers run on this machine, the
                                                            graphs it answers eagerly take at
                                                            most the cores the workers leave
                                                            (hotswap.system.cores); keep: your
                                                            intra-op thread count always
    HOTSWAP_LOG                     info                    hotswap's default stderr lines: info,
                                                            warning (failures only) or off
    HOTSWAP_SERVICE                 off                     on: compile in the machine's compile
                                                            service (executor "service://") when
                                                            no executor= or HOTSWAP_EXECUTOR says
                                                            otherwise; off: the local pool
    HOTSWAP_START_EARLY             on                      on: a user's program that imports
                                                            hotswap starts its compile workers
                                                            then (the compile service, else, once
                                                            it imports torch, the local pool of
                                                            the default size), so they warm
                                                            while the model is built;
                                                            those no compile uses within 120 s
                                                            (a pool: or the idle exit, if
                                                            longer) stop. off: at the first
                                                            compile
    HOTSWAP_SERVICE_DIR             $XDG_RUNTIME_DIR/hotswap the service's private folder (socket,
                                    or /tmp/hotswap-service- key, lock, log), mode 0700
                                    <uid>
    HOTSWAP_SERVICE_IDLE_EXIT_S     600                     the service exits after this long
                                                            without a job, seconds > 0
    HOTSWAP_PYCACHE                 auto                    the processes hotswap starts keep
                                                            Python bytecode in its cache dir
                                                            (pycache-<python>): auto, where they
                                                            would otherwise recompile sources at
                                                            every start; on; off. Inductor's
                                                            kernel templates are kept there
                                                            (templates-<python>), and hotswap's
                                                            own modules where this process would
                                                            compile them, unless off

``HOTSWAP_SCRATCH_DIR`` is no setting: a pool sets it for its workers (hotswap.workers.scratch).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

__all__ = ["cache_dir", "cache_key_file", "cache_max_bytes", "cache_url", "check_all",
           "claim_ttl_s", "eager_threads", "env_number", "executor", "gate_threshold",
           "gc_freeze", "log_level", "mode",
           "parts", "profile_dir", "pycache", "regions", "service", "service_dir",
           "service_idle_exit_s", "start_early", "switch_interval_s", "tiers", "timeout_s", "worker_devices",
           "worker_idle", "worker_idle_exit_s", "worker_nice", "worker_rss_limit_bytes",
           "worker_yield", "workers"]

T = TypeVar("T", int, float)

_LOG_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "off": None}
_SWITCH_INTERVAL_S = 2e-4


def env_number(name: str, kind: Callable[[str], T], ok: Callable[[T], bool], expected: str,
               default: T | None = None) -> T | None:
    """The number in ``name`` (``default`` when unset or blank). One that does not parse as
    ``kind`` or that ``ok`` rejects raises ``ValueError`` naming the variable and ``expected``."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise ValueError(f"{name} must be {expected}, got {raw!r}")
    return value


def _choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """The word in ``name``, one of ``choices`` (any case; ``default`` when unset or blank);
    another raises ``ValueError`` naming the variable and the choices."""
    setting = os.environ.get(name, "").strip().lower() or default
    if setting not in choices:
        *first, last = [repr(c) for c in choices]
        raise ValueError(f"{name} must be {', '.join(first)} or {last}, got {setting!r}")
    return setting


def _text(name: str) -> str | None:
    """The variable as set (None when unset or empty); its option checks the value."""
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def mode() -> str | None:
    return _text("HOTSWAP_MODE")


def regions() -> str | None:
    return _text("HOTSWAP_REGIONS")


def parts() -> int | None:
    """HOTSWAP_PARTS: None for auto."""
    raw = os.environ.get("HOTSWAP_PARTS", "").strip().lower()
    if raw in ("", "auto"):
        return None
    return env_number("HOTSWAP_PARTS", int, lambda v: 1 <= v <= 64,
                      "auto or a whole number from 1 to 64")


def tiers() -> str | None:
    return _text("HOTSWAP_TIERS")


def timeout_s() -> float | None:
    return env_number("HOTSWAP_TIMEOUT_S", float, lambda v: 0 < v < float("inf"),
                      "a number of seconds > 0")


def gate_threshold() -> float | None:
    """The raw fraction (None when unset); ``Options`` checks its range."""
    value = _text("HOTSWAP_GATE_THRESHOLD")
    if value is None:
        return None
    try:
        return float(value)
    except ValueError as e:
        raise ValueError(f"HOTSWAP_GATE_THRESHOLD must be a fraction such as 0.02, got "
                         f"{value!r}") from e


def profile_dir() -> str | None:
    return _text("HOTSWAP_PROFILE_DIR")


def cache_dir() -> str | None:
    """As set (None: the default, which ``hotswap.cache.root.default_cache_dir`` makes)."""
    return _text("HOTSWAP_CACHE_DIR")


def cache_max_bytes() -> int | None:
    return env_number("HOTSWAP_CACHE_MAX_BYTES", int, lambda v: v > 0,
                      "a whole number of bytes > 0")


def executor() -> str | None:
    return _text("HOTSWAP_EXECUTOR")


def cache_url() -> str | None:
    return _text("HOTSWAP_CACHE_URL")


def cache_key_file() -> str | None:
    return _text("HOTSWAP_CACHE_KEY_FILE")


def claim_ttl_s() -> float:
    value = env_number("HOTSWAP_CLAIM_TTL_S", float, lambda v: v >= 1.0,
                       "a number of seconds >= 1", default=30.0)
    assert value is not None
    return value


def workers() -> int | None:
    """None when unset (the pool picks one per two cores)."""
    return env_number("HOTSWAP_WORKERS", int, lambda v: v >= 1,
                      "a whole number >= 1 (unset it for one per two cores, 1 to 4)")


def worker_devices() -> str | None:
    """As set ("cuda:1,cuda:1"); ``Options`` parses it."""
    return _text("HOTSWAP_WORKER_DEVICES")


def worker_nice() -> int:
    nice = env_number("HOTSWAP_WORKER_NICE", int, lambda v: 0 <= v <= 19,
                      "a whole number from 0 to 19", default=19)
    assert nice is not None
    return nice


def worker_idle() -> bool:
    return env_number("HOTSWAP_WORKER_IDLE", int, lambda v: v in (0, 1), "0 or 1",
                      default=1) == 1


def worker_yield() -> str:
    """HOTSWAP_WORKER_YIELD: "caller" or "all" (WorkerPool's ``yield_to``)."""
    return _choice("HOTSWAP_WORKER_YIELD", ("caller", "all"), "caller")


def worker_rss_limit_bytes() -> int | None:
    return env_number("HOTSWAP_WORKER_RSS_LIMIT_BYTES", int, lambda v: v > 0,
                      "a number of bytes > 0")


def worker_idle_exit_s() -> float | None:
    """None: never."""
    value = env_number("HOTSWAP_WORKER_IDLE_EXIT_S", float, lambda v: v >= 0,
                       "a number of seconds >= 0 (0: never)", default=300.0)
    return value or None


def service() -> bool:
    """HOTSWAP_SERVICE: whether the compile service is the default executor."""
    return _choice("HOTSWAP_SERVICE", ("on", "off"), "off") == "on"


def start_early() -> bool:
    """HOTSWAP_START_EARLY: whether importing hotswap starts the compile workers."""
    return _choice("HOTSWAP_START_EARLY", ("on", "off"), "on") == "on"


def service_dir() -> str | None:
    """As set (None: the default, which ``hotswap.service.place`` chooses)."""
    return _text("HOTSWAP_SERVICE_DIR")


def service_idle_exit_s() -> float:
    value = env_number("HOTSWAP_SERVICE_IDLE_EXIT_S", float, lambda v: 0 < v < float("inf"),
                       "a number of seconds > 0", default=600.0)
    assert value is not None
    return value


def pycache() -> str:
    """HOTSWAP_PYCACHE: "auto", "on" or "off" (hotswap.system.bytecode)."""
    return _choice("HOTSWAP_PYCACHE", ("auto", "on", "off"), "auto")


def gc_freeze() -> bool:
    """HOTSWAP_GC_FREEZE: whether the warm-up freezes the heap (hotswap.system.heap)."""
    return _choice("HOTSWAP_GC_FREEZE", ("on", "off"), "on") == "on"


def eager_threads() -> str:
    """HOTSWAP_EAGER_THREADS: "auto" or "keep" (hotswap.system.cores)."""
    return _choice("HOTSWAP_EAGER_THREADS", ("auto", "keep"), "auto")


def switch_interval_s() -> float:
    value = env_number("HOTSWAP_SWITCH_INTERVAL_S", float, lambda v: 0 < v <= 1,
                       "a number of seconds in (0, 1]", default=_SWITCH_INTERVAL_S)
    assert value is not None
    return value


def log_level() -> int | None:
    """A ``logging`` level (None: off)."""
    setting = os.environ.get("HOTSWAP_LOG", "info").strip().lower()
    if setting not in _LOG_LEVELS:
        raise ValueError(f"HOTSWAP_LOG must be one of {list(_LOG_LEVELS)}, got {setting!r}")
    return _LOG_LEVELS[setting]


def check_all() -> None:
    """Read every variable no option of ``hotswap.compile`` reads (ValueError naming the first
    malformed one), so that it fails at compile(), not in the first call or a background
    thread."""
    for read in (workers, worker_nice, worker_idle, worker_yield, worker_rss_limit_bytes,
                 cache_max_bytes,
                 switch_interval_s, log_level, worker_idle_exit_s, claim_ttl_s, service,
                 service_idle_exit_s, pycache, gc_freeze, parts, start_early, eager_threads):
        read()
