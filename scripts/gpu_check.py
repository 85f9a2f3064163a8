"""One command for a GPU machine without network: GPU tests, a quick benchmark, a profile.

    python3 scripts/gpu_check.py --out DIR        (or scripts/gpu_check --out DIR)

Uses the Python it runs under (torch, triton, psutil, msgpack, filelock preinstalled) and
installs hotswap from this checkout with pip --no-index --no-deps (nothing is fetched). Steps
(--steps, default tests,bench), each bounded so the whole stays under --budget-s (default 540 s):
  tests    pytest tests/gpu           -> DIR/gpu_tests.log, DIR/gpu_tests.xml
  bench    hotswap bench --quick      -> DIR/bench.log, DIR/bench.json, DIR/BENCHMARKS.md (the
           repository's, with its GPU section replaced by this run's: copy it back to keep it)
  profile  hotswap profile --model    -> DIR/profile/ (report.txt, trace.json, records); not in
           the default set: tests and bench take most of the ten minutes on a fresh machine
  corpus   hotswap corpus --device cuda (CUDA sizes, bf16; async and progressive; 8 cases at
           a time) -> DIR/corpus.log, DIR/corpus.json (written after every case); --quick
           runs its four-model subset. Alone, it takes the whole budget
DIR/summary.json holds the outcome of each step; DIR/gpu_check.log everything printed.
Exit status: 0 when the tests passed and every step finished.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class Log:
    def __init__(self, path: Path) -> None:
        self._file = path.open("a")

    def __call__(self, message: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {message}"
        print(line, flush=True)
        self._file.write(line + "\n")
        self._file.flush()


def _run(cmd: list[str], log_path: Path, timeout_s: float, log: Log) -> dict[str, Any]:
    log(f"$ {' '.join(cmd)}  (limit {timeout_s:.0f} s, output in {log_path.name})")
    start = time.monotonic()
    with log_path.open("w") as out:
        try:
            done = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=max(1.0, timeout_s), check=False)
            rc: int | None = done.returncode
        except subprocess.TimeoutExpired:
            rc = None
    elapsed = time.monotonic() - start
    log(f"  -> {'timed out' if rc is None else f'exit {rc}'} after {elapsed:.1f} s")
    return {"cmd": cmd, "rc": rc, "timed_out": rc is None, "elapsed_s": round(elapsed, 1),
            "log": str(log_path)}


def _ensure_installed(log: Log) -> None:
    try:
        import hotswap  # noqa: F401
        return
    except ImportError:
        pass
    log("installing hotswap from this checkout (no index, no dependencies)")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--no-index", "-e", str(REPO)], check=True)


def _junit(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"error": "no junit xml written"}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None
    failures = []
    for case in suite.iter("testcase"):
        for bad in (*case.findall("failure"), *case.findall("error")):
            failures.append({"test": f"{case.get('classname')}::{case.get('name')}",
                             "message": (bad.get("message") or "")[:2000]})
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for logs and summary.json")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="wall-clock budget for all steps (default 540)")
    parser.add_argument("--steps", default="tests,bench",
                        help="comma list of steps to run, from tests,bench,profile,corpus "
                             "(default tests,bench)")
    parser.add_argument("--quick", action="store_true",
                        help="corpus step: only its four-model subset")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "gpu_check.log")
    start = time.monotonic()
    steps = {s.strip() for s in args.steps.split(",") if s.strip()}
    unknown = steps - {"tests", "bench", "profile", "corpus"}
    if unknown or not steps:
        parser.error(f"--steps: unknown {sorted(unknown)}; choose from tests, bench, profile, "
                     "corpus")

    def left(reserve_s: float = 0.0) -> float:
        return float(args.budget_s) - (time.monotonic() - start) - reserve_s

    _ensure_installed(log)
    import torch

    summary: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "steps": {},
    }
    try:
        import triton

        summary["triton"] = triton.__version__
    except ImportError:
        summary["triton"] = None
    log(f"{summary['device']}  torch {summary['torch']}  triton {summary['triton']}  "
        f"python {summary['python']}")
    if summary["device"] is None:
        log("no CUDA device: the GPU tests would all skip; stopping")
        summary["error"] = "no CUDA device"
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        return 2
    env_py = [sys.executable]
    if "tests" in steps:
        step = _run([*env_py, "-m", "pytest", "tests/gpu", "-q", "-s", "-p", "no:cacheprovider",
                     "--durations=0", f"--junitxml={out / 'gpu_tests.xml'}"], out / "gpu_tests.log",
                    left(reserve_s=320 if "bench" in steps else 0), log)
        step["results"] = _junit(out / "gpu_tests.xml")
        summary["steps"]["tests"] = step
        log(f"  tests: {step['results']}")
    if "bench" in steps:
        if (REPO / "BENCHMARKS.md").exists():
            (out / "BENCHMARKS.md").write_text((REPO / "BENCHMARKS.md").read_text())
        step = _run([*env_py, "-m", "hotswap.tools.bench.main", "--quick", "--device", "cuda",
                     "--json", str(out / "bench.json"), "--write-md", str(out / "BENCHMARKS.md")],
                    out / "bench.log", left(reserve_s=60 if "profile" in steps else 0), log)
        if (out / "bench.json").exists():
            step["results"] = json.loads((out / "bench.json").read_text())
        summary["steps"]["bench"] = step
    if "profile" in steps:
        summary["steps"]["profile"] = _run(
            [*env_py, "-m", "hotswap.cli", "profile", "--model", "mlp", "--device", "cuda",
             "--dtype", "bfloat16", "--duration-s", str(max(10, int(left(30) - 30))),
             "--out", str(out / "profile"), "--wait-s", "30"],
            out / "profile.log", left(), log)
    if "corpus" in steps:
        step = _run([*env_py, "-m", "hotswap.tools.corpus_cmd", "--device", "cuda", "--jobs", "8",
                     "--workers", "2", "--timeout-s", "240", "--json", str(out / "corpus.json")]
                    + (["--quick"] if args.quick else []), out / "corpus.log", left(), log)
        if (out / "corpus.json").exists():
            step["results"] = json.loads((out / "corpus.json").read_text())
        summary["steps"]["corpus"] = step
    summary["elapsed_s"] = round(time.monotonic() - start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    ok = all(s["rc"] == 0 for s in summary["steps"].values())
    log(f"done in {summary['elapsed_s']} s: {'all steps passed' if ok else 'SOME STEPS FAILED'}"
        f"; summary in {out / 'summary.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
