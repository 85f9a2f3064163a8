"""What the tools share: their CLI wiring (a ``hotswap`` subcommand, or ``python -m`` alone),
whether a GPU is here, and the ``Workload`` record the zoo and the corpus build (torch is
imported only when a workload is checked: ``hotswap --help`` reads this module)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["Workload", "cuda_available", "plain", "standalone", "subcommand", "tolerance"]

AddArguments = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]


def plain(doc: str | None) -> str | None:
    """A docstring as ``--help`` shows it: without reStructuredText's double backticks."""
    return doc.replace("``", "") if doc else doc


def subcommand(sub: Any, name: str, help: str, doc: str | None, add_arguments: AddArguments,
               run: Run) -> None:
    """``hotswap NAME ...``: the tool's parser under the CLI's subparsers, its docstring as
    the description (``--help``)."""
    parser = sub.add_parser(name, help=help, description=plain(doc),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)


def standalone(prog: str, doc: str | None, add_arguments: AddArguments, run: Run,
               argv: list[str] | None) -> int:
    """``python -m hotswap.tools.X ...``: the same parser, run once."""
    parser = argparse.ArgumentParser(prog=prog, description=plain(doc),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


@dataclass
class Workload:
    name: str
    target: Any                                   # what to compile
    inputs: Callable[[int], tuple[Any, ...]]      # step -> arguments
    reference: Callable[[int], Any]               # step -> eager output for the same step
    tolerance: float
    call: Callable[[Any, int], Any] | None = None  # how to drive one step (default target(*in))

    def step(self, compiled: Any, step: int) -> Any:
        if self.call is not None:
            return self.call(compiled, step)
        return compiled(*self.inputs(step))

    def error(self, out: Any, step: int) -> float:
        """Max absolute difference from eager for ``step`` (outputs as pytrees of tensors)."""
        return _max_error(out, self.reference(step))


def _max_error(out: Any, ref: Any) -> float:
    import torch

    if isinstance(out, torch.Tensor):
        if out.shape != ref.shape:
            return float("inf")
        return float((out.detach().float() - ref.detach().float()).abs().max()) if out.numel() else 0.0
    if isinstance(out, list | tuple):
        return max((_max_error(a, b) for a, b in zip(out, ref, strict=True)), default=0.0)
    return 0.0 if out == ref else float("inf")


def tolerance(dtype: torch.dtype) -> float:
    import torch

    return 5e-2 if dtype in (torch.float16, torch.bfloat16) else 2e-3
