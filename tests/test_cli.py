from __future__ import annotations

from pathlib import Path

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
    assert "torch intra-op threads:" in out


def test_thread_advice_only_when_a_cpu_model_fills_every_core() -> None:
    from hotswap.cli import thread_advice

    advice = thread_advice(cores=2, threads=2, cuda=False)
    assert advice is not None and "torch.set_num_threads(1)" in advice
    assert thread_advice(cores=8, threads=16, cuda=False) is not None
    assert thread_advice(cores=2, threads=1, cuda=False) is None  # a core left free
    assert thread_advice(cores=1, threads=1, cuda=False) is None  # nothing to leave free
    assert thread_advice(cores=16, threads=16, cuda=True) is None  # the GPU does the work


def test_unknown_command_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def test_cache_commands_on_a_populated_cache(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from hotswap.cache import ArtifactCache

    cache = ArtifactCache(tmp_path, stamp={"torch": "2.13.0", "gpus": []})  # a real build's stamp
    cache.put("aa" + "0" * 62, b"x" * 2048, tier="default")
    cache.put("bb" + "0" * 62, b"y" * 1024, tier="max-autotune")
    assert main(["cache", "ls", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "max-autotune" in out and "default" in out and "2 entries" in out
    assert main(["cache", "stats", "--cache-dir", str(tmp_path)]) == 0
    assert "entries: 2" in capsys.readouterr().out
    path = cache._path("bb" + "0" * 62)
    path.write_bytes(path.read_bytes()[:-1] + b"!")
    assert main(["cache", "verify", "--cache-dir", str(tmp_path)]) == 1
    assert "1 entries verified, 1 removed" in capsys.readouterr().out
    assert main(["cache", "clear", "--cache-dir", str(tmp_path)]) == 0
    assert "removed 1 entries" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["doctor", "--workers", "0"], ["doctor", "--workers", "two"]])
def test_bad_numbers_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "--workers: must be a whole number >= 1" in capsys.readouterr().err


def test_a_cache_dir_that_is_a_file_is_a_usage_error_with_a_message(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("mine")
    assert main(["cache", "ls", "--cache-dir", str(a_file)]) == 2
    err = capsys.readouterr().err
    assert "is not a directory" in err and "Traceback" not in err
    assert a_file.read_text() == "mine"  # untouched
