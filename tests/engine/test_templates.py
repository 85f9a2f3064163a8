"""Inductor's kernel templates, compiled once: a later process takes the code from the cache,
renders the same text, and never runs a file someone else could have written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest

from hotswap.engine.loading import templates

SOURCE = """{% for name in names %}def {{name}}(x):
    return x {{op}} {{loop.index}}
{% endfor %}{{ body | indent_except_first(1) }}"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOTSWAP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HOTSWAP_PYCACHE", raising=False)
    return tmp_path / "cache"


def _env() -> tuple[jinja2.Environment, list[str]]:
    """An environment as inductor makes it, with the cached compile; the sources its own
    compile was asked for."""
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.filters["indent_except_first"] = lambda text, n: text.replace("\n", "\n" + "    " * n)
    asked: list[str] = []
    own = env.compile

    def counted(source: Any, *args: Any) -> Any:
        asked.append(source)
        return own(source, *args)

    folder, key = templates.folder(), templates._settings_key(env)
    assert folder is not None and key is not None
    env.compile = templates._CachedCompile(counted, folder, key)  # type: ignore[method-assign]
    return env, asked


def _render(env: jinja2.Environment) -> str:
    return env.from_string(SOURCE).render(names=["f", "g"], op="+", body="a\nb")


def test_a_template_compiled_once_is_read_back_and_renders_the_same(cache: Path) -> None:
    plain = jinja2.Environment(undefined=jinja2.StrictUndefined)
    plain.filters["indent_except_first"] = lambda text, n: text.replace("\n", "\n" + "    " * n)
    first, asked_first = _env()
    again, asked_again = _env()  # another process's environment, the same folder
    assert _render(first) == _render(again) == _render(plain)
    assert asked_first == [SOURCE] and asked_again == []
    assert len(list(templates.folder().glob("*.code"))) == 1  # type: ignore[union-attr]
    # anything but a template's source alone is Jinja2's own business
    first.compile(SOURCE, name="named")
    assert asked_first == [SOURCE, SOURCE]


def test_settings_change_the_key_and_user_functions_keep_it_out(cache: Path) -> None:
    base = jinja2.Environment(undefined=jinja2.StrictUndefined)
    trimmed = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True)
    assert templates._settings_key(base) != templates._settings_key(trimmed)
    assert templates._settings_key(jinja2.Environment(finalize=str)) is None
    assert templates._settings_key(jinja2.Environment(autoescape=lambda name: True)) is None


def _plant(path: Path, code: str) -> None:
    import marshal

    path.write_bytes(marshal.dumps(compile(code, "<template>", "exec")))


@pytest.mark.parametrize("problem", [
    "world-writable", "group-writable",
    pytest.param("another uid's", marks=pytest.mark.skipif(
        os.geteuid() != 0, reason="giving a file to another uid needs root"))])
def test_a_file_someone_else_could_have_written_is_not_run(cache: Path, problem: str) -> None:
    env, _ = _env()
    _render(env)  # writes the entry
    [entry] = list(templates.folder().glob("*.code"))  # type: ignore[union-attr]
    _plant(entry, "raise SystemExit('planted code ran')")
    if problem == "another uid's":
        os.chown(entry, 65534, 65534)
    else:
        os.chmod(entry, 0o602 if problem == "world-writable" else 0o620)
    again, asked_again = _env()
    assert _render(again) == _render(env)  # compiled again, the planted code not run
    assert asked_again == [SOURCE]


def test_a_file_cut_short_is_compiled_again_and_written_over(cache: Path) -> None:
    env, _ = _env()
    _render(env)
    [entry] = list(templates.folder().glob("*.code"))  # type: ignore[union-attr]
    entry.write_bytes(entry.read_bytes()[:20])
    again, asked = _env()
    assert _render(again) == _render(env) and asked == [SOURCE]
    third, asked_third = _env()
    _render(third)
    assert asked_third == []


def test_a_cache_folder_others_may_write_is_not_used(cache: Path) -> None:
    assert templates.folder() is not None
    os.chmod(cache, 0o777)
    assert templates.folder() is None


_INDUCTOR = r"""
import sys, json
import torch, torch._dynamo
from hotswap.engine.loading import templates
installed = templates.install()
import torch._inductor.compile_fx
from torch._inductor.codegen.common import jinja2_env
from torch._inductor.select_algorithm import TritonTemplate
cached = jinja2_env().compile
print(json.dumps({"installed": installed, "templates": len(TritonTemplate.all_templates),
                  "read": cached.read, "compiled": cached.compiled}))
"""


def test_inductors_kernel_templates_are_written_by_one_process_and_read_by_the_next(
        cache: Path) -> None:
    import json

    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _INDUCTOR], env=dict(os.environ),
                              capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        runs[-1]["files"] = sorted(p.name for p in templates.folder().glob("*.code"))  # type: ignore[union-attr]
    first, second = runs
    assert first["installed"] and first["templates"] > 10
    # one file per distinct source (a source two templates share is read back the second time)
    assert first["compiled"] == len(first["files"]) > 10
    # the next process reads every one of them, compiles none, writes nothing new
    assert second["read"] == first["read"] + first["compiled"] and second["compiled"] == 0
    assert second["files"] == first["files"] and second["templates"] == first["templates"]


def test_off_leaves_inductors_templates_alone(cache: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSWAP_PYCACHE", "off")
    assert templates.folder() is None
