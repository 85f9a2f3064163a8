"""``hotswap bench``'s output: the table of rows, the targets as ratios measured in the run,
and the BENCHMARKS.md section (with the machine it ran on)."""

from __future__ import annotations

import os
import time
from typing import Any

__all__ = ["machine", "missed", "report", "write_markdown"]


def _fmt(value: Any, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def report(results: list[dict[str, Any]], dispatch: dict[str, Any] | None) -> list[str]:
    """The table and the targets, as lines (printed, and written into BENCHMARKS.md). Every
    time is from the row's process start; ``ready`` is when it made its first call (imports
    and the model's construction), ``prepare`` a ``hotswap.prepare()`` call inside that."""
    return _table(results) + _targets(results, dispatch)


def _table(results: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'row':<34}{'ready s':>8}{'prepare s':>10}{'first out s':>12}{'1st call s':>11}"
             f"{'compiled s':>11}{'largest ms':>11}{'steady ms':>10}{'eager ms':>9}"
             f"{'RSS MiB':>8}{'final MiB':>10}{'idle MiB':>9}"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['row']:<34}  failed: {r['error']}")
            continue
        lines.append(f"{r['row']:<34}{_fmt(r['ready_s']):>8}{_fmt(r.get('prepare_s')):>10}"
                     f"{_fmt(r['first_output_s']):>12}{_fmt(r['first_call_s'], 1, 3):>11}"
                     f"{_fmt(r.get('to_stays_s', r['to_final_s'])):>11}"
                     f"{_fmt(_largest(r), 1, 1):>11}"
                     f"{_fmt(r['steady_ms'], 1, 3):>10}{_fmt(r['eager_ms'], 1, 3):>9}"
                     f"{_fmt(r.get('peak_rss_mib'), 1, 0):>8}"
                     f"{_fmt(r.get('steady_total_mib'), 1, 0):>10}"
                     f"{_fmt(r.get('idle_total_mib', r.get('steady_total_mib')), 1, 0):>9}")
    return lines


def _largest(row: dict[str, Any]) -> float | None:
    """The largest call after the first; None (shown "-") where no later call was served."""
    return row["largest_call_ms"] if row.get("calls", 0) > 1 else None


def missed(lines: list[str]) -> list[str]:
    """The target lines of a report that say a measured target was missed, and failed rows."""
    return [line.strip() for line in lines
            if line.rstrip().endswith("MISSED") or " MISSED " in line or "  failed: " in line]


def _targets(results: list[dict[str, Any]], dispatch: dict[str, Any] | None) -> list[str]:
    by_row = {r["row"]: r for r in results}
    lines: list[str] = []

    def ratio_line(label: str, a: str, a_key: str, b: str, b_key: str,
                   target: float | None) -> None:
        """A ratio of two rows' figures against its target (None: shown for comparison)."""
        va, vb = by_row.get(a, {}).get(a_key), by_row.get(b, {}).get(b_key)
        if a not in by_row or b not in by_row:
            return  # a row this run did not ask for
        if va is None or vb is None:
            lines.append(f"  {label}: not measured (a row failed or never reached its tier)")
            return
        ratio = va / vb
        verdict = ("for comparison" if target is None else
                   f"(target <= {target}x) {'met' if ratio <= target else 'MISSED'}")
        lines.append(f"  {label}: {va:.3f} / {vb:.3f} = {ratio:.3f}x {verdict}")

    caller = next((r.get("caller") for r in results  # the torch rows' first call blocks
                   if "error" not in r and r["row"].startswith("hotswap:")), "busy")
    lines += ["", f"targets ({caller} caller; times from process start)"]
    _ratios(ratio_line, str(caller), by_row)
    for row in ("hotswap:async", "hotswap:progressive"):
        ratio_line(f"{row} memory once its idle workers exit vs torch.compile's", row,
                   "idle_total_mib", "torch:default", "steady_total_mib", 1.3)
    lines += _footprint(results)
    lines += _largest_calls(by_row)
    lines += _lateness(results)
    if dispatch is not None:
        over = dispatch["overhead_ns"] / 1e3
        lines.append(f"  dispatch overhead: {dispatch['runner_ns']:.0f} ns via hotswap vs "
                     f"{dispatch['direct_ns']:.0f} ns direct = {over:.2f} us (target <= 2 us) "
                     f"{'met' if over <= 2 else 'MISSED'}")
    return lines


