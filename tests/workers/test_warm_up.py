from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hotswap.jobs import compile as compile_job


def test_the_op_family_graphs_compile_and_match_eager() -> None:
    graphs = compile_job.compile_op_families("cpu", torch.float32)
    assert len(graphs) == 2
    with torch.no_grad():
        for compiled, module, example in graphs:
            torch.testing.assert_close(compiled(example), module(example), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's path")
def test_a_worker_without_a_gpu_compiles_no_op_families(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> None:
        raise AssertionError("warm_ops compiled on a machine without a GPU")

    monkeypatch.setattr(compile_job, "compile_op_families", refuse)
    compile_job.warm_ops()


def test_a_warm_up_compile_gets_past_a_library_a_killed_link_left_cut_short(
        tmp_path: Path) -> None:
    """Inductor links a kernel library in place: a worker killed while linking its warm-up
    compile's leaves it cut short, and inductor's caches serve it to every later compile. The
    next warm-up removes it and compiles again (else no worker on the machine is ever warm)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    code = "from hotswap.jobs.compile import warm_compile; warm_compile()"

    def warm_up() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=600, check=False)

    first = warm_up()
    assert first.returncode == 0, first.stderr[-3000:]
    [library] = list((tmp_path / "inductor").rglob("*.main.so"))  # the kernel's
    whole = library.stat().st_size
    library.write_bytes(library.read_bytes()[:64])  # as a killed link leaves it
    second = warm_up()
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"removed a damaged kernel library from inductor's cache, compiling again: " \
        f"{library}" in second.stderr
    assert library.stat().st_size == whole  # built again, whole


_COMPILE_TINY = r"""
import torch
from torch._inductor import config
config.fx_graph_cache = False
torch.compile(lambda x: (x * 2 + 1).relu())(torch.randn(64))
"""


def _headers(tmp: Path) -> dict[str, bytes]:
    """The precompiled headers under ``tmp`` that gcc finished, name -> the first bytes."""
    found = {}
    for path in tmp.glob("torchinductor_*/precompiled_headers/*.gch"):
        with open(path, "rb") as f:
            found[path.name] = f.read(8)
    return {name: head for name, head in found.items() if head.startswith(b"gpch")}


_PREPARE = r"""
import threading
from hotswap.jobs import compile as compile_job
compile_job._start_cpp_header()
for thread in threading.enumerate():  # the thread's whole work
    if thread.name == "hotswap-cpp-header":
        thread.join()
"""

_HOTSWAP_TINY = r"""
import torch, hotswap
m = hotswap.compile(lambda x: (x * 3 - 1).relu(), mode="async", workers=1)
m(torch.randn(64))
[s] = hotswap.wait(m, timeout_s=600)
assert s.tier == "default", s
"""


def _run(code: str, env: dict[str, str]) -> None:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU machine's compile")
def test_a_cpu_job_prepares_the_header_inductor_s_kernels_use_and_mends_a_cut_short_one(
        tmp_path: Path) -> None:
    """Inductor builds its precompiled header for CPU kernels before a process's first kernel
    (16.5 s of a corpus GPT-2 job on the busy 2-core box, every kernel waiting). A CPU graph's
    job prepares it beside its lowering: the very header a compile then uses. One a killed
    build left (gcc's mark missing), which inductor would take as built for good, the next
    CPU job builds again."""
    from torch._inductor import config

    if not getattr(config, "cpp_cache_precompile_headers", False):
        pytest.skip("this torch builds no precompiled header for its CPU kernels")
    # Inductor keeps its headers under the temporary directory, whatever its cache dir says.
    env = {"TMPDIR": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "a")}
    _run(_PREPARE, env)
    built = _headers(tmp_path)
    assert built
    # A compile in another process (its own inductor cache) builds no other header.
    _run(_COMPILE_TINY, {**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "b")})
    assert _headers(tmp_path) == built
    [header] = tmp_path.glob("torchinductor_*/precompiled_headers/*.gch")
    with open(header, "r+b") as f:  # as a build killed halfway leaves it
        f.write(b"gpcWrite")
        f.truncate(16384)
    _run(_HOTSWAP_TINY, {**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "c"),
                         "HOTSWAP_CACHE_DIR": str(tmp_path / "hs")})
    assert _headers(tmp_path) == built


def test_what_a_worker_does_beside_a_job_is_not_the_job_s(tmp_path: Path) -> None:
    """A thread a job starts for work that outlives it (the precompiled header) runs beside
    the worker's jobs: its inductor events are no job's stages, and the sources it writes
    ship in no job's entry."""
    import threading

    from torch._dynamo.utils import dynamo_timed
    from torch._inductor import codecache

    from hotswap import compat
    from hotswap.engine.loading.load_guard import cpp_sources
    from hotswap.workers import child

    def step() -> None:
        child.beside_jobs()
        with dynamo_timed("a_background_step"):
            time.sleep(0.01)
        codecache.write("// the step's", "cpp", specified_dir=str(tmp_path))

    with compat.inductor_events() as events, cpp_sources() as sources:
        thread = threading.Thread(target=step)
        thread.start()
        thread.join()
        with dynamo_timed("the_job_s"):
            time.sleep(0.01)
        _, job_source = codecache.write("// the job's", "cpp", specified_dir=str(tmp_path))
    assert [name for name, _, _ in events if name in ("a_background_step", "the_job_s")] == [
        "the_job_s"]
    assert sources == [job_source]


def test_a_profiled_run_s_tiers_get_the_header_prepared_and_a_flag_changing_tier_does_not(
        ) -> None:
    """A tier patching inductor's C++ command line (its flags, ISA, compiler) must not have the
    default's header built under its patch; a profiled run's tiers patch the kernels' source
    alone (kernel names for profilers), and prepare it as an unprofiled run's do."""
    from hotswap.engine.options import DEFAULT_LADDER, parse_tiers
    from hotswap.engine.recording import profiled

    for tier in parse_tiers(DEFAULT_LADDER):
        assert any(key.startswith("cpp") for key in profiled(tier).config)
        assert compile_job.patches_cpp_command_line(profiled(tier).config) is False
    assert compile_job.patches_cpp_command_line({"cpp.simdlen": 1}) is True
    assert compile_job.patches_cpp_command_line({"aot_inductor.debug_compile": True}) is True
    assert compile_job.patches_cpp_command_line({"max_autotune": True}) is False
