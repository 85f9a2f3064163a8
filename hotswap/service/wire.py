"""What crosses the compile service's socket, and how a connection is opened.

    client                                             service (same uid)
      connect(<dir>/<stamp>.sock) --SO_PEERCRED: the service's uid is ours?
                                      accept() -- SO_PEERCRED: the client's uid is ours?
      <--- multiprocessing.connection's HMAC challenge, both ways (the folder's authkey) --->
      JobRequest / StatusRequest / StopRequest --->
      <--- JobResult | JobFailed | Refused | Status (one reply; then the service closes)
      (closing the connection before the reply cancels the job)

One connection per request: a job's connection is its handle, so a client that dies or
cancels closes it and the service cancels the job; a service that dies closes it and the
client sends the job elsewhere. ``multiprocessing.connection`` frames the messages and runs
the challenge; hotswap adds no RPC of its own. Control fields are msgpack; a job's payload
and result are pickles, as the local pool ships them, sent only between processes of one uid
that both hold the key: the service never unpickles a payload (its worker does), and a client
unpickles a result only from a service whose uid it checked.

A JobResult is its msgpack header after a 4-byte length, then the result as the local pool
frames one (``workers.protocol.encode_result``: the pickle, then its large bytes out of band),
so that the client's copy of the artifact is the one it read from the socket: unpacked from
a msgpack field and then unpickled, a GPU artifact was copied twice more, each copy one C
call holding the client's GIL beside the user's calls. Every other message is msgpack alone
(whose first byte is never 0, as a 4-byte length of a header under 16 MB's is).
"""

from __future__ import annotations

import os
import socket
import struct
import traceback
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any

import msgpack

from hotswap.errors import (
    CompileFailed,
    JobTimeout,
    MemoryLimitExceeded,
    PoolClosed,
    SerializationFailed,
    WorkerCrashed,
    WorkerStartFailed,
    WorkerStopped,
)
from hotswap.workers.protocol import encode_result as encode_frame_result

__all__ = ["HANDSHAKE_TIMEOUT_S", "PeerRefused", "accept", "connect", "decode", "decode_reply",
           "encode", "encode_result", "error_from_wire", "error_to_wire", "peer_uid",
           "set_timeout"]

# How long either end waits for the other through the challenge: a stopped service (SIGSTOP)
# still accepts connections into its backlog, and must not hold a client longer.
HANDSHAKE_TIMEOUT_S = 5.0


class PeerRefused(PermissionError):
    """The process at the other end of the socket runs as another uid."""


def encode(message: dict[str, Any]) -> bytes:
    data: bytes = msgpack.packb(message, use_bin_type=True)
    return data


def decode(data: bytes | memoryview) -> dict[str, Any]:
    message = msgpack.unpackb(data, raw=False)
    if not isinstance(message, dict) or not isinstance(message.get("kind"), str):
        raise ValueError("not a hotswap service message")
    return message


_RESULT_HEAD = struct.Struct("!I")


def encode_result(header: dict[str, Any], result: Any) -> bytes:
    """A JobResult: ``header`` (msgpack) and ``result`` framed as the local pool frames one;
    its large bytes go out of band where it holds them as ``pickle.PickleBuffer``."""
    head = encode(header)
    if len(head) >= 1 << 24:  # its length's first byte would not be 0: read as msgpack
        raise ValueError(f"a job result's header of {len(head)} bytes (16 MiB at most)")
    return b"".join([_RESULT_HEAD.pack(len(head)), head, *encode_frame_result(result)])


