"""The README and the documentation site cannot drift from the code.

- The site builds with ``mkdocs build --strict``: a broken link or anchor, a page left out of
  the navigation, or an API entry naming a symbol ``hotswap`` no longer has fails the build.
- Every ```python block of README.md and docs/*.md runs, the blocks of one page in order in one
  fresh process (as a reader would paste them), and a ```text title="output" block right after
  one is what that block printed. A block that cannot run on a CPU machine without services says
  so in its info string (``title="not run in the tests: <why>"``); those are listed here.
- The README's links resolve, and every ``hotswap`` command and flag the README and docs/cli.md
  name exists (and docs/cli.md names them all).
"""

from __future__ import annotations

import argparse
import doctest
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from hotswap.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = 'title="not run in the tests:'
# The blocks that do not run here, and why (each says so in its info string too).
EXPECTED_NOT_RUN = {"docs/fleet.md": 1}  # a Dask cluster and a Redis server


@dataclass(frozen=True)
class Block:
    page: str       # relative to the repository root
    line: int       # of the opening fence
    info: str       # the fence's info string
    source: str
    output: str | None = None  # the ```text title="output" block right after it

    @property
    def runs(self) -> bool:
        return NOT_RUN not in self.info


_FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)


def python_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    fences = list(_FENCE.finditer(text))
    blocks = []
    for i, fence in enumerate(fences):
        info = fence["info"].strip()
        if info.split(" ")[0] not in ("python", "py"):
            continue
        output = None
        after = fences[i + 1] if i + 1 < len(fences) else None
        if (after is not None and after["info"].strip() == 'text title="output"'
                and not text[fence.end():after.start()].strip()):
            output = after["body"]
        blocks.append(Block(str(path.relative_to(ROOT)), text.count("\n", 0, fence.start()) + 1,
                            info, fence["body"], output))
    return blocks


ALL_BLOCKS = [b for page in PAGES for b in python_blocks(page)]
RUN_PAGES = sorted({b.page for b in ALL_BLOCKS if b.runs})

# Runs one page's blocks in order in one namespace, and reports what each printed.
_RUNNER = r"""
import contextlib, io, json, sys, traceback
blocks = json.load(open(sys.argv[1]))
ns = {"__name__": "__main__"}
results = []
for block in blocks:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(block["source"], block["where"], "exec"), ns)
    except BaseException:
        results.append({"stdout": out.getvalue(), "error": traceback.format_exc()})
        break
    results.append({"stdout": out.getvalue(), "error": None})
json.dump(results, open(sys.argv[2], "w"))
"""

# What differs between runs of the same example: times, and which tier the gate let serve.
_DECIMAL = re.compile(r"\d+\.\d+")
_TIER = re.compile(r"\b(max-autotune-no-cudagraphs|max-autotune|reduce-overhead|default)\b")


def _normalized(text: str) -> str:
    return _TIER.sub("TIER", _DECIMAL.sub("N.N", text))


def output_matches(want: str, got: str) -> bool:
    """``got`` is what ``want`` shows, up to its ``...`` (anything, as in doctest), decimal
    numbers and tier names."""
    return doctest.OutputChecker().check_output(_normalized(want), _normalized(got),
                                                doctest.ELLIPSIS)


def test_output_matching() -> None:
    want = "g1: default (worker) | served default at 14.7 s...\nfinal: True\n1 1\n"
    assert output_matches(want, "g1: max-autotune (worker) | served default at 3.1 s -> "
                                "max-autotune at 9.0 s\nfinal: True\n1 1\n")
    assert not output_matches(want, "g1: eager | pending default\nfinal: False\n1 1\n")
    assert not output_matches(want, "g1: default (worker) | served default at 3.1 s\n"
                                    "final: True\n2 1\n")


@pytest.mark.slow
@pytest.mark.timeout(900)  # the README's example waits for two tiers and the gate
@pytest.mark.parametrize("page", RUN_PAGES)
def test_code_blocks_run(page: str, tmp_path: Path) -> None:
    blocks = [b for b in ALL_BLOCKS if b.page == page and b.runs]
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps([{"source": b.source, "where": f"{b.page}:{b.line}"}
                                for b in blocks]))
    result = tmp_path / "results.json"
    # The artifact cache is this test's own (conftest); the workers are the child's own.
    proc = subprocess.run([sys.executable, "-c", _RUNNER, str(spec), str(result)],
                          cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True,
                          timeout=840)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(result.read_text())
    for block, ran in zip(blocks, results, strict=False):
        where = f"{block.page}:{block.line}"
        assert ran["error"] is None, f"{where} raised:\n{ran['error']}\nstderr:\n{proc.stderr[-3000:]}"
        if block.output is not None:
            assert output_matches(block.output, ran["stdout"]), (
                f"{where} printed:\n{ran['stdout']}\nthe page shows:\n{block.output}")
    assert len(results) == len(blocks)


def test_blocks_not_run_are_few_and_named() -> None:
    not_run: dict[str, int] = {}
    for block in ALL_BLOCKS:
        if not block.runs:
            not_run[block.page] = not_run.get(block.page, 0) + 1
            assert re.search(r'not run in the tests: \w.+"', block.info), block.info
    assert not_run == EXPECTED_NOT_RUN
    assert RUN_PAGES, "no page has a Python example that runs"


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("hotswap.compile", "hotswap.GraphStatus", "hotswap.counters_delta",
                 "hotswap.WaitTimeout"):
        assert name in api


def test_readme_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets
    for target in targets:
        if re.match(r"[a-z]+://", target):
            continue
        path = (ROOT / target.split("#")[0]).resolve()
        assert path.exists(), f"README links to {target}, which does not exist"


def _subcommands(*, hidden: bool) -> dict[str, set[str]]:
    """Each command's long flags (``hidden``: also those its --help leaves out)."""
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: {o for a in p._actions for o in a.option_strings
                   if o.startswith("--") and (hidden or a.help != argparse.SUPPRESS)} - {"--help"}
            for name, p in sub.choices.items()}


def _cli_mentions(text: str) -> dict[str, set[str]]:
    """``hotswap CMD ... --flag ...`` lines (continuation lines count for the command above)."""
    found: dict[str, set[str]] = {}
    command = None
    for line in text.splitlines():
        m = re.match(r"^\W*hotswap ([a-z-]+)", line)
        if m and not m[1].startswith("-"):
            command = m[1]
        elif not line.startswith(" "):
            command = None
        if command is not None:
            found.setdefault(command, set()).update(re.findall(r"--[a-z][a-z-]*", line))
    return found


def test_cli_docs_name_real_commands_and_flags() -> None:
    real = _subcommands(hidden=True)
    shown = _subcommands(hidden=False)
    cli_md = (ROOT / "docs" / "cli.md").read_text()
    block = cli_md.split("```\n", 2)[1]
    for page, text in (("README.md", (ROOT / "README.md").read_text()), ("docs/cli.md", block)):
        mentions = _cli_mentions(text)
        assert set(mentions) == set(real), page
        for command, flags in mentions.items():
            assert flags <= real[command], f"{page}: hotswap {command} has no {flags - real[command]}"
    for command, flags in _cli_mentions(block).items():
        assert flags >= shown[command], f"docs/cli.md misses hotswap {command} {shown[command] - flags}"
