"""The Dask executor: compile jobs and gate benchmarks on a Dask cluster.

    DaskExecutor.submit(job, payload) --(Dask client)--> a Dask worker: run_job(job, payload,
                                                         stamp): the same job functions as a
                                                         local worker runs, one at a time
    the future resolves with the job's wire result, or: the job's error -> CompileFailed;
    a lost worker or connection -> ClusterWorkerLost (a WorkerCrashed: retried once, by
    RetryingExecutor); past timeout_s -> JobTimeout; a worker of another build ->
    ExecutorUnavailable: the local pool takes the job (and every later one)

Dask schedules, moves data and reruns a task whose worker died (up to its scheduler's
``distributed.scheduler.allowed-failures``); hotswap adds no RPC of its own. The connection
is made on a thread when the executor is first used: a cluster that cannot be reached, has no
workers, or whose workers differ from this process in torch build, triton, Python or device
(the stamp, as cache entries carry) is refused with one warning, and the local pool compiles.
Artifacts come back as bytes and load in this process as a local worker's do.

The registry (registry.py) imports this module by name for the Dask address schemes and for a
``distributed.Client``, on first use: nothing imports Dask before a cluster is asked for. Jobs
travel by name, so this module imports none of the job code it runs. Dask pickles ``run_job``,
``cluster_stamp`` and ``warm_worker`` by reference: ``hotswap.fleet.cluster`` re-exports them,
so a caller of an earlier hotswap (which sends ``hotswap.fleet.cluster.run_job``) still runs.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from hotswap.errors import ClusterWorkerLost, CompileFailed, JobTimeout, PoolClosed
from hotswap.executors import registry
from hotswap.executors.base import (
    BENCH_JOB,
    COMPILE_JOB,
    ENVIRONMENT_STAMP,
    WARM_COMPILE_JOB,
    WARM_DEVICE_JOB,
    ExecutorUnavailable,
)
from hotswap.executors.registry import check as parse_executor
from hotswap.system import bytecode
from hotswap.workers import JobFuture
from hotswap.workers.child import resolve_job
from hotswap.workers.inbox import resolve

__all__ = [
    "EXECUTOR_ENV",
    "Cluster",
    "DaskExecutor",
    "LocalCluster",
    "StampMismatch",
    "cluster_stamp",
    "parse_executor",
    "run_job",
    "warm_worker",
]

log = logging.getLogger("hotswap")

EXECUTOR_ENV = "HOTSWAP_EXECUTOR"
CONNECT_TIMEOUT_S = 10.0

# One job at a time per worker process: dynamo and inductor keep process-wide state, and a
# Dask worker runs tasks on a thread pool.
_job_lock = threading.Lock()


class StampMismatch(RuntimeError):
    """A cluster worker runs another build than the process that sent it a job."""


def cluster_stamp() -> dict[str, Any]:
    """What a cluster worker must share with the caller for its artifacts to load there."""
    import torch

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return {**resolve_job(ENVIRONMENT_STAMP)(devices), "python": list(sys.version_info[:2])}


@functools.cache
def _local_stamp() -> dict[str, Any]:
    """This process's ``cluster_stamp`` (the caller's, or a cluster worker's)."""
    return cluster_stamp()


