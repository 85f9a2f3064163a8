from __future__ import annotations

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
