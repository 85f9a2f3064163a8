"""Warming the process's load path: each step once, in order, and hotswap.prepare()."""

from __future__ import annotations

import threading

import pytest
import torch

import hotswap
from hotswap.engine.loading import warmup


@pytest.fixture
def fresh_warmup(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A new warm-up whose steps only record that they ran (and on which thread)."""
    ran: list[str] = []
    steps = {name: (lambda name=name: ran.append(f"{name}@{threading.current_thread().name}"))
             for name in ("common", "cpu", "cuda")}
    monkeypatch.setattr(warmup, "_STEPS", steps)
    monkeypatch.setattr(warmup, "_warmup", warmup._Warmup())
    return ran


def test_steps_run_once_each_on_the_load_thread(fresh_warmup: list[str]) -> None:
    assert warmup.wait_warmup(["cpu"], timeout_s=30)
    assert warmup.wait_warmup(["cpu", "cuda:0"], timeout_s=30)
    assert warmup.wait_warmup(["cuda:1"], timeout_s=30)
    assert fresh_warmup == ["common@hotswap-load", "cpu@hotswap-load",
                            "cuda@hotswap-load"]


def test_a_failing_step_is_logged_and_counts_as_done(fresh_warmup: list[str],
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> None:
        raise RuntimeError("no compiler")

    monkeypatch.setitem(warmup._STEPS, "cpu", broken)
    with caplog.at_level("INFO", logger="hotswap"):
        assert warmup.wait_warmup(["cpu"], timeout_s=30)
    assert "no compiler" in caplog.text


def test_the_real_cpu_warmup_runs_no_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warmup, "_warmup", warmup._Warmup())  # its steps run again
    with hotswap.counters_delta() as delta:
        assert warmup.wait_warmup(["cpu"], timeout_s=240)
    assert delta["load_compiler_runs"] == 0


def test_prepare_starts_the_pool_and_checks_its_arguments() -> None:
    assert hotswap.prepare(workers=1, devices=["cpu"], wait=True, timeout_s=240) is True
    with pytest.raises(ValueError, match="devices"):
        hotswap.prepare(devices=["tpu"])
    with pytest.raises(ValueError, match="workers"):
        hotswap.prepare(workers=0)


def test_intra_op_threads_are_set_for_the_block_only() -> None:
    from hotswap.compat import intra_op_threads

    before = torch.get_num_threads()
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with intra_op_threads(None):
        assert torch.get_num_threads() == before
