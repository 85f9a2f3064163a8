"""Where a job runs: the local worker pool (local.py), a Dask cluster (dask.py), or any
executor registered for an address scheme; registry.py resolves an ``executor=`` spec to one.

``base.Executor`` is the contract (submit a named job with a payload; the future resolves);
``registry.check`` tells a valid ``executor=`` value from an invalid one without importing
any executor, so that options can check it at ``hotswap.compile``.
"""
