"""``hotswap bench`` on a tiny preset: the structure of what it measures and writes."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

import hotswap
from hotswap.testing.load import Spinners
from hotswap.tools.bench import main as bench
from hotswap.tools.bench import report as bench_report
from hotswap.tools.bench import row as bench_row
from tests.workers import jobs

ROW_KEYS = {"row", "model", "device", "eager_ms", "first_output_s", "to_final_s", "to_stays_s",
            "largest_call_ms", "calls", "steady_ms", "peak_rss_mib", "timings_s", "counters",
            "slowest_calls", "ready_s", "prepare_s", "first_call_s", "caller",
            "probe_wakes", "probe_p99_ms", "probe_max_ms", "probe_worst"}


def test_a_row_waits_for_its_idle_workers_to_exit_not_for_their_pool_to_go(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool stopped for idleness leaves the runtime's list before its workers have exited:
    the row's idle memory is read once the processes are gone (they were counted before)."""
    monkeypatch.setattr(hotswap, "runtime", lambda: SimpleNamespace(worker_pids=lambda: []))
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    try:
        bench_row._wait_workers_gone([worker.pid], timeout_s=30.0)
        assert psutil.Process(worker.pid).status() == psutil.STATUS_ZOMBIE  # exited, unreaped
    finally:
        worker.wait()


