"""Graphs compiled region by region (regions=): each distinct repeated block compiled once in a
worker, the graph served as its pieces called in turn."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import msgpack
import pytest
import torch

import hotswap
from hotswap.engine.compose import compose
from hotswap.engine.loading.artifacts import load_entry, pack_entry
from hotswap.engine.loading.regions import Regional, check_plan
from hotswap.engine.options import Options
from hotswap.engine.recording import Recorder
from hotswap.engine.shipping.regions import region_labels
from hotswap.engine.sources.cache_access import CacheAccess
from hotswap.jobs import regions
from tests.engine.models import Block, Blocks, mlp


def _dynamo_graph(model: Any, *inputs: Any) -> torch.fx.GraphModule:
    return _dynamo_call(model, *inputs)[0]


def _dynamo_call(model: Any, *inputs: Any) -> tuple[torch.fx.GraphModule, list[Any]]:
    """The graph dynamo makes of ``model`` and the inputs it calls it with."""
    graphs = []

    def keep(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch.compile(model, backend=keep)(*inputs)
    assert len(graphs) == 1
    return graphs[0]


def _inference() -> torch.nn.Module:
    """Served for inference, as the corpus serves its models: nothing needs grad."""
    return Blocks(depth=4).requires_grad_(False)


def _regional_counts(d: dict[str, int]) -> tuple[int, int, int]:
    return d["regional_loads"], d["regional_pieces"], d["regional_compiled"]


def test_the_blocks_of_a_stack_are_labelled_and_nothing_else() -> None:
    gm = _dynamo_graph(Blocks(depth=3), torch.randn(4, 16))
    labels = region_labels(gm)
    nodes = list(gm.graph.nodes)
    assert len(labels) == len(nodes)
    by_label: dict[int, set[str]] = {}
    for node, label in zip(nodes, labels, strict=True):
        stack = [str(v[0]) for v in node.meta.get("nn_module_stack", {}).values()]
        in_block = any(".blocks." in path or "blocks[" in path for path in stack)
        if node.op in ("call_function", "call_method", "call_module"):
            assert (label >= 0) == in_block, (node.name, stack)
        if label >= 0:
            by_label.setdefault(label, set()).add(
                next(p for p in stack if p.rstrip("]").split("[")[-1].split(".")[-1].isdigit()))
    assert sorted(by_label) == [0, 1, 2]
    assert all(len(paths) == 1 for paths in by_label.values())  # one block per label


def test_a_graph_with_one_of_each_module_has_no_labels() -> None:
    model = torch.nn.Linear(8, 8)
    assert region_labels(_dynamo_graph(model, torch.randn(2, 8))) == ()


def test_the_pieces_run_as_the_graph_does() -> None:
    model, x = Blocks(depth=4), torch.randn(4, 16)
    gm, args = _dynamo_call(model, x)
    cut = regions.split(gm, region_labels(gm))
    assert cut is not None
    assert len(cut.pieces) == 6  # embed, four blocks, head
    plan = {"inputs": len(args), "sizes": [1] * len(cut.pieces),
            "steps": [(i, p.inputs, p.outputs) for i, p in enumerate(cut.pieces)],
            "outputs": cut.outputs}
    served = Regional([p.gm for p in cut.pieces], check_plan(plan, len(cut.pieces)))
    torch.testing.assert_close(served(*args)[0], model(x))
    with pytest.raises(TypeError, match="takes"):
        served(*args[:-1])


def _served_regionally(model: Any, *inputs: Any) -> Any:
    """``model``'s graph compiled region by region as a worker does, here, and loaded from
    its packed entry as the serving process does; None where it is not cut. It takes the
    inputs dynamo calls the graph with (``_dynamo_call``)."""
    from hotswap import compat
    from hotswap.engine.shipping.transport import land_graph, ship_graph

    gm, args = _dynamo_call(model, *inputs)
    labels = region_labels(gm)
    landed = land_graph(ship_graph(gm), list(args))
    made = regions.compile_regions(
        landed, list(args), [False] * len(args), labels,
        lambda piece, example: compat.compile_saveable(piece, example, {}))
    if made is None:
        return None
    artifacts, plan = made
    return load_entry(pack_entry(b"".join(artifacts), {}, None, plan))


def test_async_serves_the_pieces_then_the_whole_graph_when_asked() -> None:
    model, inputs = _inference(), (torch.randn(4, 16),)
    expected = model(*inputs)
    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(model, mode="async", workers=1, regions="on")
        compiled(*inputs)
        (status,) = hotswap.wait(compiled, timeout_s=240)
        torch.testing.assert_close(compiled(*inputs), expected, rtol=1e-4, atol=1e-4)
    assert status.tier == "default" and status.final and not status.failures, status
    assert dict(status.states)["default-regions"] == "replaced"
    assert _regional_counts(d) == (1, 6, 3)
    assert (d["worker_compiles"], d["swaps"], d["fallbacks"]) == (2, 2, 0)


def test_pieces_sent_after_the_whole_graph_are_kept_and_wait_does_not_wait_for_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As async with the compile service sends them (``rung_last``), here on one local
    worker: the whole graph serves first, the pieces still compiling are kept at once, and
    their compile, when it ends, changes nothing."""
    from hotswap.engine import coordinator

    def whole_first(*args: Any, **kwargs: Any) -> Any:
        return dataclasses.replace(compose(*args, **kwargs), rung_last=True)

    monkeypatch.setattr(coordinator, "compose", whole_first)
    model, inputs = _inference(), (torch.randn(4, 16),)
    expected = model(*inputs)

    before = hotswap.counters().get("worker_compiles", 0)

    def compiles() -> int:
        return hotswap.counters().get("worker_compiles", 0) - before

    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(model, mode="async", workers=1, regions="on")
        compiled(*inputs)
        (status,) = hotswap.wait(compiled, timeout_s=240)
        assert status.tier == "default" and status.final and not status.failures, status
        assert dict(status.kept) == {"default-regions": "tier 'default' already serves"}
        # wait() returned with the pieces kept: still compiling, or (a slow swap) just done
        assert compiles() in (1, 2)
        deadline = time.monotonic() + 240
        while compiles() < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # what the pieces' arrival would do, done
        torch.testing.assert_close(compiled(*inputs), expected, rtol=1e-4, atol=1e-4)
    (after,) = hotswap.status(compiled)
    assert after.kept == status.kept and not after.failures and after.tier == "default"
    assert (d["worker_compiles"], d["swaps"], d["fallbacks"], d["internal_errors"]) == (
        2, 1, 0, 0)
    assert _regional_counts(d) == (0, 0, 0)  # never loaded


