"""Workloads from PyTorch's own subprocess-compile tests, shared by the GPU tests."""

from __future__ import annotations

import torch

TIERS = ["default", "max-autotune-no-cudagraphs"]


def matmul_relu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a @ b).relu()


def matmul_relu_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 x 1152x1024 and y 1024x1024, as in test_compile_subprocess.py."""
    return (torch.randn(1152, 1024, device="cuda", dtype=torch.bfloat16),
            torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16))