def test_tiny_preset_rows_json_and_markdown(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out, md = tmp_path / "bench.json", tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nhand-written notes stay\n")
    argv = ["--models", "pointwise", "--rows", "hotswap:async,torch:eager-backend",
            "--device", "cpu", "--timeout-s", "90", "--json", str(out), "--write-md", str(md)]
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    assert [r["row"] for r in data["rows"]] == ["hotswap:async", "torch:eager-backend"]
    for row in data["rows"]:
        assert set(row) >= ROW_KEYS, row
        assert row["to_final_s"] is not None and row["peak_rss_mib"] > 0
        # On the user's clock: process start -> ready to call -> first output -> compiled.
        assert 0 < row["ready_s"] < row["first_output_s"] <= row["to_final_s"] + 1e-6
        assert row["first_output_s"] <= row["to_stays_s"] <= row["to_final_s"]
        assert row["first_output_s"] == pytest.approx(row["ready_s"] + row["first_call_s"])
        assert row["prepare_s"] is None and row["caller"] == "busy"
        # the slowest calls after the first, slowest first, the largest call among them
        slowest = row["slowest_calls"]
        assert len(slowest) == min(5, row["calls"] - 1)
        ms = [took for _, took in slowest]
        assert ms == sorted(ms, reverse=True)
        if slowest:
            assert ms[0] == pytest.approx(row["largest_call_ms"], abs=0.01)
            assert all(0 < at <= row["to_final_s"] + row["served_s"] for at, _ in slowest)
        # the busy caller goes on once the final code serves: its first calls count too
        assert row["calls"] >= 1 + bench_row.AFTER_FINAL_CALLS
        # the lateness probe woke through the serving, its worst wakes on the same clock (an
        # eager-backend row is final at its first output: it may end before the probe wakes)
        assert row["probe_wakes"] > 0 or row["row"] == "torch:eager-backend"
        assert row["probe_max_ms"] >= row["probe_p99_ms"] >= 0
        assert all(row["ready_s"] <= at <= row["to_final_s"] + row["served_s"] + 1
                   for at, _ in row["probe_worst"])
    assert data["rows"][0]["counters"]["worker_compiles"] == 1
    assert "dispatch" in data and "torch" in data["machine"]
    captured = capsys.readouterr()
    printed, progress = captured.out, captured.err
    assert "running hotswap:async ..." in progress and " s\n" in progress  # each row's time
    assert "running" not in printed  # stdout holds the table and the targets alone
    assert "hotswap:async first output vs dynamo trace + eager call" in printed
    assert "hotswap:async probe lateness p99 " in printed
    assert "torch:eager-backend probe lateness p99 " in printed and "for comparison" in printed
    # Memory once final, by part: the serving process and its (idle) compile worker.
    hot = data["rows"][0]
    assert hot["steady_serving_mib"] > 0 and hot["steady_workers_mib"] > 0
    assert hot["steady_total_mib"] >= hot["steady_serving_mib"] + hot["steady_workers_mib"]
    # ... and once the idle worker has exited (the rows run with a 2 s idle limit)
    assert hot["idle_total_mib"] < hot["steady_total_mib"] - hot["steady_workers_mib"] / 2
    assert "hotswap:async once final: serving " in printed and "idle workers exit" in printed
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\nhand-written notes stay")
    marker = "<!-- hotswap bench: cpu, busy caller from process start -->"
    assert text.count(marker) == 1 and "pointwise (cpu)" in text


def test_markdown_section_is_replaced_not_repeated(tmp_path: Path) -> None:
    md = tmp_path / "B.md"
    info = {"date": "d", "torch": "t", "python": "p", "cpus": "2", "device": "x"}
    for n in (1, 2):
        bench_report.write_markdown(str(md), "cpu", [("m", [f"run {n}"])], info, "hotswap bench")
    bench_report.write_markdown(str(md), "cuda", [("m", ["gpu"])], info, "hotswap bench")
    text = md.read_text()
    assert "run 1" not in text and text.count("run 2") == 1 and "gpu" in text


def test_bad_rows_and_models() -> None:
    with pytest.raises(SystemExit, match="unknown rows"):
        bench.main(["--rows", "hotswap:warp", "--device", "cpu"])
    with pytest.raises(SystemExit, match="unknown bench models"):
        bench.main(["--models", "training", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--threads must be >= 1"):
        bench.main(["--threads", "0", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--floor-s must be > 0"):
        bench.main(["--floor-s", "0", "--device", "cpu"])


def test_machine_floor_row_serves_eager_beside_spinners(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    argv = ["--models", "pointwise", "--rows", "machine:busy-eager", "--device", "cpu",
            "--floor-s", "1.5", "--json", str(out)]
    assert bench.main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["to_final_s"] is None and 1.5 <= row["served_s"] < 10
    assert row["counters"]["worker_compiles"] == 0 and row["counters"]["eager_calls"] == 0
    assert "machine:busy-eager largest call" in capsys.readouterr().out
    assert not [p for p in psutil.process_iter(["cmdline"])
                if "lower_priority" in " ".join(p.info["cmdline"] or [])]  # spinners gone


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_spinners_run_where_the_workers_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the workers' cpu group where one can be made, else under SCHED_IDLE, at their
    niceness: the floor the machine:busy-eager row measures is the workers' own."""
    monkeypatch.setenv("HOTSWAP_WORKER_NICE", "19")
    monkeypatch.delenv("HOTSWAP_WORKER_IDLE", raising=False)
    spinners = Spinners(1)
    try:
        [spinner] = spinners.procs
        deadline = time.monotonic() + 30
        while not (jobs.is_idle(jobs.lowered_pid(spinner.pid), os.getpid())
                   and psutil.Process(spinner.pid).nice() == 19):
            assert time.monotonic() < deadline and spinner.poll() is None
            time.sleep(0.05)
    finally:
        spinners.stop()
    assert spinner.poll() is not None


@pytest.mark.parametrize("argv, cuda, preset", [
    ([], False, "cpu"), (["--device", "cpu"], True, "cpu"), ([], True, "cuda")])
def test_quick_picks_the_preset_of_the_device(monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                              cuda: bool, preset: str) -> None:
    ran: list[tuple[str, str, float]] = []

    threads: set[int | None] = set()

    def spawn_row(row: str, args: argparse.Namespace, **_: object) -> dict[str, object]:
        ran.append((row, args.model, args.timeout_s))
        threads.add(args.threads)
        return {"row": row, "error": "not run"}

    monkeypatch.setattr(bench, "cuda_available", lambda: cuda)
    monkeypatch.setattr(bench, "spawn_row", spawn_row)
    assert bench.main(["--quick", *argv]) == 0
    chosen = bench.QUICK[preset]
    assert ran == [(row, chosen["models"], chosen["timeout_s"])
                   for row in chosen["rows"].split(",")] + (
        [("hotswap:dispatch", chosen["models"], chosen["timeout_s"])] if chosen["dispatch"] else [])
    if preset == "cpu":  # the baselines and hotswap's serving modes, on the zoo's mlp
        assert [row for row, _, _ in ran] == ["torch:eager-backend", "torch:default",
                                              "hotswap:async", "hotswap:progressive"]
        assert {model for _, model, _ in ran} == {"mlp"}
        # one intra-op thread fewer than cores: the caller's threads leave the gate a core
        assert threads == {bench.spare_core_threads()}
    else:
        assert threads == {None}  # torch's own count


def test_quick_on_the_cpu_keeps_the_threads_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: set[int | None] = set()

    def spawn_row(row: str, args: argparse.Namespace, **_: object) -> dict[str, object]:
        threads.add(args.threads)
        return {"row": row, "error": "not run"}

    monkeypatch.setattr(bench, "cuda_available", lambda: False)
    monkeypatch.setattr(bench, "spawn_row", spawn_row)
    assert bench.main(["--quick", "--threads", "3"]) == 0
    assert threads == {3}


def test_a_row_starts_with_caches_and_a_temporary_folder_of_its_own(tmp_path: Path) -> None:
    # inductor precompiles its C++ header under the temporary folder, whatever its cache
    # directory: a row sharing the folder found the header an earlier row built.
    from hotswap.tools.bench.spawn import cold_env

    root = tmp_path / "row"
    env = cold_env(str(root))
    for key in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "HOTSWAP_CACHE_DIR"):
        assert Path(env[key]).parent == root, key
    assert Path(env["TMPDIR"]).is_dir() and Path(env["TMPDIR"]).stat().st_mode & 0o077 == 0


def test_the_service_targets_weigh_the_whole_graph_and_show_the_pieces_beside() -> None:
    """A service row that served its pieces first: its target is when its whole graph
    served; the pieces' time is a line for comparison. A row whose pieces arrived after its
    whole graph (kept, final later) is weighed by its whole graph's swap."""
    def row(name: str, compiled: float, stays: float, final: float) -> dict[str, object]:
        return {"row": name, "to_compiled_s": compiled, "to_stays_s": stays,
                "to_final_s": final}

    lines = bench_report._targets([row("torch:default", 30.0, 30.0, 30.0),
                                   row("hotswap:async@service", 18.0, 24.0, 24.0),
                                   row("hotswap:async@service-first", 26.0, 26.0, 29.0)],
                                  None)
    assert ("async, the first process ever (it starts the compile service), compiled vs "
            "torch.compile's first call: 26.000 / 30.000 = 0.867x (target <= 0.9x) met"
            ) in [line.strip() for line in lines]
    warm = [line.strip() for line in lines if "the compile service warm" in line]
    assert ("async, the compile service warm, compiled vs torch.compile's first call: "
            "24.000 / 30.000 = 0.800x (target <= 0.7x) MISSED") in warm
    assert ("async, the compile service warm, first compiled code (each repeated block "
            "compiled once) vs torch.compile's first call: 18.000 / 30.000 = 0.600x for "
            "comparison") in warm
    assert not any("first process ever, first compiled code" in line for line in lines)


def test_a_warm_restart_is_weighed_against_torch_compiles_own_warm_restart() -> None:
    def row(name: str, first: float, stays: float) -> dict[str, object]:
        return {"row": name, "first_output_s": first, "to_stays_s": stays,
                "to_final_s": stays, "eager_ms": 1.0, "largest_call_ms": 15.0, "calls": 9}

    lines = [line.strip() for line in bench_report._targets(
        [row("torch:eager-backend (warm)", 3.0, 3.0), row("torch:default (warm)", 5.0, 5.0),
         row("hotswap:async", 2.5, 20.0), row("hotswap:async (warm)", 2.9, 4.4)], None)]
    assert ("hotswap:async warm restart compiled vs torch.compile's warm first call: "
            "4.400 / 5.000 = 0.880x (target <= 0.9x) met") in lines
    assert ("hotswap:async warm restart first output vs dynamo trace + eager call, warm: "
            "2.900 / 3.000 = 0.967x (target <= 1.05x) met") in lines
    assert ("hotswap:async (warm) largest call 15.0 ms vs 2x eager + 10 ms = 12.0 ms: "
            "MISSED") in lines
    assert not any(line.startswith("hotswap:progressive warm restart") for line in lines)


def test_a_row_whose_workers_were_raised_says_so_and_from_when() -> None:
    note = ("waiting on CPU: compile workers got under 25% of a core for 2.0 s while your "
            "process's threads kept the cores busy; raised to your priority")
    row = {"row": "hotswap:async", "steady_serving_mib": 500.0, "steady_workers_mib": 400.0,
           "steady_their_children_mib": 0.0, "steady_total_mib": 900.0,
           "waiting": [[note, 9.25]]}
    lines = [line.strip() for line in bench_report._footprint([row])]
    assert lines[1] == f"hotswap:async waited from 9.2 s: {note}"
    assert len(bench_report._footprint([{**row, "waiting": []}])) == 1
