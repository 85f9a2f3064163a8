"""The machine's compile service: one process per user and build that keeps warm compile
workers and runs the jobs of every hotswap process of that user (sccache's server, Gradle's
daemon). place.py: where it lives and what is trusted; wire.py: what crosses its socket;
server.py: the service; control.py: finding, starting and stopping it;
``hotswap.executors.service``: the executor that sends it jobs. ``python -m hotswap.service``
runs it (clients start it on demand).
"""