def test_a_blocking_mode_compiles_the_whole_graph() -> None:
    model, inputs = _inference(), (torch.randn(4, 16),)
    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(model, mode="subprocess", workers=1, regions="on")
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-4, atol=1e-4)
    assert _regional_counts(d) == (0, 0, 0)
    assert d["worker_compiles"] == 1


@pytest.mark.parametrize("mode, regions", [("async", None), ("progressive", "off")])
def test_the_whole_graph_alone_in_async_with_the_local_pool_and_when_off(
        mode: str, regions: str | None) -> None:
    model, inputs = _inference(), (torch.randn(4, 16),)
    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(model, mode=mode, workers=1, regions=regions,
                                   tiers=["default"], gate=False)
        compiled(*inputs)
        (status,) = hotswap.wait(compiled, timeout_s=240)
    assert [name for name, _ in status.states] == ["default"]
    assert _regional_counts(d) == (0, 0, 0)
    assert d["worker_compiles"] == 1


def _composed(**options: Any) -> Any:
    made = Options.create(**options)
    return compose(made, cache=CacheAccess(made.cache_dir, made.limit_s(), None),
                   recorder=Recorder(None), load=lambda *_: None,
                   job=lambda *_: None, on_loader=lambda *_: None)


def _ladder(**options: Any) -> tuple[list[str], bool]:
    """The tiers a backend of these options climbs, the rung of pieces among them, and
    whether the rung is sent after the tier it stands in for."""
    composition = _composed(**options)
    return [tier.name for tier in composition.tiers], composition.rung_last


def _parts(**options: Any) -> list[int]:
    """How many parts each tier of the ladder compiles in (Tier.parts)."""
    return [tier.parts for tier in _composed(**options).tiers]


