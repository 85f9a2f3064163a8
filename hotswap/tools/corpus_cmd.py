"""``hotswap corpus``: does hotswap compile every real model that torch.compile compiles?

Each (model, mode) runs in a fresh process with empty inductor, triton and hotswap caches, and
so does plain ``torch.compile`` on the same model, so a model torch.compile itself cannot
compile is reported as such and not counted against hotswap. A case builds the model, serves
its first call, waits for every graph's final tier (idle caller), then serves the remaining
steps and compares every output (and, with ``--train``, every gradient) with an eager twin.

Reported per case: graphs, the tier each reached (``eager`` where none did), the path it took
(``worker``, or ``inprocess`` for a graph that cannot travel), max error vs eager, failures by
reason, and the time from process start until the final tier serves (or until --timeout-s,
marked "ladder pending", when a higher tier is still compiling while every graph already
serves compiled code), next to ``torch.compile``'s first call from its process start (ratio).
A case matches eager when its largest difference is within the dtype's tolerance or 1.5x
torch.compile's own difference on that model. Exit status 1 when, on a model torch.compile
compiles, a hotswap case leaves a graph eager or does not match; 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from typing import Any

from hotswap import MODES
from hotswap.tools.common import cuda_available, standalone, subcommand

# A CI-sized subset: a CNN with max-pooling, a ViT, a decoder LLM, an encoder-decoder.
QUICK = ("resnet", "vit", "llama", "t5")


def _since_start() -> float:
    import psutil

    return time.time() - float(psutil.Process().create_time())


def run_case(model: str, mode: str, *, device: str, dtype: str, train: bool,
             timeout_s: float, workers: int | None = None) -> dict[str, Any]:
    """One case, in this process (fresh process expected). ``mode`` is a hotswap mode or
    ``torch`` (plain torch.compile)."""
    import torch

    import hotswap
    from hotswap.tools import corpus

    workload = corpus.make(model, device=device, dtype=dtype, train=train)
    built_s = _since_start()
    result: dict[str, Any] = {"model": model, "mode": mode, "built_s": built_s}
    if mode == "torch":
        from torch._dynamo.utils import counters

        compiled = torch.compile(workload.target)
        try:
            workload.step(compiled, 0)
        except Exception as e:
            result.update(compiled=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            return result
        result.update(compiled=True, first_call_s=_since_start(),
                      graphs=int(counters["stats"]["unique_graphs"]),
                      max_error=_max_error(workload, compiled))
        return result
    compiled = hotswap.compile(workload.target, mode=mode, workers=workers,
                               tiers=["default"] if mode != "progressive" else None)
    workload.step(compiled, 0)
    result["first_output_s"] = _since_start()
    statuses = hotswap.wait(compiled, timeout_s=timeout_s)
    result["final_s"] = _since_start()
    result.update(
        graphs=len(statuses), tiers=[s.tier for s in statuses],
        final=all(s.final for s in statuses),
        paths=sorted({s.path for s in statuses if s.tier != "eager"}),
        failures=[[s.graph_id, tier, reason] for s in statuses for tier, reason in s.failures],
        max_error=_max_error(workload, compiled), tolerance=workload.tolerance)
    return result


def _max_error(workload: Any, compiled: Any) -> float:
    return max(float(workload.error(workload.step(compiled, step), step)) for step in range(1, 4))


def spawn_case(model: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """``run_case`` in a fresh process with empty caches; an error result if it dies."""
    from hotswap.tools.bench.spawn import cold_env

    with tempfile.TemporaryDirectory(prefix="hotswap-corpus-") as cache:
        env = cold_env(cache)
        cmd = [sys.executable, "-m", "hotswap.tools.corpus_cmd", "--case", model, "--modes", mode,
               "--device", args.device, "--dtype", args.dtype, "--timeout-s",
               str(args.timeout_s)] + (["--train"] if args.train else []) + (
                   ["--workers", str(args.workers)] if args.workers else [])
        try:
            out = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                 timeout=args.timeout_s + 300)
        except subprocess.TimeoutExpired:
            return {"model": model, "mode": mode, "error": "no result in time (hang)"}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr.strip().splitlines() or ["?"])[-1][:300]
        return {"model": model, "mode": mode, "error": f"exit {out.returncode}: {tail}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def verdict(case: dict[str, Any], torch_case: dict[str, Any] | None) -> str:
    """``ok``, ``torch-fails`` (torch.compile itself failed: not counted), or what went wrong."""
    if case["mode"] == "torch":
        return "ok" if case.get("compiled") else "torch-fails"
    if torch_case is not None and not torch_case.get("compiled", False):
        return "torch-fails"
    if "error" in case:
        return "error"
    if "eager" in case.get("tiers", []) or not case.get("tiers"):
        return "eager"
    if case.get("max_error", float("inf")) > _allowed_error(case, torch_case):
        return "wrong"
    # Every graph serves compiled code; a higher tier may still be on its way at --timeout-s.
    return "ok" if case.get("final") else "ok (ladder pending)"


def _allowed_error(case: dict[str, Any], torch_case: dict[str, Any] | None) -> float:
    """The dtype's tolerance, or, where plain torch.compile itself differs from eager by more
    (bf16 through deep models: 0.125 on BERT's outputs), a little over what it differs by."""
    tolerance = float(case.get("tolerance", 0.0))
    if torch_case is None or torch_case.get("max_error") is None:
        return tolerance
    return max(tolerance, 1.5 * float(torch_case["max_error"]))


def report(cases: list[dict[str, Any]]) -> list[str]:
    by_model: dict[str, dict[str, dict[str, Any]]] = {}
    for case in cases:
        by_model.setdefault(case["model"], {})[case["mode"]] = case
    lines = [f"{'model':<14}{'mode':<12}{'graphs':>7}  {'tiers':<30}{'path':<18}"
             f"{'max err':>9}{'final s':>9}{'torch s':>9}{'ratio':>7}  verdict"]
    for model, modes in by_model.items():
        ref = modes.get("torch")
        torch_s = ref.get("first_call_s") if ref else None
        for mode, case in modes.items():
            final_s = case.get("first_call_s") if mode == "torch" else case.get("final_s")
            tiers = _count(case.get("tiers", ["compiled"] if case.get("compiled") else []))
            ratio = (f"{final_s / torch_s:.2f}" if final_s and torch_s and mode != "torch"
                     else "-")
            lines.append(
                f"{model:<14}{mode:<12}{case.get('graphs', '-')!s:>7}  {tiers:<30}"
                f"{','.join(case.get('paths', [])) or '-':<18}{_fmt(case.get('max_error'), 3)}"
                f"{_fmt(final_s, 1)}{_fmt(torch_s, 1)}{ratio:>7}  {verdict(case, ref)}")
            for graph, tier, reason in case.get("failures", []):
                lines.append(f"{'':<14}  {graph} {tier}: {reason[:160]}")
            if "error" in case:
                lines.append(f"{'':<14}  {case['error'][:200]}")
    return lines


def _count(items: list[str]) -> str:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return ",".join(f"{k}x{v}" for k, v in counts.items()) or "-"


def _fmt(value: Any, digits: int) -> str:
    return f"{'-':>9}" if value is None else f"{value:>9.{digits}f}"


def summary(cases: list[dict[str, Any]]) -> tuple[list[str], bool]:
    """Per mode: models reaching a compiled tier on every graph, of those torch.compile
    compiles; and whether every one did."""
    torch_ok = {c["model"] for c in cases if c["mode"] == "torch" and c.get("compiled")}
    torch_failed = sorted({c["model"] for c in cases if c["mode"] == "torch"} - torch_ok)
    lines, ok = [], True
    reference = {c["model"]: c for c in cases if c["mode"] == "torch"}
    for mode in sorted({c["mode"] for c in cases} - {"torch"}):
        mine = [c for c in cases if c["mode"] == mode and c["model"] in torch_ok]
        good = [c for c in mine if verdict(c, reference.get(c["model"])).startswith("ok")]
        ok = ok and len(good) == len(mine)
        lines.append(f"{mode}: {len(good)}/{len(mine)} models compiled by torch.compile reach a "
                     f"compiled tier on every graph and match eager as closely as it does")
    if torch_failed:
        lines.append(f"torch.compile itself fails on: {', '.join(torch_failed)} (not counted)")
    return lines, ok


def _progress(done: int, total: int, label: str, started: float) -> None:
    """One line per case on a terminal that is not one (logs); a bar that redraws on a tty."""
    width = 24
    filled = width * done // max(total, 1)
    line = (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
            f"{time.monotonic() - started:5.0f} s  {label}")
    if sys.stderr.isatty():
        print(f"\r{line:<100}", end="" if done < total else "\n", file=sys.stderr, flush=True)
    else:
        print(line, file=sys.stderr, flush=True)


def _run_plan(plan: list[tuple[str, str]], args: argparse.Namespace,
              info: dict[str, Any]) -> list[dict[str, Any]]:
    """Every case, ``--jobs`` at a time; the JSON file is rewritten after each, so a run cut
    short keeps what it finished."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    cases: list[dict[str, Any]] = []
    started = time.monotonic()
    _progress(0, len(plan), f"{len(plan)} cases, {args.jobs} at a time", started)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(spawn_case, model, mode, args): (model, mode)
                   for model, mode in plan}
        for future in as_completed(futures):
            case = future.result()
            cases.append(case)
            model, mode = futures[future]
            outcome = ("failed" if "error" in case else
                       ",".join(case.get("tiers", [])) or ("compiled" if case.get("compiled")
                                                           else "-"))
            _progress(len(cases), len(plan), f"{model}/{mode}: {outcome}", started)
            _save(args.json, info, cases)
    return cases


def _save(path: str | None, info: dict[str, Any], cases: list[dict[str, Any]]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"run": info, "cases": cases}, f, indent=2)


def run(args: argparse.Namespace) -> int:
    from hotswap.tools import corpus

    if args.device is None:
        args.device = "cuda" if cuda_available() else "cpu"
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.case:
        result = run_case(args.case, modes[0], device=args.device, dtype=args.dtype,
                          train=args.train, timeout_s=args.timeout_s, workers=args.workers)
        print(json.dumps(result))
        return 0
    models = list(QUICK) if args.quick else (
        [m.strip() for m in args.models.split(",") if m.strip()] if args.models
        else list(corpus.TRAINABLE if args.train else corpus.MODELS))
    bad = [m for m in models if m not in corpus.MODELS]
    if bad:
        return _usage(f"unknown corpus models {bad}; the corpus has {sorted(corpus.MODELS)}")
    if args.train and any(m not in corpus.TRAINABLE for m in models):
        return _usage(f"--train covers {list(corpus.TRAINABLE)}; not "
                      f"{[m for m in models if m not in corpus.TRAINABLE]}")
    wrong = [m for m in modes if m not in MODES]
    if wrong or not modes:
        return _usage(f"unknown modes {wrong or modes}; choose from {list(MODES)}")
    if args.jobs < 1:
        return _usage(f"--jobs must be >= 1, got {args.jobs}")
    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not cuda_available()):
        return _usage(f"--device {args.device}: use cpu, or cuda where torch sees a GPU")
    plan = [(model, mode) for model in models for mode in ("torch", *modes)]
    info = {"device": args.device, "dtype": args.dtype, "train": args.train, "jobs": args.jobs}
    cases = _run_plan(plan, args, info)
    cases.sort(key=lambda c: plan.index((c["model"], c["mode"])))
    lines = report(cases)
    totals, ok = summary(cases)
    print("\n".join([*lines, "", *totals]))
    _save(args.json, info, cases)
    if args.write_md:
        from hotswap.tools.bench.report import machine, write_markdown

        section = f"{args.device}{' train' if args.train else ''}"
        write_markdown(args.write_md, section, [("cases", lines), ("summary", totals)],
                       machine(), "hotswap corpus " + " ".join(sys.argv[2:]),
                       tool="hotswap corpus")
    return 0 if ok else 1


def _usage(message: str) -> int:
    print(f"hotswap corpus: error: {message}", file=sys.stderr)
    return 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=None,
                        help="comma list of corpus models (default: all; with --train, those "
                             "with a train-mode variant)")
    parser.add_argument("--modes", default="async,progressive",
                        help=f"comma list of hotswap modes (default async,progressive); "
                             f"of {list(MODES)}")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--dtype", default=None,
                        help="float32, bfloat16 or float16 (default: bfloat16 on cuda, else "
                             "float32)")
    parser.add_argument("--train", action="store_true",
                        help="serve forward and backward (dropout off) and compare gradients")
    parser.add_argument("--quick", action="store_true",
                        help=f"only {', '.join(QUICK)}")
    parser.add_argument("--workers", type=int, default=None, help="hotswap pool size")
    parser.add_argument("--jobs", type=int, default=1,
                        help="cases run at once (default 1; more shares the machine between "
                             "cases, so their times are only comparable within a run)")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="how long a case waits for its final tier (default 600)")
    parser.add_argument("--json", default=None, help="also write every case to this file")
    parser.add_argument("--write-md", default=None, metavar="PATH",
                        help="write the table into PATH (e.g. BENCHMARKS.md), replacing this "
                             "device's corpus section")
    parser.add_argument("--case", help=argparse.SUPPRESS)


def add_parser(sub: Any) -> None:
    subcommand(sub, "corpus", "real models: does hotswap compile what torch.compile compiles?",
               __doc__, add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    return standalone("hotswap corpus", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
