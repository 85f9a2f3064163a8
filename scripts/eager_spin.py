"""How many cores does a caller's eager model keep busy, with its own intra-op threads and with
the fewer threads hotswap's eager answers take while compile workers run?

    .venv/bin/python scripts/eager_spin.py [--model corpus:gpt2] [--interval-ms 2] [--window-s 5]

The model is called every ``--interval-ms`` (after each call returns) for ``--window-s``, each
way in turn, twice: with torch's intra-op threads as they are ("own"), and with one thread
fewer on the calling thread alone, as ``hotswap.system.cores.with_threads`` runs an eager
answer beside one running worker ("lent"). Per way: the process's CPU time over the window's
wall time (the cores it kept busy: torch's OpenMP and MKL threads spin-wait between parallel
regions) and the median call. Nothing else of hotswap runs. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from hotswap.system import cores
from hotswap.system.proctree import usable_cores
from hotswap.tools import zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="corpus:gpt2", help="a zoo model or corpus:NAME")
    parser.add_argument("--interval-ms", type=float, default=2.0)
    parser.add_argument("--window-s", type=float, default=5.0)
    args = parser.parse_args()
    own = torch.get_num_threads()
    if own < 2:
        parser.error(f"torch runs {own} intra-op thread here: there is none to lend")
    if not zoo.known(args.model):
        parser.error(f"unknown model {args.model!r}")
    workload = zoo.make(args.model, device="cpu")
    model, inputs = workload.target, workload.inputs(0)
    print(f"{args.model}: {usable_cores()} cores, {own} intra-op threads; a call every "
          f"{args.interval_ms:g} ms for {args.window_s:g} s per way")
    ways = {"own": lambda: model(*inputs),
            "lent": lambda: cores.with_threads(own - 1, own, model, inputs)}
    with torch.no_grad():
        for _ in range(2):
            for way, call in ways.items():
                for _ in range(20):
                    call()
                calls: list[float] = []
                wall0, cpu0 = time.perf_counter(), time.process_time()
                while time.perf_counter() - wall0 < args.window_s:
                    started = time.perf_counter()
                    call()
                    calls.append(time.perf_counter() - started)
                    time.sleep(args.interval_ms / 1e3)
                busy = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
                calls.sort()
                print(f"  {way:5s} cores busy {busy:.2f}  calls {len(calls):5d}  "
                      f"median call {calls[len(calls) // 2] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
