from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    """Each test starts with dynamo's compiled frames gone, as in a fresh process: counter
    deltas then count only the graphs this test's models produce."""
    torch._dynamo.reset()
