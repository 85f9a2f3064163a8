"""hotswap gate-audit: how much did each of the benchmark gate's decisions cost?

Each model runs in a fresh process with empty caches: progressive mode (default, then
max-autotune), served by a busy caller (a call every --interval-ms) while the tiers compile
and the gate decides, as a service would. Once every graph is final the caller stops, and each
of the gate's decisions is measured again on the now quiet machine: the same two tiers (eager
is the first tier every compiled tier is weighed against), in the same kind of worker, on the
same inputs, interleaved over many rounds. That reference names the truly faster tier; a
decision's regret is

    (time of the tier the gate chose - time of the faster one) / time of the faster one

Printed per decision: the pair, the outcome ("adopt": the candidate serves; "keep": it does
not), its confidence ("confident": its 95 % interval was clear of the threshold; "low": over
three measurements with clean rounds it never was, and the serving tier stayed; contended
measurements are retried for as long as it takes, and decide alone only when every round
agrees by far), the gain the gate measured and its interval, the reference's gain, and the
regret. Per model: decisions, undecided measurements (each measured again later), and the
largest serving call while one more gate measurement runs beside the caller once the ladder
is final (while the tiers climb, compiles share the machine too: that figure is shown as
well) next to 2x eager + 10 ms.

Targets: regret <= 2 % in at least 95 % of decisions, none > 5 %; every model decides; the
largest serving call beside a gate measurement <= 2x eager + 10 ms. --check exits 1 when
one is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from hotswap.tools.bench.main import cold_env
from hotswap.tools.bench.row import BENCH_MODELS, build
from hotswap.tools.common import cuda_available, standalone, subcommand

__all__ = ["add_parser", "main", "summarize"]

DEFAULT_MODELS = ",".join(BENCH_MODELS)
REGRET_OK, REGRET_MAX, SHARE_OK = 0.02, 0.05, 0.95


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=DEFAULT_MODELS,
                        help=f"comma list (default: the zoo, {DEFAULT_MODELS}); corpus:NAME "
                             "adds a real model of hotswap.tools.corpus")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--workers", type=int, default=None,
                        help="hotswap pool size (default: hotswap's)")
    parser.add_argument("--interval-ms", type=float, default=5.0,
                        help="pause between the serving caller's calls (default 5)")
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="per model, for the ladder to be final (default 300)")
    parser.add_argument("--rounds", type=int, default=30,
                        help="rounds of the reference measurement (default 30)")
    parser.add_argument("--budget-ms", type=float, default=1500.0,
                        help="reference measurement time per tier (default 1500)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a target was missed or a model failed")
    parser.add_argument("--model", help=argparse.SUPPRESS)  # one model, in its own process


def _child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import hotswap
    from hotswap.profiles.bench import benchmark
    from hotswap.testing import audit

    model, inputs = build(args.model, args.device)
    backend = audit.audited_backend(workers=args.workers)
    compiled: Any = torch.compile(model, backend=backend)
    sync: Any = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    calls: list[tuple[float, float]] = []  # (start, end), monotonic
    before = hotswap.counters()
    start = time.monotonic()
    with torch.no_grad():
        while True:
            t = time.monotonic()
            compiled(*inputs)
            sync()
            calls.append((t, time.monotonic()))
            statuses = hotswap.status(backend)
            if (statuses and all(s.final for s in statuses)) or (
                    time.monotonic() - start > args.timeout_s):
                break
            time.sleep(args.interval_ms / 1e3)
        final_s = time.monotonic() - start
        eager_ms = benchmark(lambda: (model(*inputs), sync()), device=args.device).median_ms
    counters = {k: v - before[k] for k, v in hotswap.counters().items()}
    # Does a gate measurement stall the caller? One more, beside the serving loop, alone.
    during: list[float] = []
    made = audit.decisions(backend)
    if made:
        probe = backend.measure(audit.gate_request(backend, made[0]))
        with torch.no_grad():
            while not probe.done():
                t = time.monotonic()
                compiled(*inputs)
                sync()
                during.append(time.monotonic() - t)
                time.sleep(args.interval_ms / 1e3)
    rows = audit.reference(backend, budget_ms=args.budget_ms, rounds=args.rounds)
    return {"model": args.model, "rows": rows, "final": all(s.final for s in statuses),
            "final_s": final_s, "tiers": {s.graph_id: s.tier for s in statuses},
            "largest_ms": 1e3 * max((e - b for b, e in calls[1:]), default=0.0),
            "largest_gate_ms": 1e3 * max(during, default=0.0), "calls": len(calls),
            "eager_ms": eager_ms, "undecided": counters["gate_undecided"],
            "gate_benchmarks": counters["gate_benchmarks"],
            "eager_checks": counters["eager_checks"]}


def _spawn(model: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hotswap-audit-") as root:
        env = {**cold_env(root), "HOTSWAP_WORKER_IDLE_EXIT_S": "0"}  # workers stay: reference
        cmd = [sys.executable, "-m", "hotswap.tools.gate_audit", "--model", model,
               "--device", args.device, "--interval-ms", str(args.interval_ms),
               "--timeout-s", str(args.timeout_s), "--rounds", str(args.rounds),
               "--budget-ms", str(args.budget_ms)] + (
                   ["--workers", str(args.workers)] if args.workers else [])
        limit = args.timeout_s + 600
        try:
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            return {"model": model, "error": f"no result within {limit:g} s"}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"model": model, "error": (out.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _interval(low: float | None, high: float | None) -> str:
    return "" if low is None or high is None else f"[{_pct(low)}, {_pct(high)}]"


HEADER = (f"{'model':<18} {'graph':<6} {'serving -> candidate':<28} {'outcome':<8} "
          f"{'confidence':<10} {'gate gain [95%]':<28} {'reference gain [95%]':<28} regret")


def _model_lines(result: dict[str, Any]) -> tuple[list[str], list[float], list[str]]:
    """One model's lines, the regrets of its decisions, and the targets it missed."""
    model = result["model"]
    if "error" in result:
        return [f"{model:<18} FAILED: {result['error']}"], [], [f"{model}: failed"]
    lines: list[str] = []
    regrets: list[float] = []
    missed: list[str] = []
    for row in result["rows"]:
        pair = f"{row['serving']} -> {row['candidate']}"
        gate = f"{_pct(row['gain'])} {_interval(row['gain_low'], row['gain_high'])}"
        decided = (f"{model:<18} {row['graph']:<6} {pair:<28} {row['outcome']:<8} "
                   f"{row['confidence']:<10} {gate:<28}")
        if "error" in row:
            lines.append(f"{decided} reference failed: {row['error']}")
            missed.append(f"{model} {row['graph']}: no reference")
            continue
        ref = f"{_pct(row['ref_gain'])} {_interval(row['ref_gain_low'], row['ref_gain_high'])}"
        regrets.append(row["regret"])
        lines.append(f"{decided} {ref:<28} {100 * row['regret']:.1f}%")
    limit = 2 * result["eager_ms"] + 10
    lines.append(f"{model:<18} {len(result['rows'])} decisions, {result['undecided']} "
                 f"undecided measurements, final after {result['final_s']:.1f} s "
                 f"({'final' if result['final'] else 'NOT FINAL'}); largest serving call "
                 f"beside a gate measurement {result['largest_gate_ms']:.1f} ms (while the "
                 f"tiers climbed {result['largest_ms']:.1f} ms) vs 2x eager + 10 ms = "
                 f"{limit:.1f} ms")
    if not result["final"]:
        missed.append(f"{model}: never decided within the timeout")
    if result["largest_gate_ms"] > limit:
        missed.append(f"{model}: a call beside a gate measurement took "
                      f"{result['largest_gate_ms']:.1f} ms > {limit:.1f} ms")
    return lines, regrets, missed


