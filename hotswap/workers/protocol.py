"""Wire protocol between the pool (parent) and one worker process (child).

Two anonymous pipes per worker, passed to ``python -m hotswap.workers`` with ``pass_fds``::

    parent (pool manager thread)                        child (worker main thread)
    ----------------------------                        --------------------------
    INIT        msgpack {sys_path, warm_modules, ...} ->  sets sys.path, imports warm modules
                                                     <- READY        msgpack {pid, warm_s}
    JOB_REQUEST job name, pickle bytes              ->  unpickles payload, runs job
                                                     <- STAGE_EVENT  msgpack (0..n, while it runs)
                                                     <- JOB_RESULT   sizes, pickle, buffers
                                                     or JOB_FAILED   msgpack {kind, type, message, tb}
    SHUTDOWN    (empty)                              ->  exits 0
                                                     <- WARMING      msgpack {busy} (job id 0:
                                                        a warm-up step begins or ends, any time
                                                        the worker has no job of its own)

Every frame is a fixed 17-byte header (kind: u8, job id: u64, payload length: u64, network
order) followed by the payload. Control messages are msgpack; payloads and results are pickled
bytes that only the job (child) or the waiting future (parent) unpickles. A job request is its
name (u32 length, UTF-8) followed by the pickled payload as it is: large payloads are sent and
received without a copy, since the parent's side runs in the user's process and every copy
holds the GIL. A job result is a table of sizes, its pickle (protocol 5), then the pickle's
out-of-band buffers (``encode_result``), which the parent unpickles as views.

This module imports only the standard library and msgpack: both sides load it before torch.
"""

from __future__ import annotations

import enum
import mmap
import os
import pickle
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

__all__ = [
    "HEADER",
    "Frame",
    "FrameDecoder",
    "MessageKind",
    "Payload",
    "StageEvent",
    "decode_job_request",
    "decode_result",
    "encode_control",
    "encode_frame",
    "encode_job_request",
    "encode_result",
]

HEADER = struct.Struct("!BQQ")
# Payloads from this size on are received into an anonymous mapping, not a bytearray:
# bytearray(n) zero-fills n bytes holding the GIL (17 ms for 22 MB); a mapping's pages are
# zeroed by the kernel as the read fills them, with the GIL released.
_MAPPED_BYTES = 1 << 20
Payload = bytes | bytearray | mmap.mmap | memoryview
_NAME_LEN = struct.Struct("!I")
_COUNT = struct.Struct("!I")
_SIZE = struct.Struct("!Q")
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
    WARMING = 8


class ProtocolError(Exception):
    """The byte stream from a peer cannot be parsed; the peer is treated as crashed."""


@dataclass(frozen=True, slots=True)
class Frame:
    kind: MessageKind
    job_id: int
    payload: Payload  # the decoder hands its buffer over as it is


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
    def from_wire(cls, job_id: int, payload: Payload) -> StageEvent:
        d = decode_control(payload)
        if not (isinstance(d, dict) and isinstance(d.get("name"), str)
                and all(isinstance(d.get(k), int | float) for k in ("start_s", "end_s", "pid"))
                and isinstance(d.get("attrs") or {}, dict)):
            raise ProtocolError(f"not a stage event: {d!r:.200}")
        return cls(d["name"], d["start_s"], d["end_s"], int(d["pid"]), job_id, d.get("attrs") or {})


