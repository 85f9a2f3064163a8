"""Packing and loading compiled artifacts off the caller's path: without compiler runs, on the
load thread (engine/threads.py), after the process's one-time warm-up; CUDA graphs captured
after the swap.
"""
