"""A graph compiled in contiguous parts, one job per part (jobs/regions.py ``compile_part``),
put back together (cache/entry.py ``merge_parts``) and served as its parts in turn: where it
is cut, what happens where it cannot be, and what a merge refuses."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch

import hotswap
from hotswap.cache.entry import layout, merge_parts, pack_entry
from hotswap.engine.loading.artifacts import entry_parts, load_entry
from hotswap.engine.options import PARTS_KEY, Tier
from hotswap.engine.shipping.regions import part_labels, runs_of
from hotswap.engine.shipping.request import GraphRequest
from hotswap.engine.shipping.transport import ship_graph
from hotswap.engine.shipping.wire import CompileResult
from hotswap.jobs.compile import compile_graph
from tests.engine.models import Blocks, mlp
from tests.engine.test_regions import _dynamo_call


def _request(gm: torch.fx.GraphModule, args: list[Any], part: int, parts: int) -> dict[str, Any]:
    from hotswap.engine.shipping.inputs import describe_inputs

    described = describe_inputs(gm, args)
    assert not isinstance(described, str)
    request = GraphRequest(ship_graph(gm), described, torch.is_grad_enabled(),
                           torch.get_num_threads())
    wire = request.compile_request("g", Tier("default", parts=parts)).to_wire()
    return {**wire, "part": part}


def _compiled_in_parts(model: torch.nn.Module, x: torch.Tensor, parts: int) -> list[bytes]:
    """Each part's entry, as each worker of the service compiles it (here, one by one)."""
    gm, args = _dynamo_call(model, x)
    return [bytes(CompileResult.from_wire(compile_graph(_request(gm, args, i, parts))).entry)
            for i in range(parts)]


def test_a_stack_of_blocks_is_cut_between_two_blocks() -> None:
    gm, _ = _dynamo_call(Blocks(depth=8), torch.randn(4, 16))
    labels = part_labels(gm, 2)
    assert labels is not None
    runs = runs_of(gm, labels)
    assert runs is not None and len(runs) == 2
    # what crosses is the residual stream alone, made by the last node of a block (its add)
    [crossing] = [n for n in runs[1].inputs if n.op != "placeholder"]
    assert crossing.target is operator.add
    sizes = [len(r.nodes) for r in runs]
    assert abs(sizes[0] - sizes[1]) <= sum(sizes) // 4


def test_a_graph_too_small_to_cut_is_not() -> None:
    model, (x,) = mlp()
    gm, _ = _dynamo_call(model, x)
    assert part_labels(gm, 2) is None


@pytest.mark.parametrize("parts", [2, 3])
def test_the_parts_merged_serve_as_the_graph_does(parts: int) -> None:
    model, x = Blocks(depth=12).requires_grad_(False), torch.randn(4, 16)
    entries = _compiled_in_parts(model, x, parts)
    merged = merge_parts(list(reversed(entries)))  # the order they come back in is any
    with hotswap.counters_delta() as d:
        fn = load_entry(merged, {PARTS_KEY: parts})
    assert (d["regional_loads"], d["regional_pieces"], d["regional_compiled"]) == (1, parts, parts)
    torch.testing.assert_close(fn(*_dynamo_call(model, x)[1])[0], model(x))


def test_a_graph_that_cannot_be_cut_is_compiled_whole_by_the_first_part() -> None:
    model, (x,) = mlp()
    model.requires_grad_(False)
    first, second = _compiled_in_parts(model, x, 2)
    assert merge_parts([second, first]) == first
    with hotswap.counters_delta() as d:
        fn = load_entry(first, {})
    assert d["regional_loads"] == 0
    torch.testing.assert_close(fn(*_dynamo_call(model, x)[1])[0], model(x))


def test_a_graph_that_trains_is_compiled_whole_by_the_first_part_alone() -> None:
    model, x = Blocks(depth=12), torch.randn(4, 16)  # its parameters need grad: it trains
    first, second = _compiled_in_parts(model, x, 2)
    assert len(entry_parts(second)[0]) == 0  # the second part's job compiled nothing
    assert merge_parts([second, first]) == first


def test_a_part_is_no_entry_and_parts_that_do_not_make_a_graph_are_refused() -> None:
    plan = {"part": 0, "parts": 2, "inputs": 1, "outputs": [1], "steps": [[0, [0], [1]]]}
    part0 = pack_entry(b"abc", {}, None, part=plan)
    with pytest.raises(ValueError, match="one part of a graph"):
        load_entry(part0, {})
    with pytest.raises(ValueError, match="do not make one graph"):
        merge_parts([part0])  # part 1 missing
    with pytest.raises(ValueError, match="do not make one graph"):
        merge_parts([part0, part0])
    other = pack_entry(b"de", {}, None, part={**plan, "part": 1, "steps": [[1, [0], [2]]]})
    with pytest.raises(ValueError, match="do not make one graph"):
        merge_parts([part0, other])  # cut elsewhere
    with pytest.raises(ValueError, match="malformed part plan"):
        merge_parts([pack_entry(b"abc", {}, None, part={"part": 0})])
    with pytest.raises(ValueError, match="no part"):
        merge_parts([pack_entry(b"", {})])


def test_the_merged_probes_keep_the_furthest_isa_answer_and_every_header_and_module() -> None:
    plan = {"parts": 2, "inputs": 1, "outputs": [2], "steps": [[0, [0], [1]], [1, [1], [2]]]}
    isa = {"name": "avx2", "bits": 256, "flags": "-mavx2", "features": {}}
    code = "magic-O0"
    short = {"vec_isa": [isa], "vec_isa_probed": 1, "headers": [["a.h", "cc", "/a.gch"]],
             "code": [code, {"m1": b"1"}]}
    full = {"vec_isa": [isa, {**isa, "name": "avx512"}], "headers": [["b.h", "cc", "/b.gch"]],
            "code": [code, {"m2": b"2"}]}
    merged = merge_parts([pack_entry(b"x", {}, short, part={**plan, "part": 0}),
                          pack_entry(b"y", {}, full, part={**plan, "part": 1})])
    probes = layout(memoryview(merged))[2]
    assert probes["vec_isa"] == full["vec_isa"] and "vec_isa_probed" not in probes
    assert sorted(h[0] for h in probes["headers"]) == ["a.h", "b.h"]
    assert probes["code"] == [code, {"m1": b"1", "m2": b"2"}]


def test_a_file_both_parts_carry_is_merged_as_its_finished_copy() -> None:
    # Each worker ships what was written in inductor's shared folder while it compiled: the
    # other worker's library, still being linked, comes cut short in the first part's entry.
    plan = {"parts": 2, "inputs": 1, "outputs": [2], "steps": [[0, [0], [1]], [1, [1], [2]]]}
    whole = b"\x7fELF" + bytes(range(256)) * 8
    merged = merge_parts([
        pack_entry(b"x", {"ab/cab.main.so": whole[:100], "ab/own.so": b"1"}, None,
                   part={**plan, "part": 0}),
        pack_entry(b"y", {"ab/cab.main.so": whole}, None, part={**plan, "part": 1})])
    view = memoryview(merged)
    files = {path: bytes(view[at:at + n]) for path, at, n in layout(view)[3]}
    assert files == {"ab/cab.main.so": whole, "ab/own.so": b"1"}
