"""GPU jobs run inside workers."""

from __future__ import annotations

import os
from typing import Any


def cuda_identity(_: Any = None) -> dict[str, Any]:
    import torch

    x = torch.arange(1024, device="cuda", dtype=torch.float32)
    return {
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "count": torch.cuda.device_count(),
        "sum": float((x * 2).sum().item()),
        "name": torch.cuda.get_device_name(0),
    }
