"""Where a compile job runs: the local worker pool, or a Dask cluster (``hotswap.fleet``).

``registry.check`` tells a valid ``executor=`` value from an invalid one without importing
any executor, so that options can check it at ``hotswap.compile`` (stdlib only).
"""
