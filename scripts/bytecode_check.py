"""What recompiling Python sources at every start costs: a fresh ``import torch._inductor.compile_fx``
without usable bytecode against one that reads bytecode compiled once.

Both runs set PYTHONDONTWRITEBYTECODE=1 (as uv-built containers do) and point Python at a
bytecode folder of their own (PYTHONPYCACHEPREFIX): Python then reads bytecode only there, so
an empty folder makes a process compile every module it imports from source, whatever
``__pycache__`` folders the environment holds, and copies nothing. "cold" is that process;
one more process then writes the folder (as hotswap's compile workers do with its bytecode
cache, hotswap/system/bytecode.py); "warm" is the next one, which reads it. Each is timed from
its start to its exit, the median of ``--runs`` fresh processes, measured side by side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

IMPORT = "import torch._inductor.compile_fx"


def timed_import(prefix: str, *, write: bool) -> float:
    """Seconds for a fresh ``python -c IMPORT`` with bytecode in ``prefix`` only."""
    env = {**os.environ, "PYTHONPYCACHEPREFIX": prefix}
    if write:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", IMPORT], env=env, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1,
                        help="fresh processes per side; the median is shown (default 1)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hotswap-pyc-") as prefix:
        cold = [timed_import(prefix, write=False) for _ in range(args.runs)]  # nothing written
        timed_import(prefix, write=True)  # the first process of hotswap's: writes bytecode
        warm = [timed_import(prefix, write=False) for _ in range(args.runs)]
        files = sum(len(names) for _, _, names in os.walk(prefix))
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    print(f"python {sys.version.split()[0]}: {IMPORT!r} in a fresh process, "
          f"PYTHONDONTWRITEBYTECODE=1, median of {args.runs}")
    print(f"  recompiling every source (no bytecode): {cold_s:6.2f} s")
    print(f"  bytecode compiled once ({files} files):  {warm_s:6.2f} s")
    print(f"  ratio: {cold_s / warm_s:.1f}x  (each start saves {cold_s - warm_s:.2f} s)")


if __name__ == "__main__":
    main()
