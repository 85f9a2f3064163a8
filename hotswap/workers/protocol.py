"""Wire protocol between the pool (parent) and one worker process (child).

Two anonymous pipes per worker, passed to ``python -m hotswap.workers`` with ``pass_fds``::

    parent (pool manager thread)                        child (worker main thread)
    ----------------------------                        --------------------------
    INIT        msgpack {sys_path, warm_modules, ...} ->  sets sys.path, imports warm modules
                                                     <- READY        msgpack {pid, warm_s}
    JOB_REQUEST msgpack {job, payload: pickle bytes} ->  unpickles payload, runs job
                                                     <- STAGE_EVENT  msgpack (0..n, while it runs)
                                                     <- JOB_RESULT   pickle bytes
                                                     or JOB_FAILED   msgpack {kind, type, message, tb}
    SHUTDOWN    (empty)                              ->  exits 0

Every frame is a fixed 17-byte header (kind: u8, job id: u64, payload length: u64, network
order) followed by the payload. Control messages are msgpack; payloads and results are pickled
bytes that only the job (child) or the waiting future (parent) unpickles.

This module imports only the standard library and msgpack: both sides load it before torch.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

__all__ = [
    "HEADER",
    "Frame",
    "FrameDecoder",
    "MessageKind",
    "StageEvent",
    "encode_control",
    "encode_frame",
]

HEADER = struct.Struct("!BQQ")
# Frames larger than this are a protocol error (a corrupted length field), not a payload.
MAX_FRAME_BYTES = 1 << 40


class MessageKind(enum.IntEnum):
    INIT = 1
    READY = 2
    JOB_REQUEST = 3
    JOB_RESULT = 4
    JOB_FAILED = 5
    STAGE_EVENT = 6
    SHUTDOWN = 7


class ProtocolError(Exception):
    """The byte stream from a peer cannot be parsed; the peer is treated as crashed."""


@dataclass(frozen=True, slots=True)
class Frame:
    kind: MessageKind
    job_id: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class StageEvent:
    """One timed stage of a job, measured inside the process that ran it.

    ``start_s``/``end_s`` are ``time.monotonic()`` readings: on Linux CLOCK_MONOTONIC is
    system-wide, so events from workers and the coordinator share one time axis.
    """

    name: str
    start_s: float
    end_s: float
    pid: int
    job_id: int = 0
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def elapsed_s(self) -> float:
        return self.end_s - self.start_s

    def to_wire(self) -> bytes:
        return encode_control(
            {"name": self.name, "start_s": self.start_s, "end_s": self.end_s,
             "pid": self.pid, "attrs": self.attrs}
        )

    @classmethod
    def from_wire(cls, job_id: int, payload: bytes) -> StageEvent:
        d = decode_control(payload)
        return cls(d["name"], d["start_s"], d["end_s"], d["pid"], job_id, d.get("attrs") or {})


def encode_control(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def decode_control(payload: bytes) -> Any:
    return msgpack.unpackb(payload, raw=False)


def encode_frame(kind: MessageKind, job_id: int, payload: bytes = b"") -> list[bytes]:
    """Header and payload as two buffers: a large payload is never copied to prepend 17 B."""
    return [HEADER.pack(kind, job_id, len(payload)), payload]


class FrameDecoder:
    """Incremental decoder: feed it whatever a non-blocking read returned, get whole frames back."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        self._buf += data
        frames: list[Frame] = []
        while len(self._buf) >= HEADER.size:
            kind, job_id, length = HEADER.unpack_from(self._buf)
            if length > MAX_FRAME_BYTES:
                raise ProtocolError(f"frame length {length} is not plausible")
            end = HEADER.size + length
            if len(self._buf) < end:
                break
            try:
                mkind = MessageKind(kind)
            except ValueError as e:
                raise ProtocolError(f"unknown message kind {kind}") from e
            frames.append(Frame(mkind, job_id, bytes(self._buf[HEADER.size:end])))
            del self._buf[:end]
        return frames

    @property
    def pending_bytes(self) -> int:
        return len(self._buf)