def _ratios(ratio_line: Any, caller: str, by_row: dict[str, dict[str, Any]]) -> None:
    for row in ("hotswap:async", "hotswap:progressive"):
        ratio_line(f"{row} first output vs dynamo trace + eager call", row, "first_output_s",
                   "torch:eager-backend", "first_output_s", 1.1)
    ratio_line("async compiled serving vs torch.compile's first call", "hotswap:async",
               "to_stays_s", "torch:default", "to_final_s", 0.9 if caller == "idle" else 1.2)
    ratio_line("progressive final tier vs in-process max-autotune", "hotswap:progressive",
               "to_final_s", "torch:max-autotune", "to_final_s", 1.2)
    for again in ("replica", "warm"):
        for row in ("hotswap:async", "hotswap:progressive"):
            ratio_line(f"{row} {again} compiled serving vs its cold run", f"{row} ({again})",
                       "to_final_s", row, "to_final_s", 0.3)
            ratio_line(f"{row} {again} compiled serving vs dynamo trace + eager call",
                       f"{row} ({again})", "to_final_s", "torch:eager-backend",
                       "first_output_s", 1.2)
    # A warm restart (--warm: every cache its cold run left) against torch.compile's own
    for row in ("hotswap:async", "hotswap:progressive"):
        ratio_line(f"{row} warm restart compiled vs torch.compile's warm first call",
                   f"{row} (warm)", "to_stays_s", "torch:default (warm)", "to_final_s", 0.9)
        ratio_line(f"{row} warm restart first output vs dynamo trace + eager call, warm",
                   f"{row} (warm)", "first_output_s", "torch:eager-backend (warm)",
                   "first_output_s", 1.05)
    ratio_line("async first call vs PyTorch async's first call", "hotswap:async",
               "first_call_s", "pytorch:async+subprocess", "first_call_s", 0.1)
    ratio_line("async compiled on the cluster vs torch.compile's first call",
               "hotswap:async@cluster", "to_final_s", "torch:default", "to_final_s", 1.0)
    ratio_line("async, the first process ever (it starts the compile service), compiled vs "
               "torch.compile's first call", "hotswap:async@service-first", "to_stays_s",
               "torch:default", "to_final_s", 0.9)
    ratio_line("async, the compile service warm, compiled vs torch.compile's first call",
               "hotswap:async@service", "to_stays_s", "torch:default", "to_final_s", 0.7)
    for row, whose in (("hotswap:async@service-first", "the first process ever"),
                       ("hotswap:async@service", "the compile service warm")):
        first = by_row.get(row, {})
        if first.get("to_compiled_s") not in (None, first.get("to_stays_s")):  # a rung served
            ratio_line(f"async, {whose}, first compiled code (each repeated block compiled "
                       f"once) vs torch.compile's first call", row, "to_compiled_s",
                       "torch:default", "to_final_s", None)
    ratio_line("async, the compile service warm, first output vs dynamo trace + eager call",
               "hotswap:async@service", "first_output_s", "torch:eager-backend",
               "first_output_s", 1.1)
    ratio_line("progressive, autotuned on cuda:1, final tier vs in-process max-autotune",
               "hotswap:progressive@gpu1", "to_final_s", "torch:max-autotune", "to_final_s", 1.0)
    for row in ("async", "progressive"):
        ratio_line(f"{row}: hotswap time to final vs PyTorch's {row}+subprocess",
                   f"hotswap:{row}", "to_final_s", f"pytorch:{row}+subprocess", "to_final_s", 1.0)


def _footprint(results: list[dict[str, Any]]) -> list[str]:
    """Where each hotswap row's memory is once final: the serving process, the workers, and
    the processes the workers started; and why its tiers waited, where hotswap said (e.g.
    workers starved by the caller's threads and raised to its priority: starvation.py)."""
    lines = []
    for r in results:
        if "error" in r or "steady_total_mib" not in r or not r["row"].startswith("hotswap:"):
            continue
        idle = r.get("idle_total_mib")
        lines.append(f"  {r['row']} once final: serving {r['steady_serving_mib']:.0f} MiB + "
                     f"workers {r['steady_workers_mib']:.0f} MiB + their children "
                     f"{r['steady_their_children_mib']:.0f} MiB"
                     + (f"; {idle:.0f} MiB once the idle workers exit" if idle is not None
                        else ""))
        lines += [f"  {r['row']} waited from {at_s:.1f} s: {note}"
                  for note, at_s in r.get("waiting", [])]
    return lines


