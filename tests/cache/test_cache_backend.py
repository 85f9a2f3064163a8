"""The artifact cache through hotswap.compile: a second process starts warm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hotswap
from hotswap.engine.shipping.inputs import describe_inputs
from hotswap.engine.shipping.keys import environment_stamp, tier_key

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, hotswap
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(model, mode=sys.argv[1], workers=1)
        first = compiled(x)
        [status] = hotswap.wait(compiled, timeout_s=240)
        out = compiled(x)
    ok = bool(torch.allclose(first, model(x), atol=1e-5) and torch.allclose(out, model(x), atol=1e-5))
    print(json.dumps({"tier": status.tier, "ok": ok, "delta": dict(d),
                      "failures": status.failures}))
    """
)


def _run(mode: str, cache_dir: Path, inductor_dir: Path | None = None) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOTSWAP_CACHE_DIR": str(cache_dir)}
    if inductor_dir is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("mode", ["async", "subprocess", "inprocess"])
def test_second_process_hits_the_cache(tmp_path: Path, mode: str) -> None:
    compiles = "inprocess_compiles" if mode == "inprocess" else "worker_compiles"
    cold = _run(mode, tmp_path / "cache")
    warm = _run(mode, tmp_path / "cache")
    for run in (cold, warm):
        assert run["ok"] and run["tier"] == "default" and not run["failures"], run
    assert cold["delta"][compiles] == 1 and cold["delta"]["cache_hits"] == 0  # type: ignore[index]
    assert warm["delta"][compiles] == 0 and warm["delta"]["cache_hits"] == 1  # type: ignore[index]


def test_modes_share_entries_and_an_unloadable_entry_is_compiled_again(tmp_path: Path) -> None:
    """An entry written in-process serves a worker mode; an entry that verifies but whose
    artifact will not load is compiled again in the background modes (and replaced)."""
    from hotswap.cache import ArtifactCache
    from hotswap.engine.loading.artifacts import pack_entry

    cache_dir = tmp_path / "cache"
    assert _run("inprocess", cache_dir)["delta"]["inprocess_compiles"] == 1  # type: ignore[index]
    shared = _run("async", cache_dir)
    assert shared["delta"]["cache_hits"] == 1 and shared["delta"]["worker_compiles"] == 0  # type: ignore[index]
    stamp = environment_stamp({"cpu"})
    cache = ArtifactCache(cache_dir, stamp=stamp)
    [entry] = cache.entries()
    cache.put(entry.key, pack_entry(b"not an artifact", {}), tier=entry.tier)  # signed, unloadable
    again = _run("async", cache_dir)
    assert again["ok"] and again["tier"] == "default" and not again["failures"], again
    assert again["delta"]["cache_hits"] == 1 and again["delta"]["worker_compiles"] == 1  # type: ignore[index]
    healed = _run("async", cache_dir)
    assert healed["delta"]["cache_hits"] == 1 and healed["delta"]["worker_compiles"] == 0  # type: ignore[index]


def test_key_changes_with_each_of_its_parts() -> None:
    captured = []

    def grab(gm: torch.fx.GraphModule, example_inputs: list[object]) -> object:
        captured.append((gm, example_inputs))
        return gm.forward

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sin()

    def g(x: torch.Tensor) -> torch.Tensor:
        return (x * 3).sin()

    torch._dynamo.reset()
    torch.compile(f, backend=grab)(torch.randn(4, 4))
    torch.compile(g, backend=grab)(torch.randn(4, 4))
    torch.compile(f, backend=grab, dynamic=False)(torch.randn(5, 4))
    (gm_f, ex_f), (gm_g, ex_g), (gm_f5, ex_f5) = captured[:3]
    inputs_f = describe_inputs(gm_f, ex_f)
    stamp = environment_stamp()
    base = tier_key(gm_f, inputs_f, False, {}, stamp)
    assert base == tier_key(gm_f, inputs_f, False, {}, dict(stamp))  # deterministic
    variants = [
        tier_key(gm_g, describe_inputs(gm_g, ex_g), False, {}, stamp),     # graph code
        tier_key(gm_f5, describe_inputs(gm_f5, ex_f5), False, {}, stamp),  # input shapes
        tier_key(gm_f, inputs_f, True, {}, stamp),                          # grad mode
        tier_key(gm_f, inputs_f, False, {"max_autotune": True}, stamp),     # tier config
        tier_key(gm_f, inputs_f, False, {}, {**stamp, "torch": "2.11.0"}),  # torch version
        tier_key(gm_f, inputs_f, False, {}, {**stamp, "gpus": ["H200 sm_90"]}),  # device
        tier_key(gm_f, inputs_f, False, {}, {**stamp, "format": 99}),       # format version
        tier_key(gm_f, inputs_f, False, {}, stamp, num_threads=1),           # CPU threads
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_four_processes_missing_at_once_compile_once(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOTSWAP_CACHE_DIR": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, "async"], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(4)]
    runs = []
    for proc in procs:
        out, err = proc.communicate(timeout=400)
        assert proc.returncode == 0, err[-2000:]
        runs.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["ok"] and r["tier"] == "default" and not r["failures"] for r in runs), runs
    assert sum(r["delta"]["worker_compiles"] for r in runs) == 1, runs
    assert sum(r["delta"]["cache_hits"] for r in runs) == 3, runs
    from hotswap.cache import ArtifactCache

    assert ArtifactCache(tmp_path / "cache").verify() == []  # no torn entry
    assert len(ArtifactCache(tmp_path / "cache").entries()) == 1


def test_warm_process_with_its_own_inductor_cache_receives_the_kernels(tmp_path: Path) -> None:
    cold = _run("async", tmp_path / "cache", tmp_path / "inductor-cold")
    warm = _run("async", tmp_path / "cache", tmp_path / "inductor-warm")
    assert cold["ok"] and warm["ok"] and warm["delta"]["cache_hits"] == 1  # type: ignore[index]
    # Kernel libraries (inductor names them *.main.so; the ISA probe's own builds stay with
    # the worker that probed): the C++ kernels came with the entry.
    shipped = {p.name for p in (tmp_path / "inductor-cold").rglob("*.main.so")}
    received = {p.name for p in (tmp_path / "inductor-warm").rglob("*.main.so")}
    assert shipped and shipped <= received
    assert warm["delta"]["load_compiler_runs"] == 0  # type: ignore[index]


def test_cpu_graphs_compile_for_the_callers_thread_count() -> None:
    """C++ kernels are generated for the caller's intra-op threads: the worker compiles with
    them, and another thread count is another cache entry (not a hit of the wrong code)."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    before = torch.get_num_threads()
    deltas = []
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            torch._dynamo.reset()
            with hotswap.counters_delta() as d:
                compiled = hotswap.compile(model, mode="subprocess", workers=1)
                torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
            deltas.append((d["worker_compiles"], d["cache_hits"]))
    finally:
        torch.set_num_threads(before)
    assert deltas == [(1, 0), (1, 0), (0, 1)]
