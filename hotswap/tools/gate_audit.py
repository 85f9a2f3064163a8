"""hotswap gate-audit: what each of the benchmark gate's decisions cost, and how long it took.

Each model runs in a fresh process with empty caches: progressive mode (default, then
max-autotune), served by a caller while the tiers compile and the gate decides, as a service
would. --caller busy (the default) calls every 5 ms: the caller contends with the workers and
the gate for the CPU. --caller idle calls every 200 ms: even a 10 ms call then keeps 5 % of a
core busy, so the machine is the workers' and the gate's, and the graph still gets calls.
--interval-ms sets another pause. Once every graph is final the caller stops, and each of the
gate's decisions is measured again on the now quiet machine: the same two tiers (eager is the
first tier every compiled tier is weighed against), in the same kind of worker, on the same
inputs, interleaved over many rounds. That reference names the truly faster tier; a
decision's regret is

    (time of the tier the gate chose - time of the faster one) / time of the faster one

Printed per decision: the pair, the outcome ("adopt": the candidate serves; "keep": it does
not), its confidence ("confident": its 95 % interval was clear of the threshold; "close" or
"low": over three measurements with clean rounds it never was, and the serving tier stayed,
"close" where the candidate was at most 2.5 thresholds faster; contended
measurements are retried for as long as it takes, and decide alone only when every round
agrees by far), the gain the gate measured and its interval, the reference's gain, and the
regret. Per graph: when each tier arrived (loaded in the serving process) and how long after
the last arrival the graph was final (hotswap.status(...).arrived_s and final_after_s): the
time the gate took to settle it. Per model: decisions, undecided measurements (each measured
again later), the slowest graph's time to final, and the largest serving call while one more
gate measurement runs beside the caller once the ladder is final (while the tiers climb,
compiles share the machine too: that figure is shown as well) next to 2x eager + 10 ms.

Targets: regret <= 2 % in at least 95 % of decisions, none above 10 %; from the last tier's
arrival to final <= 30 s with an idle caller, <= 120 s with a busy one (--caller picks which
is held); every model decides, and its process exits cleanly (one that failed at its exit
keeps the results it printed, and misses); the largest serving call beside a gate measurement <= 2x
eager + 10 ms. The last line sums up: each target PASS or MISS, and by how much. --check
exits 1 when one is missed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from hotswap.tools.bench.row import BENCH_MODELS, build
from hotswap.tools.bench.spawn import cold_env
from hotswap.tools.common import cuda_available, standalone, subcommand

__all__ = ["Verdict", "add_parser", "main", "summarize", "verdicts"]

DEFAULT_MODELS = ",".join(BENCH_MODELS)
REGRET_OK, REGRET_MAX, SHARE_OK = 0.02, 0.10, 0.95
INTERVAL_MS = {"busy": 5.0, "idle": 200.0}     # the caller's pause between calls
TO_FINAL_S = {"busy": 120.0, "idle": 30.0}     # last tier's arrival -> final, at most


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=DEFAULT_MODELS,
                        help=f"comma list (default: the zoo, {DEFAULT_MODELS}); corpus:NAME "
                             "adds a real model of hotswap.tools.corpus")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--workers", type=int, default=None,
                        help="hotswap pool size (default: hotswap's)")
    parser.add_argument("--caller", choices=("busy", "idle"), default="busy",
                        help="busy: a call every 5 ms, time to final <= 120 s; idle: a call "
                             "every 200 ms, time to final <= 30 s (default busy)")
    parser.add_argument("--interval-ms", type=float, default=None,
                        help="pause between the serving caller's calls (default: the "
                             "caller's, 5 busy, 200 idle)")
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


def _graph(status: Any) -> dict[str, Any]:
    """One graph's tier, and when its tiers arrived and it became final (seconds after it
    reached hotswap); ``to_final_s``: from its last tier's arrival to final."""
    arrived = dict(status.arrived_s)
    to_final = (None if status.final_after_s is None or not arrived
                else status.final_after_s - max(arrived.values()))
    return {"tier": status.tier, "final": status.final, "arrived_s": arrived,
            "final_after_s": status.final_after_s, "to_final_s": to_final}


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
            "graphs": {s.graph_id: _graph(s) for s in statuses},
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
    last = (out.stderr.strip().splitlines() or ["?"])[-1][:300]
    if not lines:
        return {"model": model, "error": last}
    try:
        result: dict[str, Any] = json.loads(lines[-1])
    except ValueError:  # cut short
        return {"model": model, "error": last}
    if out.returncode != 0:  # its results came, then its exit failed: both are shown
        result["exit"] = f"exit status {out.returncode}: {last}"
    return result


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _interval(low: float | None, high: float | None) -> str:
    return "" if low is None or high is None else f"[{_pct(low)}, {_pct(high)}]"


