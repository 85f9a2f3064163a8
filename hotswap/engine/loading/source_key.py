"""torch's source hash (inductor's ``codecache.torch_key``), taken from the worker that
compiled an artifact instead of computed in the serving process.

Inductor hashes torch's sources once per process (every module file of torch, read and
hashed) and checks every artifact it loads against the hash. In the serving process that cost
0.22 s on the way to a GPT-2 swap (H100), in stretches holding the GIL: a call beside it took
27 ms. The worker that compiled the artifact had computed the same hash of the same files.
Inductor's own compile subprocesses take their parent's hash (``subproc_pool``, through
``torch_key.set``); the serving process takes the one its entry carries in the same way
(``record()`` in the worker, ``adopt()`` before a load), where:

- this torch lets a process set it (``prefetchable_cache``), and this process has not
  computed it yet;
- the entry was compiled by this very install: the same machine, torch directory, version,
  build commit and files' times, and an installed torch (under ``site-packages``), not a
  source checkout whose files change from one process to the next.

Only a worker's result of this process is taken (``from_worker``), never a cache entry: an
entry may be older than a change to torch's files, and the hash is what catches that at its
load (taken from a stale entry, it would pass that entry and fail every fresh one after it).
Where no hash can travel (a source checkout, a torch without the setter), the load-path
warm-up hashes as before (``travels()``); an entry from another machine leaves the hash to
its first load.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["adopt", "from_worker", "install_id", "record", "travels"]


@functools.cache
def install_id() -> str:
    """Which torch install this process runs, and on which machine ("" where torch is not an
    installed package: then no hash travels)."""
    import torch

    root = os.path.dirname(os.path.realpath(torch.__file__))
    if os.path.basename(os.path.dirname(root)) not in ("site-packages", "dist-packages"):
        return ""
    try:
        times = [os.stat(os.path.join(root, name)).st_mtime_ns
                 for name in ("__init__.py", "version.py")]
    except OSError:
        return ""
    return "|".join(map(str, (socket.gethostname(), root, torch.__version__,
                              torch.version.git_version, *times)))


def _torch_key() -> Any:
    from torch._inductor import codecache

    return getattr(codecache, "torch_key", None)


def travels() -> bool:
    """Whether a worker's hash can be taken here: this torch takes one from elsewhere and is
    an installed package (else each process computes its own)."""
    return hasattr(_torch_key(), "set") and bool(install_id())


_fresh = threading.local()


@contextlib.contextmanager
def from_worker() -> Iterator[None]:
    """Around the load of a result this process's worker just compiled: ``adopt`` may take
    its hash (a cache entry's is never taken)."""
    _fresh.on = True
    try:
        yield
    finally:
        _fresh.on = False


def record() -> dict[str, Any]:
    """Workers: this process's hash and install, for the probes an entry carries ({} where
    there is none to send)."""
    if not travels():
        return {}
    value = _torch_key()()
    return {"torch_key": [value.hex(), install_id()]} if isinstance(value, bytes) else {}


def adopt(found: dict[str, Any]) -> bool:
    """Take the hash of an entry's probes (``record()``) as this process's own, where the same
    install computed it and this process has none yet. False: nothing taken (none there,
    computed here already, another install, or a torch without the setter)."""
    if not getattr(_fresh, "on", False):
        return False  # a cache entry, or a load outside from_worker()
    pair, install = found.get("torch_key"), install_id()
    if not (install and isinstance(pair, list) and len(pair) == 2
            and all(isinstance(x, str) for x in pair) and pair[1] == install):
        return False
    try:
        value = bytes.fromhex(pair[0])
    except ValueError:
        return False
    setter = getattr(_torch_key(), "set", None)
    if setter is None or not value:
        return False
    try:
        setter(value)
    except Exception:  # computed (or taken) here already: 2.13 raises RuntimeError, 2.11
        return False   # fails an assert; a load never fails for a hash it did not take
    return True