def test_the_rung_of_pieces_by_mode_executor_and_option(monkeypatch: pytest.MonkeyPatch) -> None:
    rung = ["default-regions", "default"]
    monkeypatch.setenv("HOTSWAP_WORKERS", "2")
    assert _ladder(mode="progressive") == ([*rung, "max-autotune"], False)
    assert _ladder(mode="progressive", regions="off") == (["default", "max-autotune"], False)
    assert _ladder(mode="async")[0] == ["default"]  # the local pool: one worker takes both
    # the service's two warm workers compile the tier in two parts at once: no rung
    assert _ladder(mode="async", executor="service://") == (["default"], False)
    assert _parts(mode="async", executor="service://") == [2]
    assert _parts(mode="async") == [1]
    assert _parts(mode="progressive", executor="service://") == [1, 1, 1]
    monkeypatch.setenv("HOTSWAP_PARTS", "1")  # whole graphs: the service's two warm workers
    # take the pieces and the whole graph; one worker free takes the whole graph first
    assert _ladder(mode="async", executor="service://") == (rung, True)
    monkeypatch.delenv("HOTSWAP_PARTS")
    monkeypatch.setenv("HOTSWAP_WORKERS", "1")  # a service of one worker: the whole graph
    assert _ladder(mode="async", executor="service://")[0] == ["default"]
    assert _parts(mode="async", executor="service://") == [1]
    monkeypatch.setenv("HOTSWAP_WORKERS", "2")
    assert _ladder(mode="async", executor="service://", regions="off")[0] == ["default"]
    assert _ladder(mode="async", regions="on") == (rung, False)  # asked for: sent first
    # asked for with the service: the rung is the pieces, the tier the parts
    assert _ladder(mode="async", executor="service://", regions="on") == (rung, False)
    assert _parts(mode="async", executor="service://", regions="on") == [1, 2]
    assert _ladder(mode="subprocess", executor="service://", regions="on")[0] == ["default"]


def test_a_restart_loads_the_whole_graph_from_the_cache(tmp_path: Any) -> None:
    model, inputs = _inference(), (torch.randn(4, 16),)
    expected = model(*inputs)
    for run in range(2):
        torch._dynamo.reset()
        with hotswap.counters_delta() as d:
            compiled = hotswap.compile(model, mode="async", workers=1, cache_dir=str(tmp_path),
                                       regions="on")
            compiled(*inputs)
            (status,) = hotswap.wait(compiled, timeout_s=240)
            torch.testing.assert_close(compiled(*inputs), expected, rtol=1e-4, atol=1e-4)
        assert status.tier == "default"
        if run == 0:
            assert (d["worker_compiles"], d["cache_hits"]) == (2, 0)
        else:  # the best tier stored serves at once; the pieces are not needed
            assert (d["worker_compiles"], d["cache_hits"], d["regional_loads"]) == (0, 1, 0)
            assert dict(status.kept)["default-regions"] == "tier 'default' came from the cache"


def test_progressive_climbs_from_the_pieces_to_the_whole_graph() -> None:
    model, inputs = _inference(), (torch.randn(4, 16),)
    ladder = ["default", {"name": "no-fusion", "config": {"max_fusion_size": 1}}]
    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(model, mode="progressive", tiers=ladder, workers=1,
                                   gate=False, regions="auto")
        compiled(*inputs)
        (status,) = hotswap.wait(compiled, timeout_s=240)
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-4, atol=1e-4)
    assert status.tier == "no-fusion" and status.final
    assert [name for name, _ in status.states] == ["default-regions", "default", "no-fusion"]
    assert _regional_counts(d) == (1, 6, 3)  # the bottom rung alone
    assert d["worker_compiles"] == 3


def test_a_graph_that_repeats_nothing_skips_the_rung() -> None:
    model, inputs = mlp()  # a Sequential's children are indexed, but none is alike
    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(model, mode="async", workers=1, regions="on")
        compiled(*inputs)
        (status,) = hotswap.wait(compiled, timeout_s=240)
    assert [name for name, _ in status.states] == ["default"]
    assert _regional_counts(d) == (0, 0, 0) and d["worker_compiles"] == 1


class _TogglesGrad(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = Blocks(depth=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks.embed(x)
        for i, block in enumerate(self.blocks.blocks):
            with torch.set_grad_enabled(i % 2 == 0):
                x = block(x)
        return x


class _AutocastBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):  # as LLaMA's rotary embedding does
            return super().forward(x)


class _AutocastInside(Blocks):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_AutocastBlock(32) for _ in range(4))


class _AutocastAcross(Blocks):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        with torch.autocast("cpu", enabled=False):
            for block in self.blocks:
                x = block(x)
        return self.head(x)


