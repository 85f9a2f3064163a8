"""Follow one graph from the backend's entry to its swap, and count the files on the way.

    .venv/bin/python scripts/journey_trace.py [--json]

A real async compile of a small MLP on this machine's worker pool (cold caches in a temporary
folder). Every call into a hotswap module, on any thread of this process, is recorded from
``Coordinator.__call__`` until ``GraphRunner.swap_in`` is called (on the caller's thread, only
within the first call: its later ``wait()`` is not the graph's way); the worker's side runs in
another process and is not followed, nor are the worker pool, the cache and profiles: only the
backend's own files (and the executors). Consecutive calls within one file are one visit. Leaves
(counters, settings, errors, the threads registry, logging setup) are left out: they are
called from everywhere and say nothing of the design. Printed: the files in visit order, the
number of distinct files and visits, and the returns (visits to a file already left).

Runs on any tree: with ``PYTHONPATH=<other checkout>`` it follows that checkout's hotswap.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

# The backend's own files (this tree's and the layout before hotswap/engine); the workers,
# the cache and profiles are met through them.
SCOPE = ("engine/", "orchestrator/", "executors/", "compat.py")
LEAVES = {"counting.py", "counters.py", "settings.py", "errors.py", "threads.py", "logs.py",
          "__init__.py"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    os.environ["HOTSWAP_CACHE_DIR"] = tempfile.mkdtemp(prefix="hotswap-journey-")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))
    import torch

    import hotswap

    root = str(Path(hotswap.__file__).parent)
    visits: list[str] = []
    lock = threading.Lock()
    state = {"on": False, "in_call": False}
    main = threading.main_thread()

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event != "call" or not state["on"]:
            return
        if threading.current_thread() is main and not state["in_call"]:
            return  # the user's wait() polling status, not the graph's way
        path = frame.f_code.co_filename
        if not path.startswith(root) or os.path.basename(path) in LEAVES:
            return
        name = os.path.relpath(path, root)
        if not name.startswith(SCOPE):
            return
        with lock:
            if not visits or visits[-1] != name:
                visits.append(name)
            if frame.f_code.co_name == "swap_in" and name.endswith("graph.py"):
                state["on"] = False

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 64)
    threading.setprofile(profile)  # every thread started from now on: the pool's too
    hotswap.prepare(wait=True)
    compiled = hotswap.compile(model, mode="async")
    sys.setprofile(profile)
    state["on"] = state["in_call"] = True
    compiled(x)
    state["in_call"] = False
    hotswap.wait(compiled, timeout_s=300)
    sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]
    left: set[str] = set()
    returns = 0
    for i, name in enumerate(visits):
        if name in left:
            returns += 1
        if i:
            left.add(visits[i - 1])
    again = Counter(visits)
    result = {"files": len(again), "visits": len(visits), "returns": returns,
              "most_visited": again.most_common(5), "order": visits}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print("\n".join(f"{i + 1:3d} {name}" for i, name in enumerate(visits)))
        print(f"\n{len(again)} files, {len(visits)} visits, {returns} returns to a file "
              f"already left; most visited: "
              + ", ".join(f"{n} x{c}" for n, c in again.most_common(5)))
    hotswap.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
