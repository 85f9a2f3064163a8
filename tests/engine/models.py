"""Small models for backend tests, each with inputs; CPU sizes keep inductor quick."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch


def tier_failure(error: BaseException | None) -> Any:
    """The ``hotswap.TierFailed`` inside a dynamo error (dynamo wraps backend errors), or None."""
    import hotswap

    for _ in range(10):
        if error is None or isinstance(error, hotswap.TierFailed):
            return error
        error = getattr(error, "inner_exception", None) or error.__cause__
    return None


def unseen_scale() -> float:
    """A factor in [1, 2) with 48 random bits: a graph that multiplies by it is one no inductor
    cache has seen (FX prints the constant in full, so it is part of the cache key). With fewer
    bits, runs sharing a cache directory hit each other's entries and skip codegen."""
    return 1.0 + int.from_bytes(os.urandom(6), "little") / 2**48


def mlp() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    return model, (torch.randn(16, 32),)


def convnet() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4),
    ).eval()
    return model, (torch.randn(2, 3, 16, 16),)


def with_graph_break(x: torch.Tensor) -> torch.Tensor:
    y = (x * 2).relu()
    torch._dynamo.graph_break()
    return (y + 1).sin()


class WithConstants(torch.nn.Module):
    """Reads a plain tensor attribute (not a parameter or buffer) and builds a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.scale = torch.randn(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale + torch.tensor([1.0] * 8)


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up, self.down = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Blocks(torch.nn.Module):
    """A stack of alike blocks between two other layers: a transformer's shape, compiled
    region by region (jobs/regions.py)."""

    def __init__(self, depth: int = 4, width: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(16, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).softmax(-1)


def blocks() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """Served for inference (nothing needs grad), as a stack of blocks is cut."""
    return Blocks().requires_grad_(False), (torch.randn(4, 16),)


MODELS: dict[str, Callable[[], tuple[Any, tuple[torch.Tensor, ...]]]] = {
    "mlp": mlp,
    "convnet": convnet,
    "graph-break": lambda: (with_graph_break, (torch.randn(8, 8),)),
    "constants": lambda: (WithConstants(), (torch.randn(4, 8),)),
    "blocks": blocks,
}
