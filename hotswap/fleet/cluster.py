"""The Dask executor's former home: its names, re-exported from ``hotswap.executors.dask``.

Dask pickles ``run_job``, ``cluster_stamp`` and ``warm_worker`` by reference; a caller of an
earlier hotswap sends them under this module's name, so a worker of this one still runs its
jobs. ``ClusterCompiler`` is the compiler of a cluster with a local compiler behind it.
"""

from __future__ import annotations

from hotswap.engine.sources.compilers import Compiler, CompilerExecutor, ExecutorCompiler
from hotswap.executors.base import FallbackExecutor
from hotswap.executors.dask import (
    CONNECT_TIMEOUT_S,
    EXECUTOR_ENV,
    Cluster,
    DaskExecutor,
    LocalCluster,
    StampMismatch,
    cluster_stamp,
    parse_executor,
    run_job,
    warm_worker,
)
from hotswap.executors.registry import count

__all__ = ["CONNECT_TIMEOUT_S", "EXECUTOR_ENV", "Cluster", "ClusterCompiler", "DaskExecutor",
           "LocalCluster", "StampMismatch", "cluster_stamp", "parse_executor", "run_job",
           "warm_worker"]


class ClusterCompiler(ExecutorCompiler):
    """A ``Compiler`` whose jobs run on ``cluster``, or with ``local`` where it is refused;
    artifacts load as ``local`` loads them."""

    def __init__(self, cluster: Cluster, local: Compiler) -> None:
        super().__init__(FallbackExecutor(DaskExecutor(cluster), CompilerExecutor(local),
                                          on_fallback=lambda job: count("cluster_fallbacks")),
                         loads=local)
