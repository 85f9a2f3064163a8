"""``torch.compiler.reset()`` resets hotswap as it resets dynamo: the graphs are forgotten
(status, waits), what was under way for them ends quietly, idle workers exit, and a later
compile works as in a fresh process."""

from __future__ import annotations

import logging
import time

import pytest
import torch

import hotswap
from hotswap.engine.coordinator import Coordinator
from hotswap.engine.options import Options
from hotswap.executors import local
from hotswap.testing.fake import FakeCompiler
from tests.conftest import wait_gone
from tests.engine.models import mlp


def test_reset_forgets_the_graphs_and_their_pending_tiers_end_quietly(
        caplog: pytest.LogCaptureFixture) -> None:
    # Each tier is weighed against what serves (eager first) before it serves: medians let
    # the gate decide, each rung faster than the one below.
    fake = FakeCompiler(hold=True, medians={"eager": 2.0, "default": 1.0, "max-autotune": 0.5})
    backend = Coordinator(Options.create(mode="progressive"), compiler=fake,
                          measure=fake.measure)
    model, inputs = mlp()
    compiled = torch.compile(model, backend=backend)
    with caplog.at_level(logging.INFO, logger="hotswap"), hotswap.counters_delta() as d:
        compiled(*inputs)
        [status] = hotswap.status(backend)
        assert status.pending == ("default", "max-autotune")
        torch.compiler.reset()
        assert hotswap.status(backend) == []
        assert hotswap.wait(backend, timeout_s=5) == []  # returns at once: nothing pending
        fake.release()  # the compiles under way finish: nothing loads or swaps in
        hotswap.wait(backend, timeout_s=1)
    assert (d["fallbacks"], d["swaps"], d["internal_errors"]) == (0, 0, 0)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == []
    # The model, called again, is traced again and compiles as usual.
    torch.testing.assert_close(compiled(*inputs), model(*inputs))
    [status] = hotswap.wait(backend, timeout_s=30)
    # The graph climbed again to the top rung. Both compile at once: "default", if it loads
    # last, is weighed against "max-autotune" and kept out.
    assert status.final and status.tier == "max-autotune", status
    assert all(tier == "default" and why.startswith("gate: 'max-autotune' is 2.0x faster")
               for tier, why in status.kept), status
    assert not status.failures and status.path == "worker", status


def test_a_reset_reaches_a_backend_again_after_an_earlier_reset() -> None:
    """dynamo resets the backends given to torch.compile since its last reset; the model
    compiled before the first reset and called after it is forgotten by the second too."""
    fake = FakeCompiler()
    backend = Coordinator(Options.create(mode="async", tiers=["default"]), compiler=fake,
                          measure=fake.measure)
    model, inputs = mlp()
    compiled = torch.compile(model, backend=backend)
    compiled(*inputs)
    torch.compiler.reset()
    compiled(*inputs)
    assert len(hotswap.status(backend)) == 1
    torch.compiler.reset()
    assert hotswap.status(backend) == []


def test_reset_cancels_a_running_compile_lets_idle_workers_exit_and_compiles_again(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from hotswap import testing

    monkeypatch.setattr(local, "RESET_IDLE_EXIT_S", 0.5)
    model, inputs = mlp()
    compiled = hotswap.compile(model, mode="async", tiers=["default"], workers=1)
    with testing.inject(testing.FaultPlan({"hang": 1.0})), hotswap.counters_delta() as d, \
            caplog.at_level(logging.WARNING, logger="hotswap"):
        torch.testing.assert_close(compiled(*inputs), model(*inputs))
        [status] = hotswap.status(compiled)
        assert status.pending == ("default",)
        pids = hotswap.runtime().worker_pids()
        assert pids
        torch.compiler.reset()
        assert hotswap.status(compiled) == []
        assert hotswap.wait(compiled, timeout_s=5) == []
        # the hung job's worker is killed; its replacement and the pool exit, being idle
        assert wait_gone(pids, 30) == []
        deadline = time.monotonic() + 30
        while hotswap.runtime().worker_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert hotswap.runtime().worker_pids() == []
    assert d["fallbacks"] == 0 and caplog.records == []
    again = hotswap.compile(model, mode="async", tiers=["default"], workers=1)
    torch.testing.assert_close(again(*inputs), model(*inputs))
    [status] = hotswap.wait(again, timeout_s=240)
    assert status.tier == "default" and not status.failures, status
