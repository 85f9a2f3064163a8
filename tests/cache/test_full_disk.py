"""A warm start on a full disk: the cached tier loads, and nothing is left behind.

The disk holds the artifact cache, inductor's cache and TMPDIR. A first process compiles into
them; the disk is then filled, and a second process must reach the compiled tier from the
cache without writing, leaving no temporary file (hotswap's ``.tmp-``/``.hotswap-``, nor
inductor's ``.<pid>.<thread>.tmp``). The disk is a small tmpfs where this process may mount
one (root); otherwise, and always as a second case, writes under the folder are refused with
ENOSPC inside the warm process (opening a new file, or one to rewrite, for writing).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# HOTSWAP_TEST_FULL_DIR set: every write under it fails as on a full disk (injected).
SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    full = os.environ.get("HOTSWAP_TEST_FULL_DIR")
    if full:
        def refuse(event, args):
            if event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
                return
            path, mode, flags = os.fsdecode(args[0]), args[1], args[2] or 0
            if not os.path.abspath(path).startswith(full + os.sep):
                return
            if isinstance(mode, str):
                writes = any(c in mode for c in "wax+")
                new = "w" in mode or "x" in mode or not os.path.exists(path)
            else:
                writes = bool(flags & (os.O_WRONLY | os.O_RDWR))
                tmpfile = getattr(os, "O_TMPFILE", 0)
                new = (bool(flags & os.O_TRUNC) or (tmpfile and flags & tmpfile == tmpfile)
                       or (bool(flags & os.O_CREAT) and not os.path.exists(path)))
            if writes and new:
                raise OSError(28, "No space left on device (injected)", path)
        sys.addaudithook(refuse)
    import torch, hotswap
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    with hotswap.counters_delta() as d:
        compiled = hotswap.compile(model, mode="async", workers=1)
        compiled(x)
        [status] = hotswap.wait(compiled, timeout_s=240)
        out = compiled(x)
    print(json.dumps({"tier": status.tier, "ok": bool(torch.allclose(out, model(x), atol=1e-5)),
                      "delta": dict(d), "failures": [list(f) for f in status.failures]}))
    """
)


def _run(disk: Path, *, inject: bool = False) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOTSWAP_CACHE_DIR": str(disk / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(disk / "inductor"), "TMPDIR": str(disk / "tmp")}
    if inject:
        env["HOTSWAP_TEST_FULL_DIR"] = str(disk)
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[None]:
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _fill(disk: Path) -> None:
    """Take every free block of the file system that holds ``disk``."""
    free = os.statvfs(disk)
    with open(disk / "filler", "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            os.posix_fallocate(f.fileno(), 0, free.f_bavail * free.f_frsize)
        f.seek(0, os.SEEK_END)
        try:
            while f.write(b"\0" * 4096):
                pass
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    assert os.statvfs(disk).f_bavail == 0


def _leftovers(disk: Path) -> list[str]:
    return sorted(str(p.relative_to(disk)) for p in disk.rglob("*")
                  if p.name.startswith((".tmp-", ".hotswap-", ".key-")) or p.name.endswith(".tmp"))


def _warm_start_on_a_full_disk(disk: Path, *, inject: bool) -> None:
    for name in ("cache", "inductor", "tmp"):
        (disk / name).mkdir()
    cold = _run(disk)
    assert cold["tier"] == "default" and cold["ok"], cold
    if not inject:
        _fill(disk)
    warm = _run(disk, inject=inject)
    assert warm["tier"] == "default" and warm["ok"] and not warm["failures"], warm
    assert warm["delta"]["cache_hits"] == 1, warm  # type: ignore[index]
    assert warm["delta"]["worker_compiles"] == 0, warm  # type: ignore[index]
    assert _leftovers(disk) == []


def test_warm_start_on_a_full_tmpfs(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    # inductor's precompiled header takes about 150 MB of it twice: where inductor keeps it
    # (under TMPDIR) and in the cold run's cache entry (stored once, shared/)
    with _tmpfs(disk, "512m"):
        _warm_start_on_a_full_disk(disk, inject=False)


def test_warm_start_with_every_write_refused(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    _warm_start_on_a_full_disk(disk, inject=True)