def _differences(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Each stamp field that differs: (ours, theirs)."""
    return {k: (v, theirs.get(k)) for k, v in ours.items() if theirs.get(k) != v}


def run_job(job: str, payload: Any, stamp: dict[str, Any]) -> Any:
    """A Dask task: one hotswap job, run as a local worker runs it, if this worker's build
    is the caller's."""
    with _job_lock:
        if _local_stamp() != stamp:
            raise StampMismatch(f"this worker's build differs from the caller's "
                                f"(caller, worker): {_differences(stamp, _local_stamp())}")
        result = resolve_job(job)(payload)
    if isinstance(result, dict) and isinstance(result.get("entry"), pickle.PickleBuffer):
        result = {**result, "entry": bytes(result["entry"].raw())}
    return result


def warm_worker() -> None:
    """A cluster worker's warm-up (what a local worker does before its first job)."""
    with _job_lock:
        resolve_job(WARM_DEVICE_JOB)(None)
        resolve_job(WARM_COMPILE_JOB)(None)


class LocalCluster:
    """A Dask scheduler and ``workers`` worker processes (one thread each, warmed) on this
    machine, each a program of its own (``dask scheduler`` / ``dask worker``) in a session of
    its own: nothing of Dask's runs in this process, whose environment it leaves alone
    (``distributed.LocalCluster`` sets OMP_NUM_THREADS=1 in its caller's environment, which
    every process started later inherits, and leaves a helper process behind). ``close()``
    stops them all; ``extra_env`` goes to the workers (e.g. CUDA_VISIBLE_DEVICES)."""

    def __init__(self, workers: int = 1, *, extra_env: Mapping[str, str] | None = None,
                 allowed_failures: int | None = None, timeout_s: float = 120.0) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.scheduler_address = f"tcp://127.0.0.1:{port}"
        python = [sys.executable, "-m"]
        # Its workers import torch and inductor: where that recompiles sources at every
        # start, they read bytecode compiled once (hotswap/system/bytecode.py).
        quiet = bytecode.child_env({**os.environ, "DASK_LOGGING__DISTRIBUTED": "error"})
        scheduler = dict(quiet) if allowed_failures is None else {
            **quiet, "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": str(allowed_failures)}
        self._procs = [subprocess.Popen(
            [*python, "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port",
             str(port), "--no-dashboard"], start_new_session=True, env=scheduler,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        self._procs.append(subprocess.Popen(
            [*python, "distributed.cli.dask_worker", self.scheduler_address, "--nworkers",
             str(workers), "--nthreads", "1", "--no-dashboard", "--preload",
             "hotswap.fleet.preload"], start_new_session=True, env={**quiet, **(extra_env or {})},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        try:
            from distributed import Client

            with Client(self.scheduler_address,  # type: ignore[no-untyped-call]
                        timeout=timeout_s, set_as_default=False) as client:
                client.wait_for_workers(workers, timeout=timeout_s)
                client.run(warm_worker)  # waits for the preload's warm-up
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for proc in self._procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        self._procs = []

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class Cluster:
    """One connection to a Dask cluster, made on a thread; ``client()`` waits for it (None:
    refused or unreachable, said once)."""

    def __init__(self, target: Any, *, warm: bool = True) -> None:
        self.target = target
        self.name = target if isinstance(target, str) else str(getattr(target, "scheduler", ""))
        self._ready: Future[Any] = Future()
        self._refused = ""
        self.closed = False  # hotswap.shutdown(): jobs fail as a closed pool's do
        self._lock = threading.Lock()
        threading.Thread(target=self._connect, args=(warm,), daemon=True,
                         name="hotswap-cluster").start()

    @property
    def refused(self) -> str:
        """Why the cluster is not used ("" while it is, or not yet known)."""
        return self._refused

    def client(self, timeout_s: float | None = None) -> Any:
        try:
            return self._ready.result(timeout_s)
        except TimeoutError:
            return None

    def when_ready(self, fn: Callable[[Any], None]) -> None:
        """``fn(client or None)`` once connected or refused, on this or the connecting thread."""
        self._ready.add_done_callback(lambda f: fn(f.result()))

    def _connect(self, warm: bool) -> None:
        try:
            client = self.target
            if isinstance(client, str):
                from distributed import Client

                address = client.replace("dask://", "tcp://", 1)
                client = Client(address, timeout=CONNECT_TIMEOUT_S,  # type: ignore[no-untyped-call]
                                set_as_default=False)
            stamps = client.run(cluster_stamp)
            if not stamps:
                raise StampMismatch("the cluster has no workers")
            mine = _local_stamp()
            for worker, theirs in stamps.items():
                if theirs != mine:
                    raise StampMismatch(f"worker {worker} runs another build (here, there): "
                                        f"{_differences(mine, theirs)}")
            if warm:  # each worker pays its first compile's set-up now, not in a job
                from distributed import fire_and_forget

                for worker in stamps:
                    fire_and_forget(client.submit(  # type: ignore[no-untyped-call]
                        warm_worker, workers=[worker], pure=False))
        except BaseException as e:
            self.refuse(f"{type(e).__name__}: {e}")
            return
        self._ready.set_result(client)

    def close(self) -> None:
        """Close the connection if this made it (a Client handed in stays the caller's)."""
        self.closed = True
        client = self._ready.result() if self._ready.done() else None
        if client is not None and isinstance(self.target, str):
            try:
                client.close(timeout=2)
            except Exception:  # closing at interpreter exit: nothing left to tell
                pass

    def refuse(self, why: str) -> None:
        """Stop using the cluster (said once); its jobs go to the local pool."""
        with self._lock:
            if self._refused:
                return
            self._refused = why
        log.warning("hotswap: cluster %s not used (%s); compiling in the local worker pool",
                    self.name, why)
        if not self._ready.done():
            self._ready.set_result(None)


class DaskExecutor:
    """The ``Executor`` of ``cluster`` (a ``Cluster``, or the address or ``distributed.Client``
    to connect one to). A job it cannot send (the cluster is refused, or a worker of another
    build turned up) fails with ``ExecutorUnavailable``: the registry puts the local pool
    behind it. ``shutdown()`` closes the connection; jobs still pending fail with
    ``PoolClosed``."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster if isinstance(cluster, Cluster) else Cluster(cluster)

    def submit(self, job: str, payload: Any, timeout_s: float | None) -> JobFuture:
        outer = JobFuture(job, -1)
        self.cluster.when_ready(lambda client: self._dispatch(client, outer, job, payload,
                                                              timeout_s))
        return outer

    def shutdown(self, wait: bool = True) -> None:
        self.cluster.close()

    def _dispatch(self, client: Any, outer: JobFuture, job: str, payload: Any,
                  timeout_s: float | None) -> None:
        if self.cluster.closed:
            resolve(outer, error=PoolClosed("hotswap was shut down"))
            return
        if client is None or getattr(client, "status", "running") != "running":
            resolve(outer, error=ExecutorUnavailable(self.cluster.refused or "no client"))
            return
        try:
            if job == BENCH_JOB:
                payload = _with_bytes(payload)
            task = client.submit(run_job, job, payload, _local_stamp(), pure=False)
        except LookupError as e:
            resolve(outer, error=e)
            return
        except Exception as e:
            resolve(outer, error=ClusterWorkerLost(f"{type(e).__name__}: {e}", job=job))
            return
        outer.set_running_or_notify_cancel()
        if timeout_s is not None:
            timer = threading.Timer(timeout_s, self._timed_out, (task, outer, job, timeout_s))
            timer.daemon = True
            timer.start()
        task.add_done_callback(lambda t: self._finished(t, outer, job))

    def _timed_out(self, task: Any, outer: JobFuture, job: str, timeout_s: float) -> None:
        if not outer.done():  # settled first: the cancelled task's callback finds it done
            resolve(outer, error=JobTimeout(timeout_s, 0, job=job))
            task.cancel()

    def _finished(self, task: Any, outer: JobFuture, job: str) -> None:
        """On Dask's callback thread: the job's result, or what became of it."""
        if outer.done():
            return
        try:
            result = task.result()
            task.release()  # the cluster may forget it now
        except StampMismatch as e:  # a worker joined with another build: no cluster for us
            self.cluster.refuse(str(e))
            resolve(outer, error=ExecutorUnavailable(str(e)))
            return
        except BaseException as e:
            resolve(outer, error=PoolClosed("hotswap was shut down") if self.cluster.closed
                    else _job_error(e, job))
            return
        if job == COMPILE_JOB:
            registry.count("remote_compiles")
        resolve(outer, result=result)


def _job_error(error: BaseException, job: str) -> BaseException:
    """A cluster job's failure as a local worker's would be: lost work is a crash (retried),
    the job's own exception a CompileFailed."""
    name = type(error).__name__
    lost = name in ("KilledWorker", "CommClosedError", "CancelledError", "FutureCancelledError",
                    "TimeoutError") or isinstance(error, OSError)
    if lost:
        return ClusterWorkerLost(f"{name}: {error}", job=job)
    text = "".join(traceback.format_exception(error))
    return CompileFailed(job, f"{type(error).__module__}.{name}", str(error), text)


def _with_bytes(payload: dict[str, Any]) -> dict[str, Any]:
    """A benchmark request whose entries name this machine's cache carries their bytes
    instead: a cluster worker cannot read this machine's files."""
    from hotswap.cache import ArtifactCache

    entries = {}
    for tier, entry in payload["entries"].items():
        if isinstance(entry, dict):
            data = ArtifactCache(entry["cache_dir"], read_only=True).get(entry["key"], touch=False)
            if data is None:
                raise LookupError(f"the artifact cache no longer holds entry {entry['key'][:12]}")
            entry = data
        entries[tier] = entry
    return {**payload, "entries": entries}
