"""Profiles of real runs: stage timelines per mode, tier comparisons, the gate, the CLI."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import hotswap
from hotswap.profiles import (
    Call,
    GateDecision,
    KernelBreakdown,
    Span,
    Swap,
    TierBench,
    read_records,
)
from tests.engine.models import unseen_scale

REPO = Path(__file__).resolve().parents[2]
LADDER = ["default", {"name": "no-fusion", "config": {"max_fusion_size": 1}}]
WORKER_STAGES = ("queue_wait", "worker_deserialize", "graph_unpickle", "inductor_compile",
                 "collect_files", "transfer", "load")
EPS = 1e-3  # clocks are shared, but stamps are taken a few instructions apart


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Any:
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


def _serve(compiled: Any, inputs: tuple[torch.Tensor, ...], expected: torch.Tensor) -> None:
    torch.testing.assert_close(compiled(*inputs), expected, rtol=1e-4, atol=1e-4)
    hotswap.wait(compiled, timeout_s=240)
    for _ in range(3):
        torch.testing.assert_close(compiled(*inputs), expected, rtol=1e-4, atol=1e-4)


def _records(directory: Path) -> list[Any]:
    from hotswap.engine.recording import shared_timeline

    shared_timeline(str(directory)).flush()
    return read_records(directory)


def _stage(spans: list[Span], tier: str, name: str) -> Span:
    [found] = [s for s in spans if s.tier == tier and s.name == name and not s.category]
    return found


MODES = ["inprocess", "subprocess", "async", "progressive"]


class _Unseen(torch.nn.Module):
    """A graph inductor's on-disk cache has never seen (a fresh constant in its code): a cache
    hit would skip lowering and codegen, whose stages these tests look for."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 8)
        self.salt = unseen_scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * self.salt).relu()


@pytest.mark.parametrize("mode", MODES)
def test_stage_timeline_is_complete_and_ordered(mode: str, tmp_path: Path) -> None:
    model = _Unseen()
    inputs = (torch.randn(16, 32),)
    expected = model(*inputs)
    compiled = hotswap.compile(model, mode=mode, workers=2, profile_dir=str(tmp_path),
                               tiers=LADDER if mode == "progressive" else None)
    _serve(compiled, inputs, expected)
    records = _records(tmp_path)
    spans = [r for r in records if isinstance(r, Span)]
    [status] = hotswap.status(compiled)
    graph_stages = {s.name for s in spans if s.tier == "-"}
    assert "dynamo_trace" in graph_stages
    calls = [r for r in records if isinstance(r, Call)]
    assert len(calls) == 4 and [c.seq for c in calls] == [1, 2, 3, 4]
    if mode == "inprocess":
        assert _stage(spans, "default", "inprocess_compile").duration_s > 0
        assert {c.tier for c in calls} == {"default"}
        return
    assert "serialize" in graph_stages
    tiers = ["default", "no-fusion"] if mode == "progressive" else ["default"]
    for tier in tiers:
        stages = [_stage(spans, tier, name) for name in WORKER_STAGES]
        for before, after in itertools.pairwise(stages):
            assert before.end_s <= after.start_s + EPS, (tier, before, after)
        compile_stage = stages[WORKER_STAGES.index("inductor_compile")]
        inner = [s for s in spans if s.tier == tier and s.category]
        assert {"lowering", "codegen", "kernel_compile"} <= {s.category for s in inner}, (
            tier, sorted((s.name, s.category) for s in inner))
        assert all(compile_stage.start_s - EPS <= s.start_s and s.end_s <= compile_stage.end_s + EPS
                   for s in inner)
        assert {s.pid for s in inner} == {compile_stage.pid} != {os.getpid()}
    if mode == "subprocess":
        assert {c.tier for c in calls} == {"default"}
        return
    swaps = [r for r in records if isinstance(r, Swap)]
    if mode == "async":
        assert [(s.old_tier, s.new_tier, s.reason) for s in swaps] == [("eager", "default", "swap")]
    else:
        _replay_the_gate(records, tiers, status)
    # The serving tier's first call comes after its load (a tier replaced before any call
    # reached it has no first call).
    if status.tier != "eager":
        first = _stage(spans, status.tier, "first_call")
        assert _stage(spans, status.tier, "load").end_s <= first.start_s + EPS
    assert calls[0].tier == "eager" and calls[-1].tier == status.tier
    if mode == "progressive":
        # Profiling: every tier and eager compared on the same inputs, kernels broken down.
        compared = {b.tier: b for b in records if isinstance(b, TierBench) and b.purpose == "compare"}
        assert set(compared) == {"eager", "default", "no-fusion"}
        assert all(b.result.n > 0 and b.speedup_vs_eager for b in compared.values())
        kernels = {k.tier: k for k in records if isinstance(k, KernelBreakdown)}
        assert set(kernels) == {"eager", "default", "no-fusion"}
        assert "cpp_fused" in kernels["default"].category_ms
        assert "cpp_fused" not in kernels["eager"].category_ms


