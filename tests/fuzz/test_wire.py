"""Fuzz: bytes to the worker protocol's decoders, and records through their wire forms.

The decoders promise ``ProtocolError`` for a byte stream they cannot parse (the pool then
treats the worker as crashed), and nothing else. Pickled payloads and results are not fuzzed:
only this process's own children send them, and unpickling them is trusting them
(docs/security.md); ``decode_result`` is fuzzed up to the pickle, which a stub stands in for.
"""

from __future__ import annotations

import itertools
import pickle
import struct
import types
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from hotswap.engine.shipping.wire import BenchRequest, CachedEntry, CompileRequest, CompileResult, InputMeta
from hotswap.workers import protocol
from hotswap.workers.protocol import (
    HEADER,
    FrameDecoder,
    MessageKind,
    ProtocolError,
    StageEvent,
    decode_control,
    decode_job_request,
    decode_result,
    encode_control,
    encode_frame,
    encode_job_request,
)
from tests.fuzz.cases import count

leaves = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False)
          | st.text(max_size=12) | st.binary(max_size=12))
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
kinds = st.sampled_from(list(MessageKind))
frames = st.tuples(kinds, st.integers(0, 2**64 - 1), st.binary(max_size=300))


def _chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@given(data=st.binary(max_size=400) | st.lists(frames, max_size=3).map(
           lambda fs: b"".join(b"".join(encode_frame(*f[:2], f[2])) for f in fs)),
       flips=st.lists(st.tuples(st.integers(0, 10**4), st.integers(1, 255)), max_size=3),
       cuts=st.lists(st.integers(0, 10**4), max_size=6))
@example(data=HEADER.pack(9, 0, 0), flips=[], cuts=[])  # unknown kind
@example(data=HEADER.pack(1, 0, 1 << 50), flips=[], cuts=[])  # implausible length
@example(data=HEADER.pack(1, 0, (1 << 40) - 1), flips=[], cuts=[])  # plausible, unmappable
def test_frame_decoder_on_any_bytes(data: bytes, flips: list[tuple[int, int]],
                                    cuts: list[int]) -> None:
    count("wire frames")
    buf = bytearray(data)
    for at, mask in flips:
        if buf:
            buf[at % len(buf)] ^= mask
    decoder = FrameDecoder()
    try:
        for chunk in _chunks(bytes(buf), cuts):
            for frame in decoder.feed(chunk):
                assert isinstance(frame.kind, MessageKind)
    except ProtocolError:
        pass


@given(fs=st.lists(frames, max_size=4), cuts=st.lists(st.integers(0, 10**4), max_size=8))
def test_frames_arrive_whole_however_the_stream_is_cut(fs: list[tuple[MessageKind, int, bytes]],
                                                       cuts: list[int]) -> None:
    count("wire frames")
    stream = b"".join(b"".join(encode_frame(k, j, p)) for k, j, p in fs)
    decoder = FrameDecoder()
    got = [f for chunk in _chunks(stream, cuts) for f in decoder.feed(chunk)]
    assert [(f.kind, f.job_id, bytes(f.payload)) for f in got] == fs


@given(data=st.binary(max_size=200))
@example(data=struct.pack("!I", 1) + b"\xff")  # a name that is not UTF-8
def test_job_request_on_any_bytes(data: bytes) -> None:
    count("wire payloads")
    try:
        name, rest = decode_job_request(data)
    except ProtocolError:
        return
    assert struct.pack("!I", len(name.encode())) + name.encode() + bytes(rest) == data


@given(job=st.text(max_size=30), body=st.binary(max_size=100))
def test_job_request_round_trip(job: str, body: bytes) -> None:
    count("wire payloads")
    name, rest = decode_job_request(b"".join(encode_job_request(job, body)))
    assert (name, bytes(rest)) == (job, body)


@given(data=st.binary(max_size=200) | st.lists(st.integers(0, 2**64 - 1), max_size=5).map(
    lambda s: struct.pack("!I", max(len(s) - 1, 0)) + b"".join(struct.pack("!Q", n) for n in s)))
