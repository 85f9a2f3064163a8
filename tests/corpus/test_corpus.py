"""Real models (the corpus, from transformers): hotswap reaches a compiled tier on every graph,
outputs and gradients match eager, and the counters move by exactly what happened.

The whole corpus runs from ``hotswap corpus``; here, a subset that covers what real models
bring: a CNN with max-pooling, a ViT, a decoder LLM and an encoder-decoder."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hotswap

corpus = pytest.importorskip("hotswap.tools.corpus")
pytest.importorskip("transformers", reason="the corpus needs the models extra")

pytestmark = pytest.mark.slow

SUBSET = ("resnet", "vit", "llama", "t5")


def _serve_until_final(workload: Any, compiled: Any
                       ) -> tuple[list[hotswap.GraphStatus], dict[str, int]]:
    """The first step, the statuses once final, then three steps more: (those statuses, the
    counter deltas of the later steps)."""
    workload.step(compiled, 0)
    statuses = hotswap.wait(compiled, timeout_s=600)
    with hotswap.counters_delta() as later:
        for step in range(1, 4):
            error = workload.error(workload.step(compiled, step), step)
            assert error <= workload.tolerance, (workload.name, step, error)
    return statuses, later


@pytest.mark.parametrize("name", SUBSET)
def test_async_compiles_every_graph_in_a_worker(name: str) -> None:
    workload = corpus.make(name)
    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(workload.target, mode="async", workers=2)
        statuses, later = _serve_until_final(workload, compiled)
    assert statuses and all(s.tier == "default" and s.path == "worker" for s in statuses), statuses
    n = len(statuses)
    assert (d["graphs"], d["worker_compiles"], d["swaps"]) == (n, n, n), d
    assert d["fallbacks"] == d["cache_hits"] == d["inprocess_compiles"] == 0, d
    # Eager serves a graph until its tier swaps in: its first call, or none where the tier was
    # in first. The compile starts while dynamo is still in its backend call and races what
    # dynamo does before the first call (guards, code); when inductor's caches already hold the
    # graph (an earlier run or test on this machine) it takes a few tenths of a second and can
    # win. Never a call after the swap.
    assert all(s.eager_calls <= 1 for s in statuses), statuses
    assert d["eager_calls"] == sum(s.eager_calls for s in statuses), (d, statuses)
    assert later["eager_calls"] == 0, later


def _swaps_in(status: hotswap.GraphStatus) -> int:
    """Swaps into a tier, read off when each tier began serving: a change back to the tier
    that served before is a tier on trial giving way, not a swap."""
    served, swaps = ["eager"], 0
    for tier, _ in status.served_after_s:
        if len(served) > 1 and tier == served[-2]:
            served.pop()
        else:
            served.append(tier)
            swaps += 1
    return swaps


@pytest.mark.parametrize("name", ("resnet", "t5"))
def test_progressive_climbs_the_ladder_on_real_models(name: str) -> None:
    """Each graph: the first tier ready is measured against eager and swaps in only if faster;
    the other is measured against what serves then (eager, or the first tier) and swaps in only
    if faster; the counters say exactly that."""
    workload = corpus.make(name)
    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(workload.target, mode="progressive", workers=2)
        statuses, _ = _serve_until_final(workload, compiled)
    n = len(statuses)
    assert all(s.final and not s.failures and s.tier in ("eager", "default", "max-autotune")
               for s in statuses), statuses
    assert (d["graphs"], d["worker_compiles"]) == (n, 2 * n), d
    # Per graph, two decisions that stood (each tier against what served then), each after
    # its undecided measurements.
    assert d["gate_benchmarks"] + d["eager_checks"] - d["gate_undecided"] == 2 * n, d
    # Every tier kept out was kept by the gate: for the other tier ("gate: ...") or for eager.
    kept = [why for s in statuses for _, why in s.kept]
    assert all(why.startswith(("gate: ", "slower than eager: ", "not faster than eager: "))
               for why in kept), statuses
    assert d["gate_kept"] == len(kept), (d, statuses)
    # A tier that stood swapped in once; one kept out never served, unless a contended
    # measurement left the pair undecided and it served on trial meanwhile (then it may
    # swap in, and give way, more than once).
    assert d["swaps"] == sum(_swaps_in(s) for s in statuses), (d, statuses)
    if d["gate_undecided"] == 0:
        assert d["swaps"] == 2 * n - len(kept), (d, statuses)
    else:
        assert d["swaps"] >= 2 * n - len(kept), (d, statuses)


def test_decoder_serves_slices_of_a_longer_batch_compiled() -> None:
    """input_ids[:, :n] for a growing n: one static graph, then one dynamic graph that serves
    every later length; each compiled in a worker, nothing recompiled after. (A slice as
    long as the whole batch is contiguous: dynamo traces that case anew, as torch.compile
    would; it is not among these lengths.)"""
    workload = corpus.make("gpt2")
    model, ids = workload.target, torch.randint(0, 512, (2, 64))
    compiled = hotswap.compile(model, mode="async", workers=2)
    with torch.no_grad():
        for n in (8, 12, 16):
            compiled(input_ids=ids[:, :n])
        statuses = hotswap.wait(compiled, timeout_s=600)
        with hotswap.counters_delta() as d:
            for n in (8, 12, 16, 20, 33, 48):
                out, ref = compiled(input_ids=ids[:, :n]), model(input_ids=ids[:, :n])
                torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    assert all(s.tier == "default" and s.path == "worker" for s in statuses), statuses
    assert d["graphs"] == 0 and d["eager_calls"] == 0, d


def test_training_gradients_match_eager_before_and_after_the_swap() -> None:
    workload = corpus.make("resnet", train=True)
    compiled = hotswap.compile(workload.target, mode="async", workers=2)
    for step in range(2):  # eager, before any tier arrived
        assert workload.error(workload.step(compiled, step), step) <= workload.tolerance
    statuses = hotswap.wait(compiled, timeout_s=600)
    assert statuses and all(s.tier == "default" for s in statuses), statuses
    with hotswap.counters_delta() as d:
        for step in range(2, 5):
            assert workload.error(workload.step(compiled, step), step) <= workload.tolerance
    assert d["eager_calls"] == 0


def test_corpus_names_and_variants_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown corpus model 'resnet1000'; the corpus has"):
        corpus.make("resnet1000")
    with pytest.raises(ValueError, match="no train-mode variant"):
        corpus.make("bert", train=True)
    with pytest.raises(ValueError, match="unknown dtype"):
        corpus.make("vit", dtype="float99")


@pytest.mark.parametrize("name", sorted(corpus.MODELS) if hasattr(corpus, "MODELS") else [])
def test_every_corpus_model_builds_and_its_reference_catches_a_wrong_output(name: str) -> None:
    workload = corpus.make(name)
    out = workload.step(workload.target, 0)
    assert workload.error(out, 0) == 0.0
    bad = torch.utils._pytree.tree_map(lambda t: t + 1 if isinstance(t, torch.Tensor) else t, out)
    assert workload.error(bad, 0) >= 0.5


def test_tools_take_corpus_models_by_zoo_name() -> None:
    from hotswap.tools import zoo
    from hotswap.tools.bench.row import build

    assert zoo.known("corpus:vit") and not zoo.known("corpus:vit9") and zoo.known("mlp")
    workload = zoo.make("corpus:vit")
    assert workload.error(workload.target(*workload.inputs(1)), 1) == 0.0
    model, inputs = build("corpus:vit", "cpu")
    assert all(isinstance(x, torch.Tensor) for x in inputs) and model(*inputs)


def test_corpus_command_runs_a_model_beside_torch_compile(tmp_path: Any) -> None:
    """Each case in a fresh process; the JSON has torch.compile's case and hotswap's."""
    import json
    import subprocess
    import sys

    out = tmp_path / "corpus.json"
    done = subprocess.run([sys.executable, "-m", "hotswap.tools.corpus_cmd", "--models", "vit",
                           "--modes", "async", "--workers", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    cases = {c["mode"]: c for c in json.loads(out.read_text())["cases"]}
    assert cases["torch"]["compiled"] and cases["async"]["tiers"] == ["default"]
    assert cases["async"]["paths"] == ["worker"]
    assert cases["async"]["max_error"] <= cases["async"]["tolerance"]
    assert "async: 1/1 models compiled by torch.compile" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "hotswap.tools.corpus_cmd", "--models", "vit9"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "unknown corpus models ['vit9']" in bad.stderr
