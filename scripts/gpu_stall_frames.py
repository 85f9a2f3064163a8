"""Where a GPU caller's slow calls wait: a model (default GPT-2 from the corpus, bf16)
through hotswap.compile(mode="async"), called back to back; a sampler thread reads the
caller's stack whenever a call has run longer than 30 ms and counts the stacks it finds, and
beside each the innermost frames of every other thread (what ran instead of the caller). A
call waiting on a lock (an import another thread holds) shows that wait's frame.

    python scripts/gpu_stall_frames.py [seconds] [model]

With HOTSWAP_SERVICE=on, a first run with another model starts and warms the compile service;
a second, with fresh caches, is a process that finds the service warm.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import traceback

import torch

import hotswap
from hotswap.tools import zoo


def main() -> int:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 35.0
    work = zoo.make(sys.argv[2] if len(sys.argv) > 2 else "corpus:gpt2", device="cuda",
                    dtype="bfloat16")
    model, inputs = work.target, work.inputs(0)
    compiled = hotswap.compile(model, mode="async")
    started: list[float | None] = [None]
    stacks: collections.Counter[str] = collections.Counter()
    others: collections.Counter[str] = collections.Counter()
    main_id = threading.main_thread().ident

    def where(frame: object, depth: int) -> str:
        return "\n".join(f"  {s.filename.split('site-packages/')[-1]}:{s.lineno} {s.name}"
                         for s in traceback.extract_stack(frame)[-depth:])  # type: ignore[arg-type]

    def sample() -> None:
        names = {}
        while True:
            time.sleep(0.003)
            t = started[0]
            if t is not None and time.perf_counter() - t > 0.03:
                frames = sys._current_frames()
                frame = frames.get(main_id)
                if frame is not None:
                    stacks[where(frame, 12)] += 1
                if not names or len(names) != threading.active_count():
                    names = {th.ident: th.name for th in threading.enumerate()}
                for ident, other in frames.items():
                    if ident not in (main_id, threading.get_ident()):
                        others[f"[{names.get(ident, ident)}]\n{where(other, 4)}"] += 1

    threading.Thread(target=sample, daemon=True).start()
    slow: list[tuple[float, float]] = []
    origin = time.perf_counter()
    with torch.no_grad():
        while time.perf_counter() - origin < seconds:
            started[0] = t = time.perf_counter()
            compiled(*inputs)
            torch.cuda.synchronize()
            took = time.perf_counter() - t
            started[0] = None
            if took > 0.03:
                slow.append((round(t - origin, 2), round(took * 1e3, 1)))
    print("slow calls (s after the first call, ms):", slow)
    for stack, n in stacks.most_common(8):
        print(f"{n} samples:\n{stack}\n")
    print("meanwhile, the other threads:")
    for stack, n in others.most_common(12):
        print(f"{n} samples: {stack}\n")
    print("status:", [(s.tier, s.final) for s in hotswap.status(compiled)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