def test_result_table_on_any_bytes(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    count("wire payloads")
    seen: list[tuple[bytes, list[bytes]]] = []

    def loads(first: memoryview, buffers: list[memoryview]) -> None:
        seen.append((bytes(first), [bytes(b) for b in buffers]))

    with monkeypatch.context() as m:
        m.setattr(protocol, "pickle", types.SimpleNamespace(loads=loads))  # this module's alone
        try:
            decode_result(data)
        except ProtocolError:
            return
    [(first, rest)] = seen
    (n,) = struct.unpack_from("!I", data)
    assert data.endswith(first + b"".join(rest)) and len(rest) == n


@given(data=st.binary(max_size=200) | values.map(encode_control))
@example(data=b"\xc1")            # msgpack's reserved byte
@example(data=b"\x81\x90\x01")    # a map keyed by a list
@example(data=b"\x01\x02")        # extra data after the value
@example(data=encode_control({"name": 1}))  # a map without the event's fields
@example(data=encode_control([1, 2]))
def test_control_and_stage_event_on_any_bytes(data: bytes) -> None:
    count("wire payloads")
    try:
        decode_control(data)
    except ProtocolError:
        pass
    try:
        event = StageEvent.from_wire(7, data)
    except ProtocolError:
        return
    assert event.job_id == 7 and isinstance(event.name, str) and isinstance(event.attrs, dict)


@given(name=st.text(max_size=20), start=st.floats(allow_nan=False), end=st.floats(allow_nan=False),
       pid=st.integers(0, 2**31), attrs=st.dictionaries(st.text(max_size=6), values, max_size=3))
def test_stage_event_round_trip(name: str, start: float, end: float, pid: int,
                                attrs: dict[str, Any]) -> None:
    count("wire payloads")
    event = StageEvent(name, start, end, pid, 3, attrs)
    assert StageEvent.from_wire(3, event.to_wire()) == event


sizes = st.lists(st.integers(0, 2**31), max_size=4).map(tuple)
metas = st.builds(
    InputMeta, shape=sizes, stride=sizes, dtype=st.sampled_from(["torch.float32", "constant"]),
    device=st.sampled_from(["cpu", "cuda:0"]), requires_grad=st.booleans(),
    sizes=st.lists(st.none() | st.text(max_size=4), max_size=4).map(tuple),
    symbol=st.none() | st.text(max_size=4), hint=st.integers(0, 2**31),
    strides=st.lists(st.none() | st.text(max_size=4), max_size=4).map(tuple),
    value=st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=False))
configs = st.dictionaries(st.text(max_size=10), leaves, max_size=3)


@given(request=st.builds(CompileRequest, graph_id=st.text(max_size=10), tier=st.text(max_size=10),
                         config_patches=configs, graph_bytes=st.binary(max_size=40),
                         inputs=st.lists(metas, max_size=3).map(tuple), grad_enabled=st.booleans(),
                         num_threads=st.none() | st.integers(1, 64), compile_id=st.text(max_size=6)),
       entry=st.binary(max_size=40))
def test_compile_records_round_trip(request: CompileRequest, entry: bytes) -> None:
    count("wire records")
    assert CompileRequest.from_wire(pickle.loads(pickle.dumps(request.to_wire()))) == request
    result = CompileResult(request.graph_id, request.tier, entry)
    back = CompileResult.from_wire(pickle.loads(pickle.dumps(result.to_wire(), protocol=5)))
    assert (back.graph_id, back.tier, bytes(back.entry)) == (result.graph_id, result.tier, entry)
    assert bytes(CompileResult.from_wire(result.to_wire()).entry) == entry  # in-process


@given(request=st.builds(
    BenchRequest, graph_id=st.text(max_size=10),
    entries=st.dictionaries(st.text(max_size=8), st.binary(max_size=20) | st.builds(
        CachedEntry, cache_dir=st.text(max_size=10), key=st.text(max_size=10)), max_size=3),
    inputs=st.lists(metas, max_size=2).map(tuple), grad_enabled=st.booleans(),
    graph_bytes=st.binary(max_size=20), budget_ms=st.floats(0, 1e4),
    purpose=st.sampled_from(["gate", "compare"]), breakdown=st.booleans(),
    num_threads=st.none() | st.integers(1, 64),
    configs=st.dictionaries(st.text(max_size=8), configs, max_size=2),
    pair=st.lists(st.text(max_size=8), max_size=2).map(tuple), rounds=st.integers(0, 100)))
def test_bench_request_round_trip(request: BenchRequest) -> None:
    count("wire records")
    assert BenchRequest.from_wire(pickle.loads(pickle.dumps(request.to_wire()))) == request
