"""The compile service's replies on the wire: a job result framed with its artifact out of
band, every other reply plain msgpack."""

from __future__ import annotations

import pickle

import pytest

from hotswap.service.wire import decode_reply, encode, encode_result
from hotswap.workers.protocol import decode_result


def test_a_result_arrives_with_its_artifact_as_a_view_into_the_reply() -> None:
    entry = bytes(range(256)) * 4096  # 1 MiB
    reply = encode_result({"kind": "result", "events": [{"name": "x"}]},
                          {"graph_id": "g", "entry": pickle.PickleBuffer(entry)})
    message, framed = decode_reply(reply)
    assert message == {"kind": "result", "events": [{"name": "x"}]} and framed is not None
    result = decode_result(framed)
    got = result["entry"]
    assert isinstance(got, memoryview) and got.obj is reply  # not copied out of the reply
    assert bytes(got) == entry and result["graph_id"] == "g"


def test_every_other_reply_is_plain_msgpack() -> None:
    for message in ({"kind": "failed", "error": {"type": "X"}}, {"kind": "refused"}):
        assert decode_reply(encode(message)) == (message, None)
    with pytest.raises(ValueError, match="shorter than its header"):
        decode_reply(b"\x00\x00\x01\x00" + encode({"kind": "result"}))


def test_a_header_too_large_to_frame_is_refused() -> None:
    with pytest.raises(ValueError, match="16 MiB at most"):
        encode_result({"kind": "result", "events": ["e" * (1 << 24)]}, {})
