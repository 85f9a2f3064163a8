"""Does a large cache write in the serving process slow the caller's calls, and do the
pieces and rests a cache write takes (store.WRITE_PIECE, cache_access.WRITE_REST_S) help?

    .venv/bin/python scripts/write_pacing.py [--mib 148] [--rounds 2]

The caller runs a matmul on torch's intra-op threads (256x768 @ 768x3072, ReLU, sum) every
2 ms while a thread stores ``--mib`` MiB, each way in turn:

    none              no write: the machine alone
    one write call    the bytes in one write call, then synced (as plain file code does)
    put, no rests     ArtifactCache.put of an entry whose payload is one shared span (as an
                      entry shipping inductor's precompiled header): its hashes and writes
                      a MiB at a time, back to back
    put, paced        the same with cache_access.WRITE_REST_S after each MiB (a serving
                      process's cache write)
    put, paced, 10    the same from a thread at niceness 10
    put, paced, 19    ... at niceness 19 (as a cache write runs: threads.run_lowered)

Per way: how long the store took and the caller's median, p90 and largest call. Each put
goes to a fresh cache folder (a blob already stored is not written again). Run it on a
quiet machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hotswap.cache import ArtifactCache
from hotswap.engine.sources.cache_access import WRITE_REST_S


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=148, help="MiB to store (default 148: "
                        "inductor's precompiled header for CPU kernels, which entries ship)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    x, w = torch.randn(256, 768), torch.randn(768, 3072)
    payload = os.urandom(1 << 20) * args.mib
    folder = Path(tempfile.mkdtemp(prefix="hotswap-write-pacing-"))

    def put(rest_s: float, niceness: int = 0) -> Callable[[], None]:
        def store() -> None:
            if niceness:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
            cache = ArtifactCache(Path(tempfile.mkdtemp(dir=folder)), stamp={"run": 1})
            cache.put("ab" * 32, payload, tier="default", shared=[(0, len(payload))],
                      rest_s=rest_s)
        return store

    def one_write_call() -> None:
        with open(folder / "f", "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())

    ways: dict[str, Callable[[], None]] = {
        "none": lambda: time.sleep(0.6),
        "one write call": one_write_call,
        "put, no rests": put(0.0),
        "put, paced": put(WRITE_REST_S),
        "put, paced, 10": put(WRITE_REST_S, 10),
        "put, paced, 19": put(WRITE_REST_S, 19),
    }
    print(f"{args.mib} MiB, a call every 2 ms, torch intra-op threads: {torch.get_num_threads()}")
    try:
        for _ in range(args.rounds):
            for way, write in ways.items():
                for _ in range(50):
                    torch.relu(x @ w).sum()
                writer = threading.Thread(target=write)
                calls: list[float] = []
                started = time.perf_counter()
                writer.start()
                while writer.is_alive():
                    call_s = time.perf_counter()
                    torch.relu(x @ w).sum()
                    calls.append(time.perf_counter() - call_s)
                    time.sleep(0.002)
                took = time.perf_counter() - started
                calls.sort()
                print(f"  {way:15s} took {took * 1e3:5.0f} ms  calls {len(calls):3d}  median "
                      f"{calls[len(calls) // 2] * 1e3:5.2f}  p90 "
                      f"{calls[int(len(calls) * 0.9)] * 1e3:5.2f}  largest "
                      f"{calls[-1] * 1e3:5.1f} ms")
                time.sleep(1.0)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
