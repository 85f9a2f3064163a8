"""What torch.compile users bring: torch's mode=, status on what torch.compile returned,
readable status, wait that can raise, dir(hotswap), TORCH_LOGS and a default log line."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hotswap
from hotswap.engine.api import TORCH_MODES
from hotswap.engine.coordinator import Coordinator
from hotswap.engine.options import Options
from hotswap.testing.fake import FakeCompiler
from tests.engine.models import mlp


def _value_error(error: BaseException | None) -> ValueError | None:
    """The ValueError inside a dynamo error (dynamo wraps backend errors), or None."""
    for _ in range(10):
        if error is None or isinstance(error, ValueError):
            return error
        error = getattr(error, "inner_exception", None) or error.__cause__
    return None


def test_torch_mode_picks_the_top_of_the_ladder_and_status_takes_the_optimized_module(
        ) -> None:
    model, inputs = mlp()
    compiled = torch.compile(model, backend="hotswap", mode="max-autotune-no-cudagraphs",
                             options=None)
    torch.testing.assert_close(compiled(*inputs), model(*inputs))
    [status] = hotswap.status(compiled)
    assert [t for t, _ in status.states] == list(TORCH_MODES["max-autotune-no-cudagraphs"])
    statuses = hotswap.wait(compiled, timeout_s=300, raise_on_timeout=True)
    assert all(s.final and not s.failures for s in statuses), statuses
    torch.testing.assert_close(compiled(*inputs), model(*inputs))


def test_reduce_overhead_climbs_to_a_cuda_graph_tier_that_serves_cpu_graphs_as_they_are(
        ) -> None:
    """On CPU nothing is captured (tests/gpu captures); the ladder and outputs hold."""
    model, inputs = mlp()
    compiled = torch.compile(model, backend="hotswap", mode="reduce-overhead")
    torch.testing.assert_close(compiled(*inputs), model(*inputs))
    [status] = hotswap.wait(compiled, timeout_s=300, raise_on_timeout=True)
    assert [t for t, _ in status.states] == ["default", "reduce-overhead"] and not status.failures
    for _ in range(3):
        torch.testing.assert_close(compiled(*inputs), model(*inputs))


def test_a_cuda_graph_tier_runs_a_cpu_graph_as_it_is() -> None:
    from hotswap.engine.loading.cudagraphs import CudaGraphed, split_cudagraphs

    graphed = CudaGraphed(lambda x: x * 2, "g1")
    for _ in range(3):
        torch.testing.assert_close(graphed(torch.ones(3)), torch.full((3,), 2.0))
    assert not graphed.captured and graphed.why_not == "an argument is not on a CUDA device"
    assert split_cudagraphs({"max_autotune": True, "hotswap.cudagraphs": True}) == (
        {"max_autotune": True}, True)


def test_status_of_a_torch_compiled_model_is_its_own_backends_graphs() -> None:
    model, inputs = mlp()
    mine = torch.compile(model, backend="hotswap", options={"mode": "subprocess", "workers": 1,
                                                             "tiers": ["default"]})
    mine(*inputs)
    other = torch.compile(lambda x: x.sin() + 1, backend="hotswap",
                          options={"mode": "inprocess", "tiers": ["default"]})
    other(torch.randn(4))
    [status] = hotswap.status(mine)
    assert status.tier == "default" and status.path == "worker"
    [status] = hotswap.status(other)  # a compiled function: its backend is found the same way
    assert status.path == "inprocess"


@pytest.mark.parametrize(("mode", "needle"), [
    ("async", "options={'mode': 'async'}"),
    ("fastest", "unknown torch.compile mode"),
])
def test_torch_modes_hotswap_cannot_serve_say_why(mode: str, needle: str) -> None:
    model, inputs = mlp()
    compiled = torch.compile(model, backend="hotswap", mode=mode)
    with pytest.raises(Exception) as info:
        compiled(*inputs)
    error = _value_error(info.value)
    assert error is not None and needle in str(error), info.value


def test_status_of_something_hotswap_never_saw_names_its_type_not_its_repr() -> None:
    with pytest.raises(ValueError) as info:
        hotswap.status(torch.nn.Linear(3, 3))
    assert "Linear" in str(info.value) and "in_features" not in str(info.value)


def test_wait_raises_on_timeout_when_asked_and_status_reads_in_one_line() -> None:
    fake = FakeCompiler(hold=True)
    model, inputs = mlp()
    backend = Coordinator(Options.create(mode="async"), compiler=fake, measure=fake.measure)
    compiled = torch.compile(model, backend=backend)
    compiled(*inputs)
    assert not hotswap.wait(backend, timeout_s=0.1)[0].final  # no raise unless asked
    with pytest.raises(hotswap.WaitTimeout) as info:
        hotswap.wait(backend, timeout_s=0.1, raise_on_timeout=True)
    assert isinstance(info.value, TimeoutError) and "pending default" in str(info.value)
    fake.release()
    statuses = hotswap.wait(backend, timeout_s=30, raise_on_timeout=True)
    [status] = statuses
    line = str(status)
    assert "\n" not in line
    assert line.startswith(f"{status.graph_id}: default (worker) | served default at ")
    assert str(statuses) == repr(statuses) == line == str(hotswap.status(backend))  # print(list)
    assert str(hotswap.status(Coordinator(Options.create()))) == "(no graphs)"


def test_the_public_names_are_in_dir() -> None:
    names = dir(hotswap)
    assert {"compile", "backend", "prepare", "status", "wait", "runtime", "shutdown",
            "GraphStatus", "TierFailed", "WaitTimeout", "MODES"} <= set(names)
    assert "TYPE_CHECKING" not in names and "Any" not in names


_SCRIPT = textwrap.dedent("""
    import torch, hotswap
    from hotswap.engine.coordinator import Coordinator
    from hotswap.engine.options import Options
    from hotswap.testing.fake import FakeCompiler
    fake = FakeCompiler()
    backend = Coordinator(Options.create(mode="async"), compiler=fake, measure=fake.measure)
    compiled = torch.compile(torch.nn.Linear(4, 4), backend=backend)
    compiled(torch.randn(2, 4))
    hotswap.wait(backend, timeout_s=30)
