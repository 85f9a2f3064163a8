"""torch's source hash travels with an artifact (source_key.py): the serving process takes its
worker's hash instead of reading every module file of torch, where the same install
computed it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hotswap.engine.loading import source_key


class _Key:
    """inductor's torch_key as a prefetchable_cache: computed once, or set from elsewhere."""

    def __init__(self, value: bytes, *, settable: bool = True,
                 refusal: type[Exception] = RuntimeError) -> None:
        self.value, self.computed, self.refusal = value, 0, refusal
        self.taken: bytes | None = None
        if settable:
            self.set = self._set

    def __call__(self) -> bytes:
        if self.taken is None:
            self.computed += 1
            self.taken = self.value
        return self.taken

    def _set(self, value: bytes) -> None:
        if self.taken is not None:  # 2.13: RuntimeError; 2.11: a failed assert
            raise self.refusal("prefetchable_cache value already set")
        self.taken = value


@pytest.fixture(params=[RuntimeError, AssertionError], ids=["torch 2.13", "torch 2.11"])
def key(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> _Key:
    fake = _Key(b"\x01" * 32, refusal=request.param)
    monkeypatch.setattr(source_key, "_torch_key", lambda: fake)
    monkeypatch.setattr(source_key, "install_id", lambda: "host|/site-packages/torch|2.13")
    return fake


def test_a_workers_hash_is_taken_where_the_install_is_the_same(key: _Key) -> None:
    found = source_key.record()
    assert found == {"torch_key": [(b"\x01" * 32).hex(), "host|/site-packages/torch|2.13"]}
    key.taken = None  # another process: nothing computed there yet
    key.computed = 0
    assert source_key.adopt(found) is False  # a cache entry's: never taken
    with source_key.from_worker():  # the load of a result its worker just compiled
        assert source_key.adopt(found) is True
        assert source_key.adopt(found) is False  # set already: the first answer stands
    assert key() == b"\x01" * 32 and key.computed == 0  # never hashed here


def test_another_install_or_a_malformed_record_is_not_taken(key: _Key) -> None:
    value = (b"\x02" * 32).hex()
    for found in ({}, {"torch_key": [value, "other-host|/site-packages/torch|2.13"]},
                  {"torch_key": [value]}, {"torch_key": "x"},
                  {"torch_key": ["not hex", "host|/site-packages/torch|2.13"]},
                  {"torch_key": ["", "host|/site-packages/torch|2.13"]}):
        with source_key.from_worker():
            assert source_key.adopt(found) is False, found
    assert key() == b"\x01" * 32 and key.computed == 1  # hashed here, as before


def test_a_torch_without_the_setter_hashes_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    old = _Key(b"\x03" * 32, settable=False)
    monkeypatch.setattr(source_key, "_torch_key", lambda: old)
    monkeypatch.setattr(source_key, "install_id", lambda: "host|/site-packages/torch|2.11")
    assert source_key.travels() is False  # the warm-up hashes, as before
    assert source_key.record() == {}
    with source_key.from_worker():
        assert source_key.adopt({"torch_key": [(b"\x04" * 32).hex(),
                                               "host|/site-packages/torch|2.11"]}) is False


def test_a_source_checkout_sends_no_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    source_key.install_id.cache_clear()
    monkeypatch.setattr(torch, "__file__", "/home/dev/pytorch/torch/__init__.py")
    try:
        assert source_key.install_id() == ""
        assert source_key.record() == {}
        assert source_key.travels() is False  # the warm-up hashes, as before
    finally:
        source_key.install_id.cache_clear()


_FRESH = r"""
import json
import torch
import torch._inductor.codecache as codecache
import hotswap

hashed = []
real = codecache.build_code_hash
def counted(*args):
    hashed.append(args[1])
    return real(*args)
codecache.build_code_hash = counted

model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
fast = hotswap.compile(model, mode="async", workers=1)
x = torch.randn(4, 16)
with torch.no_grad():
    fast(x)
    [status] = hotswap.wait(fast, timeout_s=240)
    torch.testing.assert_close(fast(x), model(x))
print(json.dumps({"tier": status.tier, "hashed": hashed, "settable": hasattr(codecache.torch_key, "set"),
                  "key": codecache.torch_key().hex()}))
"""


def test_a_fresh_process_serves_its_first_artifact_without_hashing_torch(tmp_path: Path) -> None:
    """From its worker: the hash comes with the result. From the cache (a second process):
    the load hashes torch itself, so an entry older than a change to torch's files fails its
    own check instead of passing it with its own hash."""
    env = {**os.environ, "HOTSWAP_CACHE_DIR": str(tmp_path / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "HOTSWAP_SERVICE": "off"}
    import torch._inductor.codecache as codecache

    for run in ("worker", "cache"):
        done = subprocess.run([sys.executable, "-c", _FRESH], env=env, capture_output=True,
                              text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["tier"] == "default"
        if not result["settable"]:
            pytest.skip("this torch computes its source hash in every process (no .set)")
        assert result["key"] == codecache.torch_key().hex()  # the very hash this install has
        if run == "worker":
            assert result["hashed"] == []  # build_code_hash never ran in the serving process
        else:
            assert result["hashed"], "a cache entry's hash was taken"
