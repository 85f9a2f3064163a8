"""Beyond one machine: a shared artifact store (store.py, Redis), a cluster executor
(``hotswap.executors.dask``, Dask) and service metrics (metrics.py). Each needs the optional
``fleet`` extra (``pip install 'hotswap[fleet]'``); nothing here imports it before it is used,
and the names below are imported on first use.

A Dask worker for hotswap: ``dask worker tcp://scheduler:8786 --nthreads 1 --preload
hotswap.fleet.preload`` (the preload warms the worker as a local compile worker warms).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hotswap.executors.dask import Cluster, LocalCluster, cluster_stamp, warm_worker
    from hotswap.fleet.store import FleetStore, load_fleet_key

__all__ = ["Cluster", "FleetStore", "LocalCluster", "cluster_stamp", "load_fleet_key",
           "warm_worker"]

_LAZY = {"Cluster": "hotswap.executors.dask", "LocalCluster": "hotswap.executors.dask",
         "cluster_stamp": "hotswap.executors.dask", "warm_worker": "hotswap.executors.dask",
         "FleetStore": "hotswap.fleet.store", "load_fleet_key": "hotswap.fleet.store"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hotswap.fleet' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