def _largest_calls(by_row: dict[str, dict[str, Any]]) -> list[str]:
    """The largest call of each serving row vs 2x eager + 10 ms, beside the machine's own."""
    lines = []
    for row in ("hotswap:async", "hotswap:async (warm)", "hotswap:progressive",
                "hotswap:progressive (warm)", "hotswap:async@cluster",
                "hotswap:async@service", "hotswap:async@service-first",
                "hotswap:progressive@service", "hotswap:progressive@gpu1", "machine:busy-eager"):
        r = by_row.get(row)
        if not r or "error" in r or r.get("calls", 0) <= 1:
            continue
        limit = 2 * r["eager_ms"] + 10
        over = (f" (p99 {r['p99_call_ms']:.1f} ms; {r['calls_over_limit']} of "
                f"{r['calls'] - 1} calls over in {r['served_s']:.0f} s)"
                if "served_s" in r else "")
        floor = by_row.get("machine:busy-eager", {}).get("largest_call_ms")
        verdict = ("the machine alone, no compile" if row == "machine:busy-eager"
                   else "met" if r["largest_call_ms"] <= limit else "MISSED" + (
                       f" (the machine alone, every core busy: {floor:.1f} ms)"
                       if floor is not None and floor > limit else ""))
        lines.append(f"  {row} largest call {r['largest_call_ms']:.1f} ms{over} vs 2x eager "
                     f"+ 10 ms = {limit:.1f} ms: {verdict}")
    return lines


def _lateness(results: list[dict[str, Any]]) -> list[str]:
    """How late a thread waking every millisecond in the serving process woke while the row
    served, after its first call (tools/lateness.py): hotswap's rows against 10 ms, the
    others beside them; the caller's own first call is shown apart."""
    lines = []
    for r in results:
        if "error" in r or "probe_max_ms" not in r:
            continue
        worst = ", ".join(f"{ms:.0f} ms at {at:.1f} s" for at, ms in r["probe_worst"][:3])
        verdict = (("met" if r["probe_max_ms"] <= 10 else "MISSED")
                   if r["row"].startswith("hotswap:") else "for comparison")
        gc_worst = r.get("gc_worst") or []
        collector = (f"; longest collection (gc) {gc_worst[0][1]:.0f} ms, generation "
                     f"{gc_worst[0][2]}, at {gc_worst[0][0]:.1f} s" if gc_worst else "")
        compiled = r.get("source_compiles_largest") or []
        sources = (f"; {r['source_compiles']} sources compiled ({r['source_compiled_kb']:.0f} "
                   f"KB; largest {compiled[0][1]:.0f} KB {os.path.basename(compiled[0][2])} at "
                   f"{compiled[0][0]:.1f} s)" if compiled else "")
        lines.append(f"  {r['row']} probe lateness p99 {r['probe_p99_ms']:.1f} ms, max "
                     f"{r['probe_max_ms']:.1f} ms (worst: {worst or '-'}) vs 10 ms: {verdict}; "
                     f"during the first call {r['probe_first_call_max_ms']:.1f} ms{collector}"
                     f"{sources}")
    return lines


def machine() -> dict[str, str]:
    import platform

    import torch

    info = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
            "torch": torch.__version__, "cpus": str(os.cpu_count())}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        info["device"] = platform.processor() or platform.machine()
    return info


def write_markdown(path: str, device: str, sections: list[tuple[str, list[str]]],
                   info: dict[str, str], command: str, tool: str = "hotswap bench") -> None:
    """Replace (or append) this device's ``tool`` section of ``path``."""
    begin, end = f"<!-- {tool}: {device} -->", f"<!-- end {tool}: {device} -->"
    body = [begin, f"### `{tool}` on {info.get('device')} ({device}), {info['date']}", "",
            "torch " + info["torch"] + (f", triton {info['triton']}" if "triton" in info else "")
            + f", Python {info['python']}, {info['cpus']} CPUs. Command: `{command}`", ""]
    for title, lines in sections:
        body += [f"{title}:", "", "```", *lines, "```", ""]
    body.append(end)
    text = "# Benchmarks\n"
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + "\n".join(body) + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(body) + "\n"
    with open(path, "w") as f:
        f.write(text)


