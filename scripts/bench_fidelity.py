"""A tier is what it says, timed: a scalar tier (``cpp.simdlen=1``) served by hotswap against
``torch.compile(options=...)`` with the same config, and eager, in one process (CPU).

    .venv/bin/python scripts/bench_fidelity.py

A 6-block layer_norm/gelu/sin chain on 256x1024, each timed over 20 calls after 2 warm-ups.
The hotswap tier compiles in a worker (subprocess mode); it must run torch.compile's scalar
code, not vectorized code built for the machine's ISA.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

import hotswap


def chain(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    for w in weights:
        x = torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (1024,), w)).sin()
    return x


def main() -> None:
    torch.manual_seed(0)
    x, weights = torch.randn(256, 1024), [torch.randn(1024) for _ in range(6)]

    def ms(fn: Callable[..., Any]) -> float:
        for _ in range(2):
            fn(x, weights)
        start = time.perf_counter()
        for _ in range(20):
            fn(x, weights)
        return (time.perf_counter() - start) / 20 * 1e3

    config = {"cpp.simdlen": 1}
    ours = hotswap.compile(chain, mode="subprocess", tiers=[{"name": "scalar", "config": config}])
    ours_ms = ms(ours)
    path = hotswap.status(ours)[0].path
    theirs_ms = ms(torch.compile(chain, options=config))
    print(f"eager {ms(chain):.1f} ms | hotswap tier scalar {ours_ms:.1f} ms (path {path}) | "
          f"torch.compile(options={config}) {theirs_ms:.1f} ms | ratio {ours_ms / theirs_ms:.2f}x")


if __name__ == "__main__":
    main()