def _replay_the_gate(records: list[Any], tiers: list[str], status: hotswap.GraphStatus) -> None:
    """Eager is the first tier every tier must beat: none serves before the gate measured it
    against what serves then. Replayed in order, the swaps follow the gate's decisions: a tier
    swaps in on a measurement of that pair that adopted it (or, undecided on a busy machine,
    had it ahead), gives way only to the tier it was weighed against, and the decisions that
    stood (one per tier) leave serving what serves at the end. The tiers kept out say why:
    against eager, that eager was faster (on this 2-core box it may be, for both tiers)."""
    stood = [r for r in records if isinstance(r, GateDecision) and r.outcome != "undecided"]
    final = {d.candidate: d for d in stood}
    assert sorted(d.candidate for d in stood) == sorted(tiers), stood
    assert all(d.outcome in ("adopt", "keep") for d in stood), stood
    serving, last = "eager", dict[frozenset[str], GateDecision]()  # pair -> its last decision
    for r in records:
        if isinstance(r, GateDecision):
            assert serving in (r.serving, r.candidate), (r, serving)  # (on trial: the candidate)
            last[frozenset((r.serving, r.candidate))] = r
        elif isinstance(r, Swap) and r.reason in ("swap", "kept"):
            on = last.get(frozenset((r.old_tier, r.new_tier)))
            assert on is not None, (r, "no gate measurement of this pair before it")
            if r.reason == "kept" and on.candidate == r.new_tier:  # kept out: nothing changes
                assert r.old_tier == serving and on.outcome == "keep", (r, on)
                continue
            assert r.old_tier == serving, (r, serving)
            if on.candidate == r.new_tier:  # swaps in
                assert r.reason == "swap" and (on.adopt or on.outcome == "undecided"), (r, on)
            else:  # gives way: kept out ("kept"), or ranked slower while undecided ("swap")
                assert on.outcome == ("keep" if r.reason == "kept" else "undecided"), (r, on)
            serving = r.new_tier
    assert status.tier == serving
    if serving == "eager":  # eager measured faster than every tier
        assert all(d.serving == "eager" and not d.adopt for d in final.values()), final
    assert sorted(t for t, _ in status.kept) == sorted(t for t, d in final.items() if not d.adopt)
    for tier, why in status.kept:
        if final[tier].serving == "eager":
            assert why.startswith(("slower than eager: eager is ",
                                   "not faster than eager: ")), why
        else:
            assert why.startswith("gate: "), why


SCRIPT = """
import sys
import torch
import hotswap

model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
x = torch.randn(16, 32)
compiled = hotswap.compile(model, mode="async", workers=1)
for _ in range(3):
    compiled(x)
hotswap.wait(compiled, timeout_s=240)
for _ in range(5):
    compiled(x)
print("served", sys.argv[1:])
"""


def test_profile_cli_on_a_script_then_report_and_compare(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # Options go before SCRIPT: everything after it is the script's own argv.
    done = subprocess.run([sys.executable, "-m", "hotswap.cli", "profile", "--out", str(out),
                           "--torch-profiler", str(script), "--flag", "--out", "theirs"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "served ['--flag', '--out', 'theirs']" in done.stdout
    report = (out / "report.txt").read_text()
    assert "calls served: eager 3, default 5" in report
    assert "graph g1: Sequential.forward" in report  # named by what made it
    trace = json.loads((out / "trace.json").read_text())
    assert any(e.get("cat") == "call" for e in trace["traceEvents"])
    merged = json.loads((out / "trace_merged.json").read_text())
    assert merged["otherData"]["hotswap"]["aligned_calls"] == 8
    assert any(e.get("name", "").startswith("aten::") for e in merged["traceEvents"])
    assert (out / "latency.png").read_bytes()[:4] == b"\x89PNG"
    from hotswap.cli import main

    (out / "report.txt").unlink()
    assert main(["profile", "report", str(out)]) == 0
    assert (out / "report.txt").read_text() == report
    assert main(["profile", "compare", str(out), str(out)]) == 0
    assert "graph g1: Sequential.forward" in capsys.readouterr().out  # paired by signature
    with pytest.raises(SystemExit, match="SCRIPT to run or --model"):
        main(["profile"])


def test_dynamo_trace_after_a_dynamo_reset_is_this_compiles(tmp_path: Path) -> None:
    """torch._dynamo.reset() drops dynamo's callbacks: each graph compiled after one has the
    trace span of its own compile, not one from an earlier compile's start."""
    for run in ("first", "after-reset", "after-another"):
        torch._dynamo.reset()
        reset_s = time.monotonic()
        model = _Unseen()
        compiled = hotswap.compile(model, mode="inprocess", profile_dir=str(tmp_path / run))
        x = torch.randn(4, 32)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
        [trace] = [s for s in _records(tmp_path / run)
                   if isinstance(s, Span) and s.name == "dynamo_trace"]
        assert trace.start_s >= reset_s, (run, trace, reset_s)
