"""The frame decoder: frames split anywhere reassemble, large payloads arrive whole, and a
corrupt header is a ProtocolError."""

from __future__ import annotations

import os
import pickle
import threading
from typing import Any, SupportsIndex

import pytest

from hotswap.workers.protocol import (
    HEADER,
    FrameDecoder,
    MessageKind,
    ProtocolError,
    decode_job_request,
    decode_result,
    encode_frame,
    encode_job_request,
    encode_result,
)


def _stream(*frames: tuple[MessageKind, int, bytes]) -> bytes:
    return b"".join(b"".join(encode_frame(*f)) for f in frames)


FRAMES = [(MessageKind.STAGE_EVENT, 7, b"abc"), (MessageKind.SHUTDOWN, 0, b""),
          (MessageKind.JOB_RESULT, 2**40, bytes(range(256)) * 3)]


def _decoded(frames: list[object]) -> list[tuple[MessageKind, int, bytes]]:
    return [(f.kind, f.job_id, bytes(f.payload)) for f in frames]  # type: ignore[attr-defined]


@pytest.mark.parametrize("step", [1, 2, 5, HEADER.size, 1000])
def test_frames_split_anywhere_reassemble(step: int) -> None:
    data = _stream(*FRAMES)
    decoder = FrameDecoder()
    got = []
    for i in range(0, len(data), step):
        got += decoder.feed(data[i:i + step])
    assert _decoded(got) == FRAMES


def test_read_from_a_pipe_gets_a_large_payload_whole_then_eof() -> None:
    payload = os.urandom(5 << 20)  # far over a pipe's capacity: many reads
    r, w = os.pipe()

    def write() -> None:
        with os.fdopen(w, "wb") as f:
            f.write(_stream((MessageKind.JOB_RESULT, 3, payload), (MessageKind.SHUTDOWN, 0, b"")))

    writer = threading.Thread(target=write)
    writer.start()
    decoder = FrameDecoder()
    got = []
    try:
        with pytest.raises(EOFError):
            while True:
                got += decoder.read_from(r)
    finally:
        writer.join()
        os.close(r)
    assert _decoded(got) == [(MessageKind.JOB_RESULT, 3, payload), (MessageKind.SHUTDOWN, 0, b"")]


@pytest.mark.parametrize("header", [HEADER.pack(99, 1, 0), HEADER.pack(MessageKind.READY, 1, 1 << 50)],
                         ids=["unknown-kind", "implausible-length"])
def test_a_corrupt_header_is_a_protocol_error(header: bytes) -> None:
    with pytest.raises(ProtocolError):
        FrameDecoder().feed(header)


def test_a_job_request_carries_its_payload_as_a_view() -> None:
    data = os.urandom(3 << 20)
    [frame] = FrameDecoder().feed(_stream_parts(MessageKind.JOB_REQUEST, 5,
                                                *encode_job_request("pkg.mod:fn", data)))
    job, payload = decode_job_request(frame.payload)
    assert (frame.kind, frame.job_id, job) == (MessageKind.JOB_REQUEST, 5, "pkg.mod:fn")
    assert isinstance(payload, memoryview) and payload == data
    with pytest.raises(ProtocolError):
        decode_job_request(b"\0\0\0\x09short")


def _stream_parts(kind: MessageKind, job_id: int, *parts: bytes) -> bytes:
    return b"".join(encode_frame(kind, job_id, *parts))


class _Big:
    """Large bytes that travel out of band, as a compile result's artifact does."""

    def __init__(self, data: bytes | memoryview) -> None:
        self.data = data

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        return (_Big, (pickle.PickleBuffer(self.data),))


def test_a_result_s_out_of_band_buffer_arrives_as_a_view_into_the_frame() -> None:
    data = os.urandom(2 << 20)
    [frame] = FrameDecoder().feed(_stream_parts(MessageKind.JOB_RESULT, 1,
                                                *encode_result({"big": _Big(data), "n": 3})))
    result = decode_result(frame.payload)
    assert result["n"] == 3 and isinstance(result["big"].data, memoryview)
    assert result["big"].data == data and result["big"].data.obj is frame.payload  # not a copy
    assert decode_result(b"".join(encode_result([1, "two"]))) == [1, "two"]
    with pytest.raises(ProtocolError):
        decode_result(b"".join(encode_result("x")) + b"trailing")
