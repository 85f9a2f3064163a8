"""Beyond one machine: a shared artifact store (store.py, Redis), a cluster executor
(cluster.py, Dask) and service metrics (metrics.py). Each needs the optional ``fleet`` extra
(``pip install 'hotswap[fleet]'``); nothing here imports it before it is used.

A Dask worker for hotswap: ``dask worker tcp://scheduler:8786 --nthreads 1 --preload
hotswap.fleet.preload`` (the preload warms the worker as a local compile worker warms).
"""

from hotswap.fleet.cluster import Cluster, LocalCluster, cluster_stamp, warm_worker
from hotswap.fleet.store import FleetStore, load_fleet_key

__all__ = ["Cluster", "FleetStore", "LocalCluster", "cluster_stamp", "load_fleet_key",
           "warm_worker"]
