"""The zoo's models build on CPU and their reference checks measure what they claim."""

from __future__ import annotations

import pytest
import torch

from hotswap.tools import zoo


@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_eager_matches_its_reference_and_a_wrong_output_is_caught(name: str) -> None:
    workload = zoo.make(name)
    for step in range(3):
        out = workload.step(workload.target, step)
        assert workload.error(out, step) <= workload.tolerance, (name, step)
    bad = torch.utils._pytree.tree_map(
        lambda t: t + 1 if isinstance(t, torch.Tensor) else t, out)
    assert workload.error(bad, 2) >= 0.5


def test_training_reference_catches_up_one_optimizer_step_at_a_time() -> None:
    workload = zoo.make("training")
    losses = [workload.step(workload.target, step) for step in range(4)]
    assert [workload.error(loss, step) for step, loss in enumerate(losses)] == [0.0] * 4
    assert not torch.equal(losses[0], losses[3])  # the model learned: state really advanced


def test_bad_names_and_dtypes() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        zoo.make("resnet1000")
    with pytest.raises(ValueError, match="unknown dtype"):
        zoo.make("mlp", dtype="float99")
    assert zoo.make("mlp", dtype="bfloat16").target[0].weight.dtype == torch.bfloat16