""")


@pytest.mark.parametrize(("env", "expected"), [
    ({}, "hotswap: graph g1: now served by tier 'default'"),
    ({"TORCH_LOGS": "hotswap"}, "now served by tier 'default'"),
    ({"HOTSWAP_LOG": "off"}, None),
    ({"HOTSWAP_LOG": "warning"}, None),
])
def test_a_swap_is_one_line_on_stderr_by_default_and_torch_logs_know_hotswap(
        env: dict[str, str], expected: str | None) -> None:
    environ = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "HOTSWAP_LOG")}
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          timeout=120, env={**environ, **env})
    assert done.returncode == 0, done.stderr
    swaps = [line for line in done.stderr.splitlines() if "now served by" in line]
    if expected is None:
        assert swaps == [], done.stderr
    else:
        assert len(swaps) == 1 and expected in swaps[0], done.stderr


def test_a_workers_trace_sits_under_the_callers_dynamo_frame(tmp_path: Path) -> None:
    """TORCH_TRACE: the worker's inductor logs carry the compile id of the frame they came
    from, so tlparse puts them under the caller's frame (they said compile_id None)."""
    script = textwrap.dedent("""
        import os, torch, hotswap
        print(os.getpid())
        compiled = hotswap.compile(torch.nn.Linear(4, 4), mode="async", workers=1)
        compiled(torch.randn(2, 4))
        assert all(s.path == "worker" for s in hotswap.wait(compiled, timeout_s=240))
    """)
    trace = tmp_path / "trace"
    environ = {**os.environ, "TORCH_TRACE": str(trace), "HOTSWAP_CACHE_DIR": str(tmp_path / "c"),
               "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "i")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=environ)
    assert done.returncode == 0, done.stderr
    caller = done.stdout.split()[0]
    logs = {f: f.read_text() for f in trace.rglob("*.log")}  # workers': trace/worker-<slot>/
    workers = [text for f, text in logs.items() if f.parent.name.startswith("worker-")
               and "inductor_output_code" in text and f" {caller} " not in text.split("]")[0]]
    assert workers, sorted(str(f) for f in logs)
    assert '"frame_id": 0, "frame_compile_id": 0' in workers[0]