def decode_reply(data: bytes) -> tuple[dict[str, Any], memoryview | None]:
    """A reply's message, and for a JobResult the view of ``data`` its result is framed in
    (``workers.protocol.decode_result`` reads it; its out-of-band bytes stay in ``data``)."""
    view = memoryview(data)
    if len(view) >= _RESULT_HEAD.size and view[0] == 0:
        (n,) = _RESULT_HEAD.unpack_from(view)
        end = _RESULT_HEAD.size + n
        if end > len(view):
            raise ValueError("a job result shorter than its header")
        return decode(view[_RESULT_HEAD.size:end]), view[end:]
    return decode(data), None


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (Linux's SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def set_timeout(fd: int, timeout_s: float | None) -> None:
    """A kernel time limit on each read and write of a blocking socket (None: none), so that
    ``Connection``'s blocking calls end with an OSError instead of waiting for good."""
    seconds = 0.0 if timeout_s is None else timeout_s
    value = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    with socket.socket(fileno=os.dup(fd)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def _handshake(sock: socket.socket, key: bytes, *, server: bool) -> Connection[bytes, bytes]:
    sock.setblocking(True)
    set_timeout(sock.fileno(), HANDSHAKE_TIMEOUT_S)
    conn: Connection[bytes, bytes] = Connection(sock.detach())
    try:
        if server:
            deliver_challenge(conn, key)
            answer_challenge(conn, key)
        else:
            answer_challenge(conn, key)
            deliver_challenge(conn, key)
    except BaseException:
        conn.close()
        raise
    set_timeout(conn.fileno(), None)
    return conn


def connect(path: Path, key: bytes) -> Connection[bytes, bytes]:
    """A connection to the service at ``path``, checked: its uid is ours (``PeerRefused``),
    it holds the key (``AuthenticationError``), it answered within HANDSHAKE_TIMEOUT_S
    (``OSError``). A socket nobody listens on raises ``ConnectionRefusedError``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        sock.connect(str(path))
        uid = peer_uid(sock)
        if uid != os.geteuid():
            raise PeerRefused(f"the process serving {path} runs as uid {uid}, not as this "
                              f"process's uid {os.geteuid()}")
        return _handshake(sock, key, server=False)
    except BaseException:
        sock.close()
        raise


def accept(sock: socket.socket, key: bytes) -> Connection[bytes, bytes]:
    """The service's side of a new connection ``sock``: its uid is ours (``PeerRefused``),
    and it holds the key."""
    uid = peer_uid(sock)
    if uid != os.geteuid():
        sock.close()
        raise PeerRefused(f"a process of uid {uid} connected; only uid {os.geteuid()} may")
    return _handshake(sock, key, server=True)


# ---------------------------------------------------------------------- errors on the wire

def error_to_wire(error: BaseException, job: str) -> dict[str, Any]:
    """A pool error as plain fields (exceptions with their own ``__init__`` do not pickle
    back as they were)."""
    if isinstance(error, CompileFailed):
        return {"type": "CompileFailed", "job": error.job, "remote_type": error.remote_type,
                "remote_message": error.remote_message, "traceback": error.remote_traceback}
    if isinstance(error, SerializationFailed):
        return {"type": "SerializationFailed", "job": error.job, "what": error.what,
                "where": error.where, "detail": error.detail}
    if isinstance(error, WorkerStopped):
        return {"type": "WorkerStopped", "job": error.job, "pid": error.pid,
                "stopped_pid": error.stopped_pid}
    if isinstance(error, WorkerCrashed):
        return {"type": "WorkerCrashed", "job": error.job, "pid": error.pid,
                "exitcode": error.exitcode, "signal_name": error.signal_name}
    if isinstance(error, JobTimeout):
        return {"type": "JobTimeout", "job": error.job, "timeout_s": error.timeout_s,
                "pid": error.pid}
    if isinstance(error, MemoryLimitExceeded):
        return {"type": "MemoryLimitExceeded", "job": error.job, "pid": error.pid,
                "rss_bytes": error.rss_bytes, "rss_limit_bytes": error.rss_limit_bytes}
    if isinstance(error, WorkerStartFailed):
        return {"type": "WorkerStartFailed", "attempts": error.attempts, "detail": error.detail}
    if isinstance(error, PoolClosed):
        return {"type": "PoolClosed", "message": str(error)}
    text = "".join(traceback.format_exception(error))
    return {"type": "CompileFailed", "job": job,
            "remote_type": f"{type(error).__module__}.{type(error).__qualname__}",
            "remote_message": str(error), "traceback": text}


def error_from_wire(fields: dict[str, Any]) -> BaseException:
    kind, job = fields.get("type"), str(fields.get("job", ""))
    if kind == "SerializationFailed":
        return SerializationFailed(job, fields["what"], fields["where"], fields["detail"])
    if kind == "WorkerStopped":
        return WorkerStopped(fields["pid"], fields["stopped_pid"], job=job)
    if kind == "WorkerCrashed":
        return WorkerCrashed(fields["pid"], fields["exitcode"], fields["signal_name"], job=job)
    if kind == "JobTimeout":
        return JobTimeout(fields["timeout_s"], fields["pid"], job=job)
    if kind == "MemoryLimitExceeded":
        return MemoryLimitExceeded(fields["pid"], fields["rss_bytes"], fields["rss_limit_bytes"],
                                   job=job)
    if kind == "WorkerStartFailed":
        return WorkerStartFailed(fields["attempts"], fields["detail"])
    if kind == "PoolClosed":
        return PoolClosed(str(fields.get("message", "the compile service's pool was closed")))
    return CompileFailed(job, str(fields.get("remote_type", "?")),
                         str(fields.get("remote_message", "")), str(fields.get("traceback", "")))