HEADER = (f"{'model':<18} {'graph':<6} {'serving -> candidate':<28} {'outcome':<8} "
          f"{'confidence':<10} {'gate gain [95%]':<28} {'reference gain [95%]':<28} regret")


def _to_final(result: dict[str, Any]) -> tuple[str, float] | None:
    """The model's slowest graph from its last tier's arrival to final: (graph, seconds);
    None where no graph is final with a tier arrived."""
    found = [(g, v["to_final_s"]) for g, v in result.get("graphs", {}).items()
             if v["to_final_s"] is not None]
    return max(found, key=lambda f: f[1]) if found else None


def _graph_lines(result: dict[str, Any], limit_s: float, caller: str) -> list[str]:
    model = result["model"]
    lines = []
    for graph, v in result.get("graphs", {}).items():
        arrived = ", ".join(f"{tier} {s:.1f} s" for tier, s in v["arrived_s"].items())
        line = f"{model:<18} {graph:<6} tiers arrived: {arrived or 'none'}; "
        if v["final_after_s"] is None:
            line += "NOT FINAL"
        else:
            line += f"final at {v['final_after_s']:.1f} s"
        if v["to_final_s"] is not None:
            line += (f", {v['to_final_s']:.1f} s after the last arrival (target <= "
                     f"{limit_s:g} s, {caller} caller)")
        lines.append(line)
    return lines


