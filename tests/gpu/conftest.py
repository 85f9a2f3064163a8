from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device: GPU tests run on a GPU machine (see README)")
    for item in items:
        if "tests/gpu/" in str(item.path):
            item.add_marker(skip)
