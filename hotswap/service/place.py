"""Where the compile service lives, which build it serves, and whether its files are ours.

    <dir>/                    mode 0700, this uid's; HOTSWAP_SERVICE_DIR, else
                              $XDG_RUNTIME_DIR/hotswap, else /tmp/hotswap-service-<uid>
        authkey               32 random bytes, mode 0600: both ends prove they hold it
        <stamp>.sock          the service of one build (a Unix socket, mode 0600)
        <stamp>.lock          held while a client starts that service (filelock)
        <stamp>.pid, .log     its pid; its stderr

A service serves one *stamp*: a short hash of what its artifacts depend on (hotswap's source,
torch, triton, Python, ``sys.prefix``, the GPUs it sees, inductor's and triton's environment
variables). A client of another stamp finds another socket, so it never uses that service.

Nothing here is used unless it passes the checks ``hotswap.cache.trust`` makes of a cache:
the folder is this uid's, mode 0700, not a link, and every folder above it is ours or root's
and writable by others only with the sticky bit; the socket and the key are ours and no link.
A failed check raises ``UntrustedPath``; the caller compiles in the local pool and says why.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import stat
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from hotswap import settings
from hotswap.cache.trust import UntrustedPath, check_way, create_secret, read_private

__all__ = ["Place", "UntrustedPath", "authkey", "check_dir", "check_socket", "default_dir",
           "find_place", "stamp", "stamp_fields"]

# What a service's artifacts depend on beside versions: the variables that change what
# inductor and triton make. Where they keep their caches does not: a process with caches of
# its own (a fresh inductor cache folder, say) shares the user's service.
_ENV_PREFIXES = ("TORCHINDUCTOR_", "TRITON_", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
_NOT_IN_STAMP = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_HOME")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def _source_fingerprint() -> str:
    """hotswap's own modules (path, size, mtime): a changed checkout is another build, so a
    service never runs job code older than its client's."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(str(package).encode())
    for path in sorted(package.rglob("*.py")):
        st = path.stat()
        digest.update(f"{path.relative_to(package)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def stamp_fields() -> dict[str, object]:
    """What a service must share with its clients, read without importing torch."""
    gpus = sorted(p.name for p in Path("/dev").glob("nvidia[0-9]*"))
    return {
        "hotswap": _source_fingerprint(),
        "torch": _version("torch"),
        "triton": _version("triton") or _version("pytorch-triton"),
        "python": sys.version,
        "prefix": sys.prefix,
        "gpus": gpus,
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith(_ENV_PREFIXES) and k not in _NOT_IN_STAMP},
    }


def stamp() -> str:
    """The short hash that names this build's service."""
    text = json.dumps(stamp_fields(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Place:
    """The files of the service of ``stamp`` in ``dir``."""

    dir: Path
    stamp: str

    @property
    def socket(self) -> Path:
        return self.dir / f"{self.stamp}.sock"

    @property
    def lock(self) -> Path:
        return self.dir / f"{self.stamp}.lock"

    @property
    def pid_file(self) -> Path:
        return self.dir / f"{self.stamp}.pid"

    @property
    def log(self) -> Path:
        return self.dir / f"{self.stamp}.log"

    @property
    def key(self) -> Path:
        return self.dir / "authkey"


def default_dir() -> Path:
    """HOTSWAP_SERVICE_DIR; else ``$XDG_RUNTIME_DIR/hotswap`` where that folder passes the
    checks; else ``/tmp/hotswap-service-<uid>``."""
    chosen = settings.service_dir()
    if chosen is not None:
        return Path(os.path.abspath(chosen))
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        try:
            check_way(Path(runtime))
            if os.stat(runtime).st_uid == os.geteuid():
                return Path(runtime) / "hotswap"
        except OSError:
            pass
    return Path("/tmp") / f"hotswap-service-{os.geteuid()}"


def check_dir(path: Path, *, create: bool) -> None:
    """``path`` is this uid's folder, mode 0700 (no bit for group or others), not a link, in
    folders others cannot swap (``check_way``). ``create``: make it (0700) if missing."""
    check_way(path.parent)
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedPath(path, "(the compile service's folder) is a symlink",
                            f"remove it (rm {path}); hotswap makes its own")
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedPath(path, "(the compile service's folder) is not a folder",
                            f"remove it (rm {path})")
    if st.st_uid != os.geteuid():
        raise UntrustedPath(path, f"(the compile service's folder) belongs to uid {st.st_uid}, "
                                  f"not to this process's uid {os.geteuid()}",
                            "set HOTSWAP_SERVICE_DIR to a folder of your own")
    if st.st_mode & 0o077:
        raise UntrustedPath(path, f"(the compile service's folder) is open to other users "
                                  f"(mode {st.st_mode & 0o777:o})", f"chmod 700 {path}")


def check_socket(path: Path) -> bool:
    """Whether a service socket is there (False: none); one that is a link, not a socket, or
    another uid's raises ``UntrustedPath``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedPath(path, "(the compile service's socket) is a symlink",
                            f"remove it (rm {path}); hotswap makes its own")
    if not stat.S_ISSOCK(st.st_mode):
        raise UntrustedPath(path, "(the compile service's socket) is not a socket",
                            f"remove it (rm {path})")
    if st.st_uid != os.geteuid():
        raise UntrustedPath(path, f"(the compile service's socket) belongs to uid {st.st_uid}",
                            f"remove it (rm {path})")
    return True


def authkey(place: Place, *, create: bool) -> bytes:
    """The folder's key (made on first use: 32 random bytes, mode 0600), checked as the
    cache's key is: ours, a regular file, no link, readable by us alone."""
    if create:
        create_secret(place.key)
    try:
        key = read_private(place.key, secret=True)
    except OSError as e:
        if isinstance(e, UntrustedPath) or e.errno != errno.ENOENT:
            raise
        raise FileNotFoundError(errno.ENOENT, "no service key (no service started here)",
                                str(place.key)) from None
    if len(key) < 32:
        raise UntrustedPath(place.key, "(the compile service's key) is shorter than 32 bytes",
                            f"remove it (rm {place.key}); hotswap makes a new one")
    return key


def find_place(*, create: bool) -> Place:
    """This build's service place, its folder checked (made, with ``create``)."""
    folder = default_dir()
    check_dir(folder, create=create)
    return Place(folder, stamp())
