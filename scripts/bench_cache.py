"""Benchmark: a cold process vs a warm one on the same model and the same artifact cache.

Both processes start with empty inductor and triton caches, so what the warm one saves is
hotswap's artifact cache alone. Measured per model, on the user's clock (from each process's
start, nothing left out): when the final tier serves (progressive ladder default ->
max-autotune-no-cudagraphs, or async's default tier), when the first call started (imports
and the model's construction: "ready"), and worker compiles.
Target: warm <= 0.3x cold, with 0 worker compiles.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

# Runs from a checkout as it is (e.g. on a GPU machine without network): hotswap is one level up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# This harness compiles nothing; each row's process starts its own workers as the caller
# had them (row_env).
CALLER_START_EARLY = os.environ.get("HOTSWAP_START_EARLY")
os.environ["HOTSWAP_START_EARLY"] = "off"
from hotswap.tools.bench.spawn import spawn_row  # noqa: E402
from hotswap.tools.common import cuda_available  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--mode", default="progressive", choices=["async", "progressive"])
    parser.add_argument("--device", default="cuda" if cuda_available() else "cpu")
    parser.add_argument("--workers", type=int, default=None,
                        help="hotswap pool size (default: hotswap's)")
    parser.add_argument("--caller", choices=("busy", "idle"), default="busy",
                        help="as hotswap bench --caller (default busy)")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--interval-ms", type=float, default=5.0)
    args = parser.parse_args()
    args.start_early = CALLER_START_EARLY
    args.threads, args.prepare, args.floor_s = None, False, 20.0  # hotswap bench's defaults
    print("times from each process's start; ready = its first call (imports, model built)")
    print(f"{'model':<14}{'cold ready/final s':>20}{'warm ready/final s':>20}{'ratio':>8}"
          f"{'compiles cold/warm':>20}{'hits warm':>11}  target <= 0.3x, 0 compiles")
    for model in args.models.split(","):
        args.model = model
        with tempfile.TemporaryDirectory(prefix="hotswap-bench-cache-") as shared:
            env = {"HOTSWAP_CACHE_DIR": shared}
            cold = spawn_row(f"hotswap:{args.mode}", args, env=env)
            warm = spawn_row(f"hotswap:{args.mode}", args, env=env)
        if "error" in cold or "error" in warm or not cold["to_final_s"] or not warm["to_final_s"]:
            print(f"{model:<14} failed: {cold.get('error') or warm.get('error') or 'no final'}")
            continue
        ratio = warm["to_final_s"] / cold["to_final_s"]
        compiles = (cold["counters"]["worker_compiles"], warm["counters"]["worker_compiles"])
        met = ratio <= 0.3 and compiles[1] == 0
        cold_s = f"{cold['ready_s']:.2f} / {cold['to_final_s']:.2f}"
        warm_s = f"{warm['ready_s']:.2f} / {warm['to_final_s']:.2f}"
        print(f"{model:<14}{cold_s:>20}{warm_s:>20}{ratio:>7.2f}x"
              f"{f'{compiles[0]} / {compiles[1]}':>20}{warm['counters']['cache_hits']:>11}  "
              f"{'met' if met else 'MISSED'}")


if __name__ == "__main__":
    main()
