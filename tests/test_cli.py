from __future__ import annotations

import pytest

from hotswap.cli import main


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("hotswap ")


def test_doctor_starts_a_worker(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "1 workers started" in out


def test_unknown_command_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
