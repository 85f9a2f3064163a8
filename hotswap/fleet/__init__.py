"""Beyond one machine: a shared artifact store (store.py, Redis), a cluster executor
(cluster.py, Dask) and service metrics (metrics.py). Each needs the optional ``fleet`` extra."""