class _UpdatesItsInput(torch.nn.Module):
    """Each block adds into a tensor a later block reads: an update that crosses pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = Blocks(depth=4)

    def forward(self, x: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        x = self.blocks.embed(x)
        for block in self.blocks.blocks:
            x = block(x)
            acc.add_(x.sum())
        return x * acc


def test_a_graph_that_switches_grad_mode_is_not_cut() -> None:
    model = _TogglesGrad()
    with torch.no_grad():  # labelled under the mode it is called under, as in the backend
        gm = _dynamo_graph(model, torch.randn(4, 16))
        # It repeats blocks (they are labelled without the switches), but pieces would start
        # under another mode than the graph's.
        assert region_labels(_dynamo_graph(model.blocks, torch.randn(4, 16)))
        assert region_labels(gm) == ()


class _NoGradGlue(Blocks):
    """A ``no_grad`` step before the blocks, as LLaMA's rotary embedding: switched off and
    back within the glue."""

    @torch.no_grad()
    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs().mean() + 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        scale = self._scale(x)
        for block in self.blocks:
            x = block(x) * scale
        return self.head(x)


def test_a_grad_mode_switched_and_back_within_the_glue_is_cut() -> None:
    model, x = _NoGradGlue().requires_grad_(False), torch.randn(4, 16)
    gm = _dynamo_graph(model, x)
    switches = gm.graph.find_nodes(op="call_function", target=torch._C._set_grad_enabled)
    assert len(switches) == 2
    assert region_labels(gm)
    served = _served_regionally(model, x)
    torch.testing.assert_close(served(*_dynamo_call(model, x)[1])[0], model(x), rtol=1e-4,
                               atol=1e-4)


class _MovesUnused(Block):
    def forward(self, x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        window.to(x.device)  # its value unread, as Mistral's blocks do with their window
        return super().forward(x)


class _UnreadConstant(Blocks):
    """A constant made before the blocks and moved, but never read, in each (Mistral)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_MovesUnused(32) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        window = torch.tensor(4096)
        for block in self.blocks:
            x = block(x, window)
        return self.head(x)


def test_a_value_nothing_reads_does_not_cross_between_pieces() -> None:
    model, x = _UnreadConstant().requires_grad_(False), torch.randn(4, 16)
    gm, args = _dynamo_call(model, x)
    moves = gm.graph.find_nodes(op="call_method", target="to")
    assert len(moves) == 4 and not any(move.users for move in moves)  # dynamo keeps them
    cut = regions.split(gm, region_labels(gm))
    assert cut is not None and len(cut.pieces) == 6
    assert len({piece.signature for piece in cut.pieces}) == 3
    assert [len(piece.inputs) for piece in cut.pieces[1:5]] == [7] * 4  # x, six parameters
    assert len(cut.pieces[0].outputs) == 1
    served = _served_regionally(model, x)
    torch.testing.assert_close(served(*args)[0], model(x), rtol=1e-4, atol=1e-4)


def test_autocast_is_cut_around_but_not_through() -> None:
    x = torch.randn(4, 16)
    inside = _AutocastInside().requires_grad_(False)
    gm = _dynamo_graph(inside, x)
    cut = regions.split(gm, region_labels(gm))  # entered and left within each block
    assert cut is not None and len(cut.pieces) == 6
    assert len({piece.signature for piece in cut.pieces}) == 3
    across = _AutocastAcross().requires_grad_(False)
    assert region_labels(_dynamo_graph(across, x)) == ()  # entered before the first block


def test_a_stack_of_bare_layers_is_not_cut() -> None:
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(6)))
    assert region_labels(_dynamo_graph(model, torch.randn(4, 16))) == ()


def test_updates_across_pieces_match_eager() -> None:
    model = _UpdatesItsInput().requires_grad_(False)
    x = torch.randn(4, 16)
    acc_eager, acc_compiled = torch.zeros(1), torch.zeros(1)
    expected = model(x, acc_eager)
    probe = torch.zeros(1)
    with hotswap.counters_delta() as d:
        served = _served_regionally(model, x, probe)
    assert served is not None
    # embed, then each block and the update after it (alike but the last, which also scales)
    assert _regional_counts(d) == (1, 9, 4)
    args = [acc_compiled if a is probe else a for a in _dynamo_call(model, x, probe)[1]]
    out = served(*args)[0]
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(acc_compiled, acc_eager, rtol=1e-4, atol=1e-4)


class _PairBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.lin(a).relu() * b.sigmoid() + a


