"""Finding, starting and stopping this build's compile service (the client's side).

    ensure(place) --probe--> Status: a service of this build answers: use it
                  --none, or a stale socket (nobody listens)--> <stamp>.lock (filelock) -->
                      probe again (another process may have started it meanwhile) -->
                      remove the stale socket --> python -m hotswap.service (its own session,
                      stderr to <stamp>.log) --> probe until it answers (START_TIMEOUT_S)

Whatever cannot be used raises: ``UntrustedPath`` (a folder, socket or key another user
could have made), ``PeerRefused`` (the socket's process runs as another uid), ``OtherBuild``
(it serves another stamp), ``NotAnswering`` (it accepts but does not answer: stopped, or
hung), ``StartFailed``. Callers compile in the local pool and say why.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import AuthenticationError
from typing import Any

from filelock import FileLock, Timeout

from hotswap.service.place import Place, authkey, check_socket
from hotswap.service.wire import HANDSHAKE_TIMEOUT_S, connect, decode, encode
from hotswap.system import bytecode

__all__ = ["LOCK_TIMEOUT_S", "START_TIMEOUT_S", "NotAnswering", "OtherBuild", "StartFailed",
           "ensure", "probe", "request", "stop"]

START_TIMEOUT_S = 30.0
LOCK_TIMEOUT_S = 60.0


class NotAnswering(OSError):
    """A service holds the socket but does not answer (stopped with SIGSTOP, or hung)."""


class OtherBuild(RuntimeError):
    """The service at this build's socket serves another build."""


class StartFailed(RuntimeError):
    """A service was started and did not answer within START_TIMEOUT_S, or exited."""


def request(place: Place, key: bytes, message: dict[str, Any],
            timeout_s: float = HANDSHAKE_TIMEOUT_S) -> dict[str, Any]:
    """One request and its reply. ``ConnectionRefusedError``/``FileNotFoundError``: no
    service listens; ``NotAnswering``: none answered within ``timeout_s``."""
    try:
        conn = connect(place.socket, key)
    except (ConnectionRefusedError, FileNotFoundError):
        raise
    except (AuthenticationError, EOFError) as e:
        raise NotAnswering(f"the compile service at {place.socket} failed the key challenge "
                           f"({type(e).__name__}: {e})") from None
    except TimeoutError as e:
        raise NotAnswering(f"the compile service at {place.socket} did not answer in "
                           f"{HANDSHAKE_TIMEOUT_S:g} s ({e})") from None
    except OSError as e:
        if isinstance(e, PermissionError):
            raise
        raise NotAnswering(f"the compile service at {place.socket} did not answer ({e})") from None
    with conn:
        try:
            conn.send_bytes(encode(message))
            if not conn.poll(timeout_s):
                raise NotAnswering(f"the compile service at {place.socket} did not answer in "
                                   f"{timeout_s:g} s")
            return decode(conn.recv_bytes())
        except (EOFError, OSError, ValueError) as e:
            if isinstance(e, NotAnswering):
                raise
            raise NotAnswering(f"the compile service at {place.socket} closed the connection "
                               f"({type(e).__name__}: {e})") from None


def probe(place: Place, key: bytes) -> dict[str, Any] | None:
    """The status of the service on this build's socket; None where there is no socket or
    nobody listens on it (stale). Raises as ``ensure``, ``StartFailed`` aside."""
    if not check_socket(place.socket):
        return None
    try:
        status = request(place, key, {"kind": "status"})
    except (ConnectionRefusedError, FileNotFoundError):
        return None
    if status.get("stamp") != place.stamp:
        raise OtherBuild(f"the compile service at {place.socket} serves build "
                         f"{status.get('stamp')!r}, not this process's {place.stamp!r}")
    return status


def ensure(place: Place, *, first_job_within_s: float | None = None,
           keep: bool = False) -> dict[str, Any]:
    """The status of this build's service, started if none answers. Safe to call from many
    processes at once: one starts it, the others find it. A service started here with
    ``first_job_within_s`` exits after that long if no job comes first; ``keep`` (asked for
    by name, ``hotswap service start``) lifts that limit from one found running, as a
    process importing hotswap starts it, so that it stays until its idle exit."""
    key = authkey(place, create=True)
    status = probe(place, key)
    if status is not None and keep:
        status = _keep(place, key, status)
    if status is not None:
        return status
    try:
        with FileLock(str(place.lock), timeout=LOCK_TIMEOUT_S, mode=0o600):
            status = probe(place, key)
            if status is not None and keep:  # another process started it meanwhile
                status = _keep(place, key, status)
            if status is not None:
                return status
            if check_socket(place.socket):  # nobody listens: stale
                os.unlink(place.socket)
            return _start(place, key, first_job_within_s)
    except Timeout:
        raise StartFailed(f"another process held {place.lock} for {LOCK_TIMEOUT_S:g} s while "
                          "starting the compile service") from None


def _keep(place: Place, key: bytes, status: dict[str, Any]) -> dict[str, Any] | None:
    """``status``'s service without its first-job window (None: it has just exited)."""
    if status.get("first_job_within_s") is None:
        return status
    try:
        return request(place, key, {"kind": "keep"})
    except (NotAnswering, ConnectionRefusedError, FileNotFoundError):
        return None


def _start(place: Place, key: bytes, first_job_within_s: float | None = None
           ) -> dict[str, Any]:
    env = dict(os.environ)
    # The service must import the hotswap this process runs, however it found it.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    # It and its workers read bytecode compiled once where sources would be compiled at every
    # start; its workers inherit the folder.
    env = bytecode.child_env(env)
    with open(place.log, "ab") as log:
        os.chmod(place.log, 0o600)
        first = ([] if first_job_within_s is None
                 else ["--first-job-within-s", f"{first_job_within_s:g}"])
        proc = subprocess.Popen([sys.executable, "-m", "hotswap.service", "--dir",
                                 str(place.dir), "--stamp", place.stamp, *first], cwd=place.dir, env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True, close_fds=True)
    # Reap it when it exits (it outlives this process as often as not).
    threading.Thread(target=proc.wait, daemon=True, name="hotswap-service-reap").start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            status = probe(place, key)
        except NotAnswering:  # it listens and does not answer yet: still starting
            status = None
        if status is not None:
            return status
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    raise StartFailed(f"the compile service did not start (exit code {proc.poll()}); its log: "
                      f"{place.log}: {_tail(place)}")


def _tail(place: Place, lines: int = 5) -> str:
    try:
        text = place.log.read_text(errors="replace")
    except OSError:
        return ""
    return " | ".join(text.strip().splitlines()[-lines:])


def stop(place: Place, timeout_s: float = 10.0) -> dict[str, Any] | None:
    """Ask this build's service to stop and wait until its socket is gone; its last status
    (None: none was running)."""
    try:
        key = authkey(place, create=False)
    except FileNotFoundError:
        return None
    if not check_socket(place.socket):
        return None
    try:
        status = request(place, key, {"kind": "stop"})
    except (ConnectionRefusedError, FileNotFoundError):
        return None
    deadline = time.monotonic() + timeout_s
    while check_socket(place.socket) and time.monotonic() < deadline:
        time.sleep(0.05)
    return status
