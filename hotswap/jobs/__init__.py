"""What runs inside a worker: a tier's compile and a gate's or profile's benchmark.

Named to workers as "hotswap.jobs.compile:run" and "hotswap.jobs.bench:run"; they import torch
and inductor when they run, never the backend's user-side modules.
"""
