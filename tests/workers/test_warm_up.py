from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hotswap.jobs import compile as compile_job


def test_the_op_family_graphs_compile_and_match_eager() -> None:
    graphs = compile_job.compile_op_families("cpu", torch.float32)
    assert len(graphs) == 2
    with torch.no_grad():
        for compiled, module, example in graphs:
            torch.testing.assert_close(compiled(example), module(example), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's path")
def test_a_worker_without_a_gpu_compiles_no_op_families(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> None:
        raise AssertionError("warm_ops compiled on a machine without a GPU")

    monkeypatch.setattr(compile_job, "compile_op_families", refuse)
    compile_job.warm_ops()


def test_a_warm_up_compile_gets_past_a_library_a_killed_link_left_cut_short(
        tmp_path: Path) -> None:
    """Inductor links a kernel library in place: a worker killed while linking its warm-up
    compile's leaves it cut short, and inductor's caches serve it to every later compile. The
    next warm-up removes it and compiles again (else no worker on the machine is ever warm)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    code = "from hotswap.jobs.compile import warm_compile; warm_compile()"

    def warm_up() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=600, check=False)

    first = warm_up()
    assert first.returncode == 0, first.stderr[-3000:]
    [library] = list((tmp_path / "inductor").rglob("*.main.so"))  # the kernel's
    whole = library.stat().st_size
    library.write_bytes(library.read_bytes()[:64])  # as a killed link leaves it
    second = warm_up()
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"removed a damaged kernel library from inductor's cache, compiling again: " \
        f"{library}" in second.stderr
    assert library.stat().st_size == whole  # built again, whole
