"""Hypothesis profiles for the fuzz tests.

``ci`` (the default): a fixed, modest budget, derandomized, so that every run tries the same
cases and the folder stays fast. ``long``: ``HOTSWAP_FUZZ_EXAMPLES`` examples per test (default
2000) from a random seed, for ``scripts/fuzz``. ``HOTSWAP_FUZZ_PROFILE`` picks one.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from tests.fuzz.cases import CASES

_QUIET = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much,
          HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=60, derandomize=True, deadline=None,
                          database=None, suppress_health_check=_QUIET, print_blob=True)
settings.register_profile("long", max_examples=int(os.environ.get("HOTSWAP_FUZZ_EXAMPLES", "2000")),
                          deadline=None, database=None, suppress_health_check=_QUIET,
                          print_blob=True)
settings.load_profile(os.environ.get("HOTSWAP_FUZZ_PROFILE", "ci"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not CASES:
        return
    terminalreporter.section("fuzz cases")
    for target, n in sorted(CASES.items()):
        terminalreporter.write_line(f"{target:<28} {n}")
    terminalreporter.write_line(f"{'total':<28} {sum(CASES.values())}")