def _model_lines(result: dict[str, Any], caller: str = "busy") -> tuple[list[str], list[str]]:
    """One model's lines, and the targets it missed."""
    model = result["model"]
    if "error" in result:
        return [f"{model:<18} FAILED: {result['error']}"], [f"{model}: failed"]
    lines: list[str] = []
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
        lines.append(f"{decided} {ref:<28} {100 * row['regret']:.1f}%")
    limit_s = TO_FINAL_S[caller]
    lines += _graph_lines(result, limit_s, caller)
    slowest = _to_final(result)
    to_final = ("" if slowest is None else
                f"; last tier's arrival to final {slowest[1]:.1f} s ({slowest[0]}) vs "
                f"{limit_s:g} s")
    limit = 2 * result["eager_ms"] + 10
    lines.append(f"{model:<18} {len(result['rows'])} decisions, {result['undecided']} "
                 f"undecided measurements, all final {result['final_s']:.1f} s after the "
                 f"first call ({'final' if result['final'] else 'NOT FINAL'}){to_final}; "
                 f"largest serving call beside a gate measurement "
                 f"{result['largest_gate_ms']:.1f} ms (while the tiers climbed "
                 f"{result['largest_ms']:.1f} ms) vs 2x eager + 10 ms = {limit:.1f} ms")
    if "exit" in result:
        lines.append(f"{model:<18} the audited process failed at its exit ({result['exit']})")
        missed.append(f"{model}: failed at its exit")
    if not result["final"]:
        missed.append(f"{model}: never decided within the timeout")
    if slowest is not None and slowest[1] > limit_s:
        missed.append(f"{model} {slowest[0]}: final {slowest[1]:.1f} s after its last tier "
                      f"arrived > {limit_s:g} s")
    if result["largest_gate_ms"] > limit:
        missed.append(f"{model}: a call beside a gate measurement took "
                      f"{result['largest_gate_ms']:.1f} ms > {limit:.1f} ms")
    return lines, missed


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One target over the whole audit: what was found, whether it passed (None: nothing was
    there to hold to it) and, where it did not, by how much."""

    target: str
    found: str
    passed: bool | None
    miss: str = ""

    def __post_init__(self) -> None:
        if self.passed is not False:  # only a miss says by how much
            object.__setattr__(self, "miss", "")

    def __str__(self) -> str:
        said = {True: "PASS", False: f"MISS, {self.miss}", None: "n/a"}[self.passed]
        return f"{self.found} ({self.target}): {said}"


def verdicts(results: list[dict[str, Any]], caller: str = "busy") -> list[Verdict]:
    """Each target, held over every model's results: the regret share and worst regret
    (over every decision with a reference), the worst time from a graph's last tier's arrival
    to final (against ``caller``'s target), every model final, the largest-call check."""
    ok = [r for r in results if "error" not in r]
    regrets = [(row["regret"], f"{r['model']} {row['graph']} {row['serving']} -> "
                               f"{row['candidate']}")
               for r in ok for row in r["rows"] if "error" not in row]
    found: list[Verdict] = []
    if regrets:
        within = sum(x <= REGRET_OK for x, _ in regrets)
        share = within / len(regrets)
        found.append(Verdict(f"target >= {100 * SHARE_OK:.0f}%",
                             f"{len(regrets)} decisions, {within} within "
                             f"{100 * REGRET_OK:.0f}% regret = {100 * share:.1f}%",
                             share >= SHARE_OK, f"{100 * (SHARE_OK - share):.1f} points short"))
        worst, where = max(regrets, key=lambda x: x[0])
        found.append(Verdict(f"target <= {100 * REGRET_MAX:.0f}%",
                             f"worst regret {100 * worst:.1f}% ({where})", worst <= REGRET_MAX,
                             f"{100 * (worst - REGRET_MAX):.1f} points over"))
    else:
        found += [Verdict(f"target >= {100 * SHARE_OK:.0f}%", "no decisions", None),
                  Verdict(f"target <= {100 * REGRET_MAX:.0f}%", "no worst regret", None)]
    limit_s = TO_FINAL_S[caller]
    slowest = [(t[1], f"{r['model']} {t[0]}") for r in ok if (t := _to_final(r)) is not None]
    target = f"target <= {limit_s:g} s, {caller} caller"
    if slowest:
        worst_s, where = max(slowest, key=lambda x: x[0])
        found.append(Verdict(target, f"worst time from last arrival to final {worst_s:.1f} s "
                                     f"({where})", worst_s <= limit_s,
                             f"{worst_s - limit_s:.1f} s over"))
    else:
        found.append(Verdict(target, "no graph final with a tier arrived", None))
    final = sum("error" not in r and r["final"] for r in results)
    undecided = [f"{r['model']} {'failed' if 'error' in r else 'not final'}"
                 for r in results if "error" in r or not r["final"]]
    undecided += [f"{r['model']} failed at its exit" for r in results if "exit" in r]
    found.append(Verdict("every model final", f"{final} of {len(results)} models final",
                         not undecided, ", ".join(undecided)))
    stalled = [f"{r['model']} {r['largest_gate_ms']:.1f} ms > "
               f"{2 * r['eager_ms'] + 10:.1f} ms" for r in ok
               if r["largest_gate_ms"] > 2 * r["eager_ms"] + 10]
    found.append(Verdict("<= 2x eager + 10 ms", "largest call beside a gate measurement",
                         not stalled if ok else None, "; ".join(stalled)))
    return found


def summarize(results: list[dict[str, Any]],
              caller: str = "busy") -> tuple[list[str], list[str]]:
    """The report's lines (its last: the summary), and the targets missed."""
    lines, missed = [HEADER], []
    for result in results:
        more, missing = _model_lines(result, caller)
        lines += more
        missed += missing
    found = verdicts(results, caller)
    missed += [f"{v.found} ({v.target})" for v in found[:2] if v.passed is False]  # regret
    summary = "; ".join(str(v) for v in found)
    passed = "MISS" if any(v.passed is False for v in found) else "PASS"
    return [*lines, "", f"summary, {caller} caller: {passed}: {summary}"], missed


def run(args: argparse.Namespace) -> int:
    if args.device is None:
        args.device = "cuda" if cuda_available() else "cpu"
    if args.interval_ms is None:
        args.interval_ms = INTERVAL_MS[args.caller]
    if args.model:
        print(json.dumps(_child(args)), flush=True)  # before anything at exit can fail
        return 0
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    from hotswap.tools.bench.row import is_bench_model

    unknown = [m for m in models if not is_bench_model(m)]
    if unknown:
        print(f"hotswap gate-audit: unknown model(s) {unknown}; choose from "
              f"{list(BENCH_MODELS)} or corpus:NAME", file=sys.stderr)
        return 2
    print(f"== gate audit on {args.device}: {args.caller} caller, a call every "
          f"{args.interval_ms:g} ms; reference {args.rounds} rounds x {args.budget_ms:g} ms "
          f"per tier, quiet ==")
    print(HEADER)
    results: list[dict[str, Any]] = []
    for model in models:  # each model's rows as soon as they are in (and in --json)
        print(f"  auditing {model} on {args.device} ...", end="", flush=True, file=sys.stderr)
        t = time.monotonic()
        results.append(_spawn(model, args))
        failed = " (failed)" if "error" in results[-1] else ""
        print(f" {time.monotonic() - t:.0f} s{failed}", flush=True, file=sys.stderr)
        print("\n".join(_model_lines(results[-1], args.caller)[0]), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": args.device, "caller": args.caller,
                           "interval_ms": args.interval_ms, "results": results,
                           "verdicts": [dataclasses.asdict(v)
                                        for v in verdicts(results, args.caller)],
                           "missed": summarize(results, args.caller)[1]}, f, indent=1)
    lines, missed = summarize(results, args.caller)
    print("\n".join(lines[lines.index(""):]))
    if missed:
        print("missed: " + "; ".join(missed))
    return 1 if missed and args.check else 0


def add_parser(sub: Any) -> None:
    subcommand(sub, "gate-audit", "score the benchmark gate's decisions by their regret and "
               "time to final", __doc__, add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    return standalone("hotswap gate-audit", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    os.environ.setdefault("HOTSWAP_LOG", "warning")
    sys.exit(main())
