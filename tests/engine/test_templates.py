"""Inductor's kernel templates, compiled once: a later process takes the code from the cache,
renders the same text, and never runs a file someone else could have written or that is not
what was written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import pytest

from hotswap.engine.loading import templates
from hotswap.system import bytecode

SOURCE = """{% for name in names %}def {{name}}(x):
    return x {{op}} {{loop.index}}
{% endfor %}{{ body | indent_except_first(1) }}"""


def _indent(text: str, n: int) -> str:
    return text.replace("\n", "\n" + "    " * n)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOTSWAP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HOTSWAP_PYCACHE", raising=False)
    where = templates.folder()
    assert where is not None
    monkeypatch.setattr(templates, "_folder", where)
    return where


def _env(**settings: Any) -> jinja2.Environment:
    """An environment as inductor makes it (a process's own), with the cached compile."""
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, **settings)
    env.filters["indent_except_first"] = _indent
    env.__class__ = templates._caching_class()
    return env


def _render(env: jinja2.Environment, source: str = SOURCE) -> str:
    return env.from_string(source).render(names=["f", "g"], op="+", body="a\nb")


def _compiled(fn: Callable[[], Any], counts: tuple[str, ...] = ("read", "compiled")
              ) -> tuple[Any, dict[str, int]]:
    """What ``fn`` returned, and how many templates it read and compiled (``counts``)."""
    before = templates.counts()
    out = fn()
    return out, {k: templates.counts()[k] - before[k] for k in counts}


def test_a_template_compiled_once_is_read_back_and_renders_the_same(cache: Path) -> None:
    plain = jinja2.Environment(undefined=jinja2.StrictUndefined)
    plain.filters["indent_except_first"] = _indent
    first, did = _compiled(lambda: _render(_env()))
    again, did_again = _compiled(lambda: _render(_env()))  # another process's environment
    assert first == again == _render(plain)
    assert did == {"read": 0, "compiled": 1} and did_again == {"read": 1, "compiled": 0}
    assert len(list(cache.glob("*.code"))) == 1
    # anything but a template's source alone is Jinja2's own business
    _, named = _compiled(lambda: _env().compile(SOURCE, name="named"))
    assert named == {"read": 0, "compiled": 0}


def test_what_the_code_generation_reads_is_in_the_key(cache: Path) -> None:
    base = templates._key(_env())
    assert base is not None
    assert templates._key(_env(trim_blocks=True)) != base
    lenient = jinja2.Environment()  # Undefined: "abc".nope folds to "" while compiling
    lenient.filters["indent_except_first"] = _indent
    assert templates._key(lenient) != base
    other_filter = _env()
    other_filter.filters["indent_except_first"] = lambda text, n: text  # a new torch's
    assert templates._key(other_filter) != base
    assert templates._key(jinja2.Environment(finalize=str)) is None
    assert templates._key(jinja2.Environment(autoescape=lambda name: True)) is None
    assert templates._key(jinja2.Environment(extensions=["jinja2.ext.do"])) is None


def test_an_undefined_attribute_raises_as_plain_jinja2_would_after_a_lenient_process(
        cache: Path) -> None:
    lenient = jinja2.Environment()
    lenient.__class__ = templates._caching_class()
    assert lenient.from_string('{{ "abc".nope }}x').render() == "x"
    with pytest.raises(jinja2.UndefinedError):
        _env().from_string('{{ "abc".nope }}x').render()


def test_an_overlay_compiles_with_its_own_settings(cache: Path) -> None:
    overlay = _env().overlay(trim_blocks=True)
    plain = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True)
    source = "{% if true %}\nA{% endif %}"
    assert overlay.from_string(source).render() == plain.from_string(source).render() == "A"


def _plant(path: Path, code: str) -> None:
    """A file in the folder's own format, holding ``code``."""
    import hashlib
    import marshal

    payload = marshal.dumps(compile(code, "<template>", "exec"))
    path.write_bytes(templates._FORMAT + hashlib.sha256(payload).digest() + payload)


@pytest.mark.parametrize("problem", [
    "world-writable", "group-writable",
    pytest.param("another uid's", marks=pytest.mark.skipif(
        os.geteuid() != 0, reason="giving a file to another uid needs root"))])
def test_a_file_someone_else_could_have_written_is_not_run(cache: Path, problem: str) -> None:
    expected = _render(_env())  # writes the entry
    [entry] = list(cache.glob("*.code"))
    _plant(entry, "raise SystemExit('planted code ran')")
    if problem == "another uid's":
        os.chown(entry, 65534, 65534)
    else:
        os.chmod(entry, 0o602 if problem == "world-writable" else 0o620)
    again, did = _compiled(lambda: _render(_env()))
    assert again == expected and did == {"read": 0, "compiled": 1}  # planted code not run


