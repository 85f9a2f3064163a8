"""The serving process loads artifacts without building anything, and no kill poisons it.

The end-to-end cases run in fresh processes: the test process has probed and compiled in
earlier tests, which would hide a probe or a compile the load itself starts.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import msgpack
import pytest

from hotswap.engine.loading import load_guard
from hotswap.engine.loading.artifacts import _unpack, pack_entry

# Serve a zoo model in this (fresh) process until its tier lands; print what happened.
_SERVE = r"""
import json, sys, threading, time
import psutil, torch, hotswap
from hotswap.tools import zoo

def storm(seconds):
    # Kill every process this one started (workers, their compilers), again and again.
    me, end, kills = psutil.Process(), time.monotonic() + seconds, 0
    while time.monotonic() < end:
        for child in me.children(recursive=True):
            try:
                child.kill(); kills += 1
            except psutil.Error:
                pass
        time.sleep(0.02)
    return kills

storm_s, device, tiers, model = float(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
mode = "progressive" if len(tiers) > 1 else "async"
dtype = "bfloat16" if device == "cuda" else "float32"
kills = 0
if storm_s:
    early = zoo.make("convnet", device=device, dtype=dtype)
    first = hotswap.compile(early.target, mode="async", tiers=["default"], workers=1)
    with torch.no_grad():
        early.step(first, 0)  # its graph ships while the workers start and die
    kills = storm(storm_s)
w = zoo.make(model, device=device, dtype=dtype)
m = hotswap.compile(w.target, mode=mode, tiers=tiers, workers=1, gate=False)
with hotswap.counters_delta() as d, torch.no_grad():
    w.step(m, 0)
    statuses = hotswap.wait(m, timeout_s=240)
    err = w.error(w.step(m, 1), 1)
print(json.dumps({"tiers": [s.tier for s in statuses], "paths": [s.path for s in statuses],
                  "failures": [f for s in statuses for f in s.failures],
                  "delta": dict(d), "err": err, "tol": w.tolerance, "kills": kills}))
"""


def serve_fresh(tmp_path: Path, inductor_dir: str, storm_s: float = 0.0,
                device: str = "cpu", tiers: tuple[Any, ...] = ("default",),
                model: str = "mlp") -> dict[str, Any]:
    """Serve a zoo MLP in a fresh process on ``tmp_path``'s artifact cache and the inductor
    cache ``inductor_dir`` (after a kill storm of ``storm_s``); what happened, as a dict."""
    env = {**os.environ, "HOTSWAP_CACHE_DIR": str(tmp_path / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / inductor_dir),
           "TRITON_CACHE_DIR": str(tmp_path / inductor_dir / "triton")}
    done = subprocess.run([sys.executable, "-c", _SERVE, str(storm_s), device,
                           json.dumps(list(tiers)), model], env=env,
                          capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def check_fresh_loads_run_no_compiler(tmp_path: Path, device: str) -> None:
    cold = serve_fresh(tmp_path, "inductor-cold", device=device)
    assert cold["paths"] == ["worker"] and cold["tiers"] == ["default"], cold
    assert cold["delta"]["worker_compiles"] == 1
    assert cold["delta"]["load_compiler_runs"] == 0
    assert cold["err"] <= cold["tol"]
    # A warm replica: the same artifact cache, an inductor cache without the kernels.
    warm = serve_fresh(tmp_path, "inductor-warm", device=device)
    assert warm["paths"] == ["cache"] and warm["tiers"] == ["default"], warm
    assert warm["delta"]["cache_hits"] == 1
    assert warm["delta"]["worker_compiles"] == 0 and warm["delta"]["inprocess_compiles"] == 0
    assert warm["delta"]["load_compiler_runs"] == 0
    assert warm["err"] <= warm["tol"]


def test_a_fresh_process_loads_cpu_artifacts_without_running_a_compiler(tmp_path: Path) -> None:
    check_fresh_loads_run_no_compiler(tmp_path, "cpu")


def test_a_tier_sharing_kernels_with_the_one_before_ships_them_too(tmp_path: Path) -> None:
    # One worker compiles both tiers; ResNet's max-autotune tier finds most of its C++
    # kernels built by the default one. Its entry must still carry them, or a replica builds
    # them at load (it built ten).
    tiers = ("default", "max-autotune-no-cudagraphs")
    cold = serve_fresh(tmp_path, "inductor-cold", tiers=tiers, model="corpus:resnet")
    assert cold["tiers"] == ["max-autotune-no-cudagraphs"], cold
    replica = serve_fresh(tmp_path, "inductor-replica", tiers=tiers, model="corpus:resnet")
    assert replica["paths"] == ["cache"] and replica["delta"]["worker_compiles"] == 0, replica
    assert replica["delta"]["load_compiler_runs"] == 0
    assert replica["err"] <= replica["tol"]


def test_a_kill_storm_during_warmup_leaves_later_graphs_compiling(tmp_path: Path) -> None:
    after = serve_fresh(tmp_path, "inductor", storm_s=4.0)
    assert after["kills"] > 0
    assert after["tiers"] == ["default"] and after["paths"] == ["worker"], after
    assert after["delta"]["load_compiler_runs"] == 0
    assert after["err"] <= after["tol"]


def test_an_entry_carries_the_probes_and_malformed_ones_are_refused() -> None:
    probes = {"vec_isa": [], "headers": [["h.h", "g++ -O3", "/nowhere/x.h"]]}
    _, _, found, _ = _unpack(pack_entry(b"artifact", {"a.so": b"1"}, probes))
    assert found == probes
    assert _unpack(pack_entry(b"artifact", {}))[2] == {}
    with pytest.raises(ValueError, match="vec_isa"):
        load_guard.adopt({"vec_isa": "avx512"})
    with pytest.raises(ValueError, match="headers"):
        load_guard.adopt({"headers": [["only", "two"]]})
    with pytest.raises(ValueError, match="not a vector ISA record"):
        load_guard.adopt({"vec_isa": [{"name": "avx2"}]})
    with pytest.raises(ValueError, match="no vector ISA"):
        load_guard.adopt({"vec_isa": [{"name": "avx9000", "bits": 1024, "flags": "-mavx9000",
                                       "features": {}}]})


class _RunsWhenUnpickled:
    ran: ClassVar[list[str]] = []

    def __reduce__(self) -> tuple[Any, ...]:
        return (_RunsWhenUnpickled.ran.append, ("unpickled",))


def test_probes_travel_as_plain_values_and_a_pickle_among_them_is_never_loaded() -> None:
    from torch._inductor import cpu_vec_isa

    load_guard.probe_vec_isa()
    found = load_guard.probes()
    assert msgpack.unpackb(msgpack.packb(found), raw=False) == found  # no bytes, no pickle
    answer = load_guard._answer
    probed = [(str(i), i.build_arch_flags()) for i in answer.known()] if answer else []
    assert [(r["name"], r["flags"]) for r in found.get("vec_isa", [])] == probed
    mine = [(str(i), i.build_arch_flags()) for i in cpu_vec_isa.valid_vec_isa_list()]
    assert mine[:len(probed)] == probed  # read on, the probe goes on
    before = load_guard._answer
    load_guard.adopt(found)  # probed no further than this process is now: changes nothing
    assert load_guard._answer is before
    assert [(str(i), i.build_arch_flags()) for i in cpu_vec_isa.valid_vec_isa_list()] == mine
    # An entry of the old format carried the ISAs pickled: refused, never unpickled.
    with pytest.raises(ValueError, match="vec_isa"):
        load_guard.adopt({"vec_isa": pickle.dumps(_RunsWhenUnpickled())})
    assert _RunsWhenUnpickled.ran == []


def test_an_adopted_header_that_is_not_built_is_built_as_usual(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    from torch._inductor import codecache

    built: list[str] = []

    def real(header: str, cmd_line: str, **_: Any) -> str:
        built.append(header)
        return str(tmp_path / "built.h")

    monkeypatch.setattr(codecache, "_precompile_header", real)
    monkeypatch.setattr(load_guard, "_headers_hooked", False)
    monkeypatch.setattr(load_guard, "_headers", {})
    present, cut = tmp_path / "present.h", tmp_path / "cut.h"
    (tmp_path / "present.h.gch").write_bytes(b"gpch+014")
    (tmp_path / "cut.h.gch").write_bytes(b"gpcWrite")  # gcc's mark until it is done: killed
    load_guard.adopt({"headers": [["a.h", "cmd", str(present)],
                                  ["b.h", "cmd", str(tmp_path / "missing.h")],
                                  ["c.h", "cmd", str(cut)]]})
    assert codecache._precompile_header("a.h", "cmd") == str(present)  # no preprocessor run
    assert codecache._precompile_header("b.h", "cmd") == str(tmp_path / "built.h")
    assert codecache._precompile_header("c.h", "cmd") == str(tmp_path / "built.h")
    assert built == ["b.h", "c.h"]


def test_status_says_why_pending_tiers_wait_on_cpu(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    import torch

    import hotswap
    from hotswap import testing
    from hotswap.workers import WorkerPool

    note = "waiting on CPU: compile workers got 3% of a core for 2.0 s ..."
    monkeypatch.setattr(WorkerPool, "cpu_note", lambda self: note)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    compiled = hotswap.compile(model, mode="async", tiers=["default"], workers=1,
                               cache_dir=str(tmp_path))
    with testing.inject(testing.FaultPlan({"slow": 1.0}, slow_s=3.0)):
        compiled(torch.randn(4, 8))
    pool, deadline = hotswap.runtime().pool(1), time.monotonic() + 60
    while pool.priority_note() == "":  # its worker is spawned (the job goes from a thread)
        assert time.monotonic() < deadline
        time.sleep(0.02)
    [pending] = hotswap.status(compiled)
    assert pending.pending == ("default",) and pending.waiting == note
    # How the pool's workers yield the CPU: "cgroup v1 cpu.idle", "autogroup + SCHED_IDLE"...
    assert pending.worker_priority == hotswap.runtime().pool(1).priority_note() != ""
    [done] = hotswap.wait(compiled, timeout_s=240)
    assert done.final and done.waiting == ""  # only pending graphs wait


_CUT_SHORT = r"""
import json
import os
import time
from torch._inductor import cpu_vec_isa
from hotswap.engine.loading import load_guard

real, failed = cpu_vec_isa.VecISA.check_build, []

def killed_once(self, code):
    # The first build check of each ISA fails, as when its compiler is killed mid-build.
    if str(self) not in failed:
        failed.append(str(self))
        return False
    return real(self, code)

cpu_vec_isa.VecISA.check_build = killed_once
load_guard.probe_vec_isa(shared_dir=os.environ["PROBE_DIR"])  # no other worker's answer
promised = [str(i) for i in load_guard._promised(cpu_vec_isa)]
print(json.dumps({"found": [str(i) for i in cpu_vec_isa.valid_vec_isa_list()],
                  "promised": promised, "failed": failed}))
"""


def test_a_probe_cut_short_by_a_kill_is_run_again(tmp_path: Path) -> None:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "PROBE_DIR": str(tmp_path / "probes")}
    done = subprocess.run([sys.executable, "-c", _CUT_SHORT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["promised"]:
        pytest.skip("not an x86 machine: inductor's ISA list is not probed by CPU flags here")
    assert result["failed"]  # the first answers were "no"
    assert result["found"] == result["promised"]  # and the second probe found them all


_SHARED = r"""
import json
import sys
from torch._inductor import cpu_vec_isa
from hotswap.engine.loading import load_guard

real, builds = cpu_vec_isa.VecISA.check_build, []

def counted(self, code):
    builds.append(str(self))
    return real(self, code)

cpu_vec_isa.VecISA.check_build = counted
load_guard.probe_vec_isa(shared_dir=sys.argv[1])
picked = str(cpu_vec_isa.pick_vec_isa())
found = [str(i) for i in load_guard._answer.known()] if load_guard._answer else []
builds_for_pick = list(builds)
everything = [str(i) for i in cpu_vec_isa.valid_vec_isa_list()]  # reads on: probes on
print(json.dumps({"found": found, "builds": builds_for_pick, "picked": picked,
                  "promised": [str(i) for i in load_guard._promised(cpu_vec_isa)],
                  "everything": everything, "probes": load_guard.probes()}))
"""


def _probe_in_a_worker(shared: Path, inductor: Path) -> dict[str, Any]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    done = subprocess.run([sys.executable, "-c", _SHARED, str(shared)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_one_worker_probes_and_the_others_take_its_answer(tmp_path: Path) -> None:
    shared = tmp_path / "probes"
    first = _probe_in_a_worker(shared, tmp_path / "a")
    if not first["promised"]:
        pytest.skip("not an x86 machine: inductor's ISA list is not probed by CPU flags here")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o700
    assert len(list(shared.glob("vec_isa-*.msgpack"))) == 1
    # A later worker (its own inductor cache, so nothing cached there) builds nothing.
    second = _probe_in_a_worker(shared, tmp_path / "b")
    assert (second["found"], second["picked"], second["builds"]) == (
        first["found"], first["picked"], [])
    # A folder others may write is not trusted: that worker probes for itself.
    shared.chmod(0o777)
    again = _probe_in_a_worker(shared, tmp_path / "c")
    assert again["found"] == first["found"] and again["builds"]


def test_the_probe_goes_as_far_as_the_pick_reads(tmp_path: Path) -> None:
    # Inductor checks every ISA the CPU claims before its pick reads the first that passes
    # (10 compiler runs, 9.3 s on our 2-core box, where the pick needs 3).
    first = _probe_in_a_worker(tmp_path / "probes", tmp_path / "a")
    if not first["promised"]:
        pytest.skip("not an x86 machine: inductor's ISA list is not probed by CPU flags here")
    promised, found = first["promised"], first["found"]
    assert found and first["picked"] == found[0]
    stopped_at = promised.index(found[0])
    assert set(first["builds"]) == set(promised[:stopped_at + 1])  # none after the pick's
    # Read on (a tier with cpp.simdlen, len()): the rest is probed as inductor would, and an
    # entry made then carries the whole answer.
    assert first["everything"][0] == found[0] and len(first["everything"]) >= len(found)
    assert first["probes"]["vec_isa"][0]["name"] == found[0]
    assert "vec_isa_probed" not in first["probes"]
    # An answer made before that carried how far it went, and a reader of it goes on.
    if stopped_at + 1 < len(promised):
        second = _probe_in_a_worker(tmp_path / "probes", tmp_path / "b")
        assert second["builds"] == [] and second["everything"] == first["everything"]


def test_a_partial_answer_is_checked_and_never_replaces_a_fuller_one() -> None:
    from torch._inductor import cpu_vec_isa

    with pytest.raises(ValueError, match="vec_isa_probed"):
        load_guard.adopt({"vec_isa": [], "vec_isa_probed": "1"})
    with pytest.raises(ValueError, match="vec_isa_probed"):
        load_guard.adopt({"vec_isa": [{"name": "avx2"}, {"name": "avx2"}], "vec_isa_probed": 1})
    promised = load_guard._promised(cpu_vec_isa)
    if not promised:
        pytest.skip("not an x86 machine: inductor's ISA list is not probed by CPU flags here")
    with pytest.raises(ValueError, match="this CPU has"):
        load_guard.adopt({"vec_isa": [], "vec_isa_probed": len(promised) + 1})
    load_guard.probe_vec_isa()
    everything = list(cpu_vec_isa.valid_vec_isa_list())  # read on: probed all
    whole, before = load_guard.probes()["vec_isa"], load_guard._answer
    if before is not None:
        assert before.probed == len(promised)
    load_guard.adopt({"vec_isa": whole[:1], "vec_isa_probed": 1})
    assert load_guard._answer is before or before is None
    assert list(cpu_vec_isa.valid_vec_isa_list()) == everything
    # An ISA out of this CPU's order, or past those probed, is refused: the first probed
    # cannot be the last candidate.
    with pytest.raises(ValueError, match="in order"):
        load_guard.adopt({"vec_isa": whole[-1:], "vec_isa_probed": 1} if len(whole) > 1
                         else {"vec_isa": whole * 2})


def _cut_libraries_short(folder: Path) -> int:
    """Every kernel library under ``folder`` cut to 16 bytes, as a compile killed while
    linking leaves one (inductor links in place); how many."""
    libraries = list(folder.rglob("*.so"))
    for path in libraries:
        with open(path, "r+b") as f:
            f.truncate(16)
    return len(libraries)


def test_a_kernel_library_cut_short_is_mended_by_the_worker_and_the_load(tmp_path: Path) -> None:
    cold = serve_fresh(tmp_path, "inductor")
    assert cold["tiers"] == ["default"] and cold["paths"] == ["worker"], cold
    # A later compile of the graph finds inductor's cache entry and its library cut short:
    # it used to fail with "file too short" every time; the worker removes it and compiles.
    assert _cut_libraries_short(tmp_path / "inductor") > 0
    shutil.rmtree(tmp_path / "cache")
    again = serve_fresh(tmp_path, "inductor")
    assert again["tiers"] == ["default"] and again["paths"] == ["worker"], again
    assert not again["failures"] and again["err"] <= again["tol"]
    # A load from hotswap's cache replaces the cut library with the entry's own.
    assert _cut_libraries_short(tmp_path / "inductor") > 0
    warm = serve_fresh(tmp_path, "inductor")
    assert warm["tiers"] == ["default"] and warm["paths"] == ["cache"], warm
    assert warm["delta"]["load_compiler_runs"] == 0 and warm["err"] <= warm["tol"]
