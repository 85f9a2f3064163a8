"""What crosses the process boundary survives the trip, as plain values only."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from hotswap.cache.key import cache_key
from hotswap.engine.shipping.wire import (
    BenchReply,
    BenchRequest,
    CachedEntry,
    CompileRequest,
    CompileResult,
    InputMeta,
)
from hotswap.profiles.records import BenchResult, TierBench

META = InputMeta((4, 8), (8, 1), "float32", "cpu", True, ("s0", None), strides=("s1", None))
CONSTANT = InputMeta((), (), "constant", "", False, value=2.5)

_PLAIN = (type(None), bool, int, float, str, bytes, pickle.PickleBuffer)


def _plain(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _trip(wire: dict[str, Any]) -> dict[str, Any]:
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(wire, protocol=5, buffer_callback=buffers.append)
    received: dict[str, Any] = pickle.loads(data, buffers=[b.raw() for b in buffers])
    return received


def test_requests_and_results_round_trip_as_plain_values() -> None:
    compile_request = CompileRequest("g1", "default", {"max_autotune": False}, b"graph",
                                     (META, CONSTANT), True, num_threads=2)
    bench_request = BenchRequest("g1", {"default": b"artifact", "max-autotune":
                                        CachedEntry("/c", "ab" * 32)}, (META,), False,
                                 purpose="gate", configs={"default": {}})
    bench = TierBench("g1", "default", BenchResult.from_samples([1.0, 2.0, 3.0], "cpu"),
                      device="cpu", purpose="gate")
    reply = BenchReply([bench], errors={"eager": "no graph"})
    for value in (compile_request, bench_request, reply):
        wire = value.to_wire()
        assert _plain(wire), wire
        assert type(value).from_wire(_trip(wire)) == value


def test_a_worker_takes_a_request_with_a_scheduling_hint_it_does_not_know() -> None:
    """CompileRequest.measured and BenchRequest.again are for the caller's pool: a worker of
    an older hotswap (a cluster's) drops them; any other key it lacks still fails."""
    request = CompileRequest("g1", "default", {}, b"graph", (META,), True, measured=True)
    assert CompileRequest.from_wire({**request.to_wire(), "again": True}) == request
    with pytest.raises(TypeError):
        CompileRequest.from_wire({**request.to_wire(), "unheard_of": 1})
    bench = BenchRequest("g1", {"default": b"artifact"}, (META,), False, again=True)
    assert BenchRequest.from_wire({**bench.to_wire(), "measured": True}) == bench


def test_an_artifact_travels_out_of_band() -> None:
    entry = bytes(range(256)) * 1024
    wire = CompileResult("g1", "default", entry).to_wire()
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(wire, protocol=5, buffer_callback=buffers.append)
    assert len(data) < 200 and len(buffers) == 1  # not copied into the pickle
    result = CompileResult.from_wire(pickle.loads(data, buffers=[b.raw() for b in buffers]))
    assert bytes(result.entry) == entry
    assert bytes(CompileResult.from_wire(wire).entry) == entry  # without a pickle in between


def test_keys_depend_on_the_factors_not_their_order() -> None:
    one = cache_key({"graph": "a", "config": {"x": 1, "y": [1, 2]}, "inputs": (META.to_wire(),)})
    two = cache_key({"inputs": [META.to_wire()], "config": {"y": (1, 2), "x": 1}, "graph": "a"})
    assert one == two and len(one) == 64 and int(one, 16) >= 0
    assert cache_key({"graph": "a"}) != cache_key({"graph": "b"})
    assert cache_key({"config": {"x": 1}}) != cache_key({"config": {"x": True}})
