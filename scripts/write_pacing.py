"""Does a large file write in the serving process slow the caller's calls, and does writing it
as a cache write does (store.write_atomic's pieces and rests, on a lowered thread) help?

    .venv/bin/python scripts/write_pacing.py [--mib 148] [--rounds 2]

The caller runs a 2-thread-sized matmul (256x768 @ 768x3072, ReLU, sum) every 2 ms while a
thread writes ``--mib`` MiB of random bytes to a temporary file and syncs it, each way in
turn: "none" (no write: the machine alone), "at once" (one write call, the thread at the
caller's niceness), "niceness 19" (one write call from a thread at niceness 19), "paced"
(``threads.run_lowered`` and ``write_atomic(rest_s=cache_access.WRITE_REST_S)``, as a cache
write runs). Per way: how long the write took and the caller's median, p90 and largest call.
Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hotswap.cache.store import write_atomic
from hotswap.engine import threads
from hotswap.engine.sources.cache_access import WRITE_REST_S


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=148, help="MiB to write (default 148: "
                        "inductor's precompiled header for CPU kernels, which entries ship)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    x, w = torch.randn(256, 768), torch.randn(768, 3072)
    payload = os.urandom(1 << 20) * args.mib
    folder = Path(tempfile.mkdtemp(prefix="hotswap-write-pacing-"))

    def at_once() -> None:
        _one_call(folder / "f", payload)

    def niceness_19() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        _one_call(folder / "f", payload)

    ways: dict[str, Callable[[], None]] = {
        "none": lambda: time.sleep(0.6),
        "at once": at_once,
        "niceness 19": niceness_19,
        "paced": lambda: threads.run_lowered(
            lambda: write_atomic(folder / "f", payload, rest_s=WRITE_REST_S), name="writer"),
    }
    print(f"{args.mib} MiB, a call every 2 ms, torch intra-op threads: {torch.get_num_threads()}")
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
            print(f"  {way:12s} write {took * 1e3:5.0f} ms  calls {len(calls):3d}  median "
                  f"{calls[len(calls) // 2] * 1e3:5.2f}  p90 {calls[int(len(calls) * 0.9)] * 1e3:5.2f}"
                  f"  largest {calls[-1] * 1e3:5.1f} ms")
            time.sleep(1.0)
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()


def _one_call(path: Path, payload: bytes) -> None:
    """``payload`` in one write call, synced: a write as plain file code does it."""
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


if __name__ == "__main__":
    main()
