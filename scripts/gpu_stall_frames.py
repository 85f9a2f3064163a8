"""Where a GPU caller's slow calls wait: GPT-2 (corpus, bf16) through hotswap.compile(mode=
"async"), called back to back; a sampler thread reads the caller's stack whenever a call has
run longer than 30 ms and counts the stacks it finds. A call waiting on a lock (an import
another thread holds) shows that wait's frame.

    python scripts/gpu_stall_frames.py [seconds]
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
    work = zoo.make("corpus:gpt2", device="cuda", dtype="bfloat16")
    model, inputs = work.target, work.inputs(0)
    compiled = hotswap.compile(model, mode="async")
    started: list[float | None] = [None]
    stacks: collections.Counter[str] = collections.Counter()
    main_id = threading.main_thread().ident

    def sample() -> None:
        while True:
            time.sleep(0.003)
            t = started[0]
            if t is not None and time.perf_counter() - t > 0.03:
                frame = sys._current_frames().get(main_id)
                if frame is not None:
                    stacks["\n".join(f"  {s.filename.split('site-packages/')[-1]}:{s.lineno} "
                                     f"{s.name}" for s in traceback.extract_stack(frame)[-12:])] += 1

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
    print("status:", [(s.tier, s.final) for s in hotswap.status(compiled)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
