"""An artifact's generated modules travel as bytecode (precompiled.py): the serving process
runs the worker's compile of a large generated module instead of compiling its source."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hotswap.engine.loading import precompiled

SOURCE = "def f(x):\n    return [x * i for i in range(3)]\n" + "# padding\n" * 4000


def test_what_a_worker_compiled_is_run_where_the_same_source_loads() -> None:
    assert len(SOURCE) >= precompiled.MIN_BYTES
    with precompiled.recording() as found:
        worker_code = precompiled._compile(SOURCE, "/worker/cache/ab/mod.py", "exec",
                                           dont_inherit=True)
    assert list(found) == [precompiled._digest(SOURCE)]
    probes = precompiled.record(found)
    calls: list[Any] = []
    real = precompiled.builtins.compile

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1])
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(precompiled.builtins, "compile", counted)
        with precompiled.adopted(probes) as held:
            assert held == 1
            code = precompiled._compile(SOURCE, "/serving/cache/ab/mod.py", "exec",
                                        dont_inherit=True)
        assert calls == []  # not compiled here
        namespace: dict[str, Any] = {}
        exec(code, namespace)
        assert namespace["f"](2) == [0, 2, 4]
        assert code.co_filename == "/serving/cache/ab/mod.py"  # tracebacks name this file
        assert namespace["f"].__code__.co_filename == "/serving/cache/ab/mod.py"
        assert code.co_code == worker_code.co_code
        # used once: the same source again, or another one, is compiled here
        precompiled._compile(SOURCE, "/serving/again.py", "exec", dont_inherit=True)
        assert calls == ["/serving/again.py"]


def test_another_pythons_bytecode_or_a_leftover_is_not_used() -> None:
    with precompiled.recording() as found:
        precompiled._compile(SOURCE, "m.py", "exec", dont_inherit=True)
    magic, codes = precompiled.record(found)["code"]
    with precompiled.adopted({"code": ["00000000", codes]}) as held:
        assert held == 0
    for bad in ({}, {"code": "x"}, {"code": [magic]}, {"code": [magic, {"k": "not bytes"}]}):
        with precompiled.adopted(bad) as held:
            assert held == 0
    with precompiled.adopted({"code": [magic, codes]}) as held:
        assert held == 1
    assert precompiled._codes == {}  # what the load did not use is dropped after it
    small = "x = 1\n"
    assert precompiled.record({}) == {}
    with precompiled.recording() as found:
        precompiled._compile(small, "s.py", "exec")
    assert found == {}  # small sources compile in milliseconds: they do not travel


_FRESH = r"""
import json, os, sys
import torch
import hotswap

from hotswap.engine.loading import precompiled
used = []  # generated modules run from the worker's bytecode (the positive control)
real = precompiled._retarget
def counted(code, filename):
    used.append(filename)
    return real(code, filename)
precompiled._retarget = counted

compiled = []
def hook(event, args):
    if event == "compile" and isinstance(args[0], (str, bytes)) and str(args[1]).endswith(".py"):
        compiled.append([len(args[0]), str(args[1])])
sys.addaudithook(hook)
layers = []
for _ in range(24):  # a generated module of about 40 KB
    layers += [torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.GELU()]
model = torch.nn.Sequential(*layers)
fast = hotswap.compile(model, mode="async", workers=1)
x = torch.randn(8, 64)
with torch.no_grad():
    fast(x)
    [status] = hotswap.wait(fast, timeout_s=300)
    torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
print(json.dumps({"tier": status.tier, "compiled": compiled, "used": len(used)}))
"""


@pytest.mark.parametrize("warm", [False, True], ids=["from the worker", "from the cache"])
def test_the_serving_process_compiles_no_large_generated_module(tmp_path: Path,
                                                                warm: bool) -> None:
    env = {**os.environ, "HOTSWAP_CACHE_DIR": str(tmp_path / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "HOTSWAP_SERVICE": "off"}
    runs = 2 if warm else 1
    for _ in range(runs):  # the second run loads the entry the first one stored
        done = subprocess.run([sys.executable, "-c", _FRESH], env=env, capture_output=True,
                              text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["tier"] == "default"
        # generated modules live in the caches under tmp_path; hotswap's own sources, which
        # Python compiles where it keeps no bytecode beside them, are not generated
        large = [c for c in result["compiled"]
                 if c[0] >= precompiled.MIN_BYTES and c[1].startswith(str(tmp_path))]
        assert large == [], large
        assert result["used"] >= 1  # the wrapper ran from the entry's bytecode