@pytest.mark.parametrize("damage", ["cut short", "a byte changed", "the tag changed"])
def test_a_file_that_is_not_what_was_written_is_compiled_again_and_written_over(
        cache: Path, damage: str) -> None:
    expected = _render(_env())
    [entry] = list(cache.glob("*.code"))
    data = bytearray(entry.read_bytes())
    if damage == "cut short":
        data = data[:-20]
    elif damage == "a byte changed":
        data[-30] ^= 0x01  # marshal would still load most such (a code object, altered)
    else:
        data[:len(templates._FORMAT)] = b"hotswap-template-0\n"
    entry.write_bytes(bytes(data))
    again, did = _compiled(lambda: _render(_env()))
    assert again == expected and did == {"read": 0, "compiled": 1}
    third, did_third = _compiled(lambda: _render(_env()))
    assert third == expected and did_third == {"read": 1, "compiled": 0}


def test_a_cache_folder_others_may_write_is_not_used(cache: Path) -> None:
    os.chmod(cache.parent, 0o777)
    assert templates.folder() is None


def test_off_leaves_inductors_templates_alone(cache: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSWAP_PYCACHE", "off")
    assert templates.folder() is None


@pytest.fixture
def offered(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The compile service's template folder, filled by its workers: another cache's."""
    monkeypatch.setattr(bytecode, "_offered_templates", [])
    monkeypatch.setattr(templates, "_trusted", {})
    monkeypatch.setenv("HOTSWAP_CACHE_DIR", str(tmp_path / "service-cache"))
    service = templates.folder()
    assert service is not None and service != cache
    monkeypatch.setattr(templates, "_folder", service)
    _render(_env())  # a worker's compile writes it there
    monkeypatch.setattr(templates, "_folder", cache)
    assert list(cache.glob("*.code")) == []
    return service


def test_what_the_folder_lacks_is_read_from_the_compile_services_and_kept(
        cache: Path, offered: Path) -> None:
    expected = _render(_env())  # the service not named yet: compiled here
    for entry in cache.glob("*.code"):
        entry.unlink()
    bytecode.offer_templates(offered)
    counts = ("read", "offered", "compiled")
    again, did = _compiled(lambda: _render(_env()), counts)
    assert again == expected and did == {"read": 1, "offered": 1, "compiled": 0}
    assert [p.name for p in cache.glob("*.code")] == [p.name for p in offered.glob("*.code")]
    _, did = _compiled(lambda: _render(_env()), counts)  # now from this process's own folder
    assert did == {"read": 1, "offered": 0, "compiled": 0}


def test_a_compile_services_folder_made_after_it_was_offered_is_read_once_there(
        cache: Path, offered: Path) -> None:
    """The service names its folder before its workers have made it: not there yet is no
    verdict on it."""
    moved = offered.with_name(offered.name + "-later")
    offered.rename(moved)
    bytecode.offer_templates(offered)
    counts = ("read", "offered", "compiled")
    _, did = _compiled(lambda: _env().compile(SOURCE), counts)  # compiled here: nothing there
    assert did == {"read": 0, "offered": 0, "compiled": 1}
    for entry in cache.glob("*.code"):
        entry.unlink()
    moved.rename(offered)  # its workers made it meanwhile
    _, did = _compiled(lambda: _env().compile(SOURCE), counts)
    assert did == {"read": 1, "offered": 1, "compiled": 0}


@pytest.mark.parametrize("problem", ["folder others may write", "planted file"])
def test_a_compile_services_folder_or_file_someone_else_could_have_written_is_not_run(
        cache: Path, offered: Path, problem: str) -> None:
    [entry] = list(offered.glob("*.code"))
    _plant(entry, "raise SystemExit('planted code ran')")
    if problem == "folder others may write":
        os.chmod(offered, 0o777)
    else:
        os.chmod(entry, 0o602)
    bytecode.offer_templates(offered)
    out, did = _compiled(lambda: _render(_env()), ("read", "offered", "compiled"))
    assert did == {"read": 0, "offered": 0, "compiled": 1}  # planted code not run
    assert out == _render(_plain())


def _plain() -> jinja2.Environment:
    plain = jinja2.Environment(undefined=jinja2.StrictUndefined)
    plain.filters["indent_except_first"] = _indent
    return plain


_INDUCTOR = r"""
import json
import torch, torch._dynamo
from hotswap.engine.loading import templates
from hotswap.system import bytecode
installed = templates.install()
import torch._inductor.compile_fx
from torch._inductor.select_algorithm import TritonTemplate
print(json.dumps({"installed": installed, "again": templates.install(),
                  "templates": len(TritonTemplate.all_templates), **templates.counts()}))
"""


def test_inductors_kernel_templates_are_written_by_one_process_and_read_by_the_next(
        cache: Path) -> None:
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _INDUCTOR], env=dict(os.environ),
                              capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        runs[-1]["files"] = sorted(p.name for p in cache.glob("*.code"))
    first, second = runs
    assert first["installed"] and first["again"] and first["templates"] > 10
    # one file per distinct source (a source two templates share is read back the second time)
    assert first["compiled"] == len(first["files"]) > 10
    # the next process reads every one of them, compiles none, writes nothing new
    assert second["read"] == first["read"] + first["compiled"] and second["compiled"] == 0
    assert second["files"] == first["files"] and second["templates"] == first["templates"]