def encode_control(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def decode_control(payload: Payload) -> Any:
    try:
        return msgpack.unpackb(payload, raw=False)
    except (ValueError, msgpack.UnpackException) as e:  # msgpack's errors for bytes it can't read
        raise ProtocolError(f"unreadable control message: {e!r}") from None


def encode_frame(kind: MessageKind, job_id: int, *parts: bytes | memoryview) -> list[bytes | memoryview]:
    """Header and payload parts as separate buffers: a large payload is never copied to
    prepend 17 B."""
    return [HEADER.pack(kind, job_id, sum(memoryview(p).nbytes for p in parts)), *parts]


def encode_job_request(job: str, data: bytes) -> list[bytes]:
    """A JOB_REQUEST's payload parts: the job's name, then its pickled payload untouched."""
    name = job.encode()
    return [_NAME_LEN.pack(len(name)) + name, data]


def encode_result(result: Any) -> list[bytes | memoryview]:
    """A JOB_RESULT's payload parts: a table of sizes, the pickle (protocol 5), then each
    out-of-band buffer as it is. An object opts in by pickling a ``pickle.PickleBuffer`` of
    its large bytes: they are then neither copied into the pickle here nor out of the frame
    in the parent, where they arrive as a view into the received payload."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(result, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    table = _COUNT.pack(len(raws)) + b"".join(_SIZE.pack(len(part)) for part in (data, *raws))
    return [table, data, *raws]


def decode_result(payload: Payload) -> Any:
    """Unpickle what ``encode_result`` sent; its out-of-band buffers stay in ``payload``."""
    view = memoryview(payload)
    try:
        (count,) = _COUNT.unpack_from(view)
        offset = _COUNT.size + _SIZE.size * (count + 1)
        sizes = [_SIZE.unpack_from(view, _COUNT.size + _SIZE.size * i)[0] for i in range(count + 1)]
    except struct.error as e:
        raise ProtocolError(f"job result shorter than its size table: {e}") from None
    if offset + sum(sizes) != len(view):
        raise ProtocolError("job result sizes do not add up to its length")
    parts = []
    for size in sizes:
        parts.append(view[offset:offset + size])
        offset += size
    return pickle.loads(parts[0], buffers=parts[1:])


def decode_job_request(payload: Payload) -> tuple[str, memoryview]:
    """(job name, pickled payload) of a JOB_REQUEST; the payload is a view, not a copy."""
    view = memoryview(payload)
    if len(view) < _NAME_LEN.size:
        raise ProtocolError("job request shorter than its name's length")
    (n,) = _NAME_LEN.unpack_from(view)
    end = _NAME_LEN.size + n
    if len(view) < end:
        raise ProtocolError("job request shorter than its name")
    try:
        name = bytes(view[_NAME_LEN.size:end]).decode()
    except UnicodeDecodeError as e:
        raise ProtocolError(f"job name is not UTF-8: {e}") from None
    return name, view[end:]


def _receive_buffer(n: int) -> bytearray | mmap.mmap:
    """A writable buffer of ``n`` bytes to read a payload into."""
    return mmap.mmap(-1, n) if n >= _MAPPED_BYTES else bytearray(n)


class FrameDecoder:
    """Incremental decoder: bytes in as they arrive, whole frames out.

    Each payload is assembled in a buffer of its own, sized from its header, and handed out
    as that buffer: no copy of the stream, which would hold the GIL for tens of milliseconds
    on a GPU artifact's tens of MB (a stall in the user's calls, since the pool's manager
    thread runs in the user's process). ``read_from`` has the kernel copy pipe data straight
    into that buffer.
    """

    def __init__(self) -> None:
        self._head = bytearray(HEADER.size)
        self._head_got = 0
        self._frame: tuple[MessageKind, int] | None = None  # header read, payload pending
        self._body: bytearray | mmap.mmap = bytearray()
        self._body_got = 0

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        frames: list[Frame] = []
        view = memoryview(data)
        while view:
            target = self._target()
            n = min(len(target), len(view))
            target[:n] = view[:n]
            view = view[n:]
            frame = self._advance(n)
            if frame is not None:
                frames.append(frame)
        return frames

    def read_from(self, fd: int) -> list[Frame]:
        """One read from ``fd`` into the frame being assembled; the frame, if that finished
        it. Raises EOFError at end of file; OSError (BlockingIOError too) passes through."""
        n = os.readv(fd, [self._target()])
        if n == 0:
            raise EOFError
        frame = self._advance(n)
        return [] if frame is None else [frame]

    def _target(self) -> memoryview:
        if self._frame is None:
            return memoryview(self._head)[self._head_got:]
        return memoryview(self._body)[self._body_got:]

    def _advance(self, n: int) -> Frame | None:
        if self._frame is None:
            self._head_got += n
            if self._head_got < HEADER.size:
                return None
            self._head_got = 0
            kind, job_id, length = HEADER.unpack(self._head)
            if length > MAX_FRAME_BYTES:
                raise ProtocolError(f"frame length {length} is not plausible")
            try:
                message_kind = MessageKind(kind)
            except ValueError as e:
                raise ProtocolError(f"unknown message kind {kind}") from e
            try:
                body = _receive_buffer(length)
            except OSError as e:
                # A corrupted length can still be under MAX_FRAME_BYTES and past what can be
                # mapped: that is the peer's garbage, not a dead pipe (whose OSError would make
                # the pool wait for a live worker to exit).
                raise ProtocolError(f"frame of {length} bytes cannot be received: {e}") from e
            self._frame = (message_kind, job_id)
            self._body, self._body_got = body, 0
            if length:
                return None
        else:
            self._body_got += n
            if self._body_got < len(self._body):
                return None
        (kind, job_id), body = self._frame, self._body
        self._frame, self._body = None, bytearray()
        return Frame(kind, job_id, body)
