"""What the tools share: their CLI wiring (a ``hotswap`` subcommand, or ``python -m`` alone)
and whether a GPU is here."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

__all__ = ["cuda_available", "plain", "standalone", "subcommand"]

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