class _ReadsViews(torch.nn.Module):
    """Each block reads two views of one tensor: compiled for views, as it is called."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_PairBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            a, b = torch.cat([x, x * 2], dim=-1).chunk(2, dim=-1)
            x = block(a, b)
        return x


def test_pieces_that_read_views_of_one_tensor_match_eager() -> None:
    model, x = _ReadsViews().requires_grad_(False), torch.randn(4, 16)
    gm = _dynamo_graph(model, x)
    cut = regions.split(gm, region_labels(gm))
    assert cut is not None and any(p.views for p in cut.pieces)
    with hotswap.counters_delta() as d:
        served = _served_regionally(model, x)
    assert _regional_counts(d) == (1, 8, 2)
    torch.testing.assert_close(served(*_dynamo_call(model, x)[1])[0], model(x), rtol=1e-4,
                               atol=1e-4)


class _Exposing(Block):
    def forward(self, x: torch.Tensor) -> Any:
        h = self.norm(x)
        d = self.down(torch.nn.functional.gelu(self.up(h)))
        return x + d, h, d


class _Skips(Blocks):
    """Blocks alike, but later code keeps a different inner value of some of them: runs
    that return different nodes are not alike."""

    def __init__(self, keep: dict[int, str]) -> None:
        super().__init__()
        self.keep = keep
        self.blocks = torch.nn.ModuleList(_Exposing(32) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        kept = []
        for i, block in enumerate(self.blocks):
            x, h, d = block(x)
            if self.keep.get(i) == "h":
                kept.append(h)
            elif self.keep.get(i) == "d":
                kept.append(d)
        return self.head(x) + sum(k.sum() for k in kept)


@pytest.mark.parametrize("keep", [{0: "h", 1: "d"}, {3: "h"}, {0: "h", 1: "d", 2: "h", 3: "h"}])
def test_blocks_whose_values_are_kept_differently_match_eager(keep: dict[int, str]) -> None:
    model, x = _Skips(keep).requires_grad_(False), torch.randn(4, 16)
    served = _served_regionally(model, x)
    if served is not None:
        torch.testing.assert_close(served(*_dynamo_call(model, x)[1])[0], model(x),
                                   rtol=1e-4, atol=1e-4)


class _InferenceAcross(Blocks):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        with torch.inference_mode():  # its handle would pass from the first glue to the last
            for block in self.blocks:
                x = block(x)
        return self.head(x)


class _KernelAcross(Blocks):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        x = self.embed(x)
        with sdpa_kernel(SDPBackend.MATH):  # set, then restored: two calls for their effect
            for block in self.blocks:
                x = block(x)
        return self.head(x)


@pytest.mark.parametrize("model", [_InferenceAcross, _KernelAcross])
def test_a_context_entered_before_the_blocks_and_left_after_is_not_cut(model: Any) -> None:
    assert region_labels(_dynamo_graph(model().requires_grad_(False), torch.randn(4, 16))) == ()


def test_parameters_that_need_grad_under_no_grad_are_cut() -> None:
    model, inputs = Blocks(depth=4), (torch.randn(4, 16),)  # parameters need grad
    with torch.no_grad(), hotswap.counters_delta() as d:
        expected = model(*inputs)
        compiled = hotswap.compile(model, mode="progressive", tiers=["default"], workers=1,
                                   gate=False, regions="auto")
        compiled(*inputs)
        hotswap.wait(compiled, timeout_s=240)
        torch.testing.assert_close(compiled(*inputs), expected, rtol=1e-4, atol=1e-4)
    assert _regional_counts(d) == (1, 6, 3)  # the rung was pieces, not the whole graph again


def test_a_training_graph_compiles_whole() -> None:
    model, x = Blocks(depth=4).requires_grad_(True), torch.randn(4, 16)
    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(model, mode="async", workers=1, regions="on")
        compiled(x)
        (status,) = hotswap.wait(compiled, timeout_s=240)
        compiled(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert [name for name, _ in status.states] == ["default"]  # no rung of pieces
    assert _regional_counts(d) == (0, 0, 0) and d["worker_compiles"] == 1


@pytest.mark.parametrize("damage", [
    {"steps": [[5, [0], [1]]]},                     # a piece that is not there
    {"steps": [[0, [7], [8]]]},                     # reads a value never made
    {"steps": [[0, [0], [0]]]},                     # overwrites an input
    {"outputs": [9]},                               # returns a value never made
    {"sizes": [2]},                                 # sizes that do not add up
    {"inputs": "x"},
])
def test_a_malformed_plan_is_refused(damage: dict[str, Any]) -> None:
    plan = {"inputs": 1, "sizes": [3], "steps": [[0, [0], [1]]], "outputs": [1], **damage}
    entry = pack_entry(b"abc", {}, None, plan)
    with pytest.raises(ValueError, match="region plan"):
        load_entry(entry)


def test_a_plan_is_msgpack_as_it_travels() -> None:
    plan = {"inputs": 2, "sizes": [3, 4], "steps": [[0, [0, 1], [2]], [1, [2], [3]]],
            "outputs": [3, -1]}
    assert check_plan(msgpack.unpackb(msgpack.packb(plan)), 7)["outputs"] == [3, -1]


def test_regions_option_is_checked() -> None:
    with pytest.raises(ValueError, match="regions must be one of"):
        Options.create(regions="first")
    assert Options.create().regions == "auto"
    assert Options.create(regions="off").regions == "off"
