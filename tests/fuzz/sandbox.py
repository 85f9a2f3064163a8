"""A cache next to a folder that is not the cache's, and checks that the fuzz touched neither
more than it may: the folder beside it never, the cache not at all where only reads ran."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hotswap.cache import ArtifactCache
from hotswap.cli import main

STAMP = {"torch": "fuzz", "gpus": []}
KEY = "ab" + "c" * 62
OTHER_KEY = "cd" + "e" * 62


def tree(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every path under ``root`` (links not followed): its mode, size and content digest."""
    found: dict[str, tuple[int, int, str]] = {}
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(folder, name)
            st = path.lstat()
            digest = "" if path.is_dir() or path.is_symlink() else hashlib.sha256(
                path.read_bytes()).hexdigest()
            found[str(path.relative_to(root))] = (st.st_mode, st.st_size, digest)
    return found


@dataclass
class Sandbox:
    base: Path
    cache: ArtifactCache

    @property
    def root(self) -> Path:
        return self.base / "cache"

    def outside(self) -> tuple[list[str], dict[str, tuple[int, int, str]]]:
        """What the fuzz may never change: the folder holding the cache, and a folder beside it."""
        return sorted(os.listdir(self.base)), tree(self.base / "beside")

    @contextlib.contextmanager
    def unchanged_outside(self) -> Iterator[None]:
        before = self.outside()
        yield
        assert self.outside() == before

    def write_entry(self, key: str, data: bytes, mode: int = 0o600) -> Path:
        path = self.cache.entry_path(key)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(path, mode)  # past the umask
        return path

    def cli(self, *args: str) -> int:
        """``hotswap cache ARGS`` on this cache: its exit status, after checking that it wrote
        no traceback and, for the commands that only read, changed nothing in the cache."""
        before = tree(self.root)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(["cache", *args, "--cache-dir", str(self.root)])
        assert status in (0, 1, 2), status
        assert "Traceback" not in err.getvalue() + out.getvalue()
        if status == 2:
            assert err.getvalue().strip(), "exit 2 without a message"
        if args[0] in ("ls", "stats", "verify") and "--remove" not in args:
            assert tree(self.root) == before, f"cache {args[0]} wrote in the cache"
        return status


def make_sandbox(base: Path, **kwargs: object) -> Sandbox:
    (base / "beside").mkdir()
    (base / "beside" / "notes.txt").write_text("not the cache's\n")
    (base / "beside" / "deeper").mkdir()
    (base / "beside" / "deeper" / "data.bin").write_bytes(bytes(range(256)))
    return Sandbox(base, ArtifactCache(base / "cache", stamp=STAMP, **kwargs))  # type: ignore[arg-type]