def _totals(regrets: list[float]) -> tuple[list[str], list[str]]:
    """The regret targets over every decision: a line, and the targets missed."""
    if not regrets:
        return ["no decisions measured"], []
    share = sum(r <= REGRET_OK for r in regrets) / len(regrets)
    worst = max(regrets)
    line = (f"decisions: {len(regrets)}; regret <= {100 * REGRET_OK:.0f}%: "
            f"{100 * share:.1f}% (target >= {100 * SHARE_OK:.0f}%) "
            f"{'met' if share >= SHARE_OK else 'MISSED'}; largest regret "
            f"{100 * worst:.1f}% (target <= {100 * REGRET_MAX:.0f}%) "
            f"{'met' if worst <= REGRET_MAX else 'MISSED'}")
    missed = []
    if share < SHARE_OK:
        missed.append(f"regret <= 2% in {100 * share:.1f}% of decisions")
    if worst > REGRET_MAX:
        missed.append(f"largest regret {100 * worst:.1f}%")
    return [line], missed


def summarize(results: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The report's lines, and the targets missed."""
    lines, regrets, missed = [HEADER], [], []
    for result in results:
        more, found, missing = _model_lines(result)
        lines += more
        regrets += found
        missed += missing
    totals, missing = _totals(regrets)
    return [*lines, "", *totals], missed + missing


def run(args: argparse.Namespace) -> int:
    if args.device is None:
        args.device = "cuda" if cuda_available() else "cpu"
    if args.model:
        print(json.dumps(_child(args)))
        return 0
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    from hotswap.tools.bench.row import is_bench_model

    unknown = [m for m in models if not is_bench_model(m)]
    if unknown:
        print(f"hotswap gate-audit: unknown model(s) {unknown}; choose from "
              f"{list(BENCH_MODELS)} or corpus:NAME", file=sys.stderr)
        return 2
    print(f"== gate audit on {args.device}: busy caller every {args.interval_ms:g} ms; "
          f"reference {args.rounds} rounds x {args.budget_ms:g} ms per tier, quiet ==")
    print(HEADER)
    results: list[dict[str, Any]] = []
    for model in models:  # each model's rows as soon as they are in (and in --json)
        print(f"  auditing {model} on {args.device} ...", end="", flush=True, file=sys.stderr)
        t = time.monotonic()
        results.append(_spawn(model, args))
        failed = " (failed)" if "error" in results[-1] else ""
        print(f" {time.monotonic() - t:.0f} s{failed}", flush=True, file=sys.stderr)
        print("\n".join(_model_lines(results[-1])[0]), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": args.device, "results": results,
                           "missed": summarize(results)[1]}, f, indent=1)
    lines, missed = summarize(results)
    print("\n".join(lines[lines.index(""):]))
    if missed:
        print("missed: " + "; ".join(missed))
    return 1 if missed and args.check else 0


def add_parser(sub: Any) -> None:
    subcommand(sub, "gate-audit", "score the benchmark gate's decisions by their regret",
               __doc__, add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    return standalone("hotswap gate-audit", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    os.environ.setdefault("HOTSWAP_LOG", "warning")
    sys.exit(main())
