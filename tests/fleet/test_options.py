"""The fleet's options: bad values fail at compile() naming the fix; worker GPUs as a
permutation of this process's."""

from __future__ import annotations

import pytest

from hotswap.engine.options import Options
from hotswap.engine.runtime import visible_devices


@pytest.mark.parametrize(("options", "message"), [
    ({"executor": "http://host:8786"}, "executor must be 'local', a Dask scheduler address"),
    ({"executor": 3}, "executor must be 'local'"),
    ({"cache_url": "/tmp/cache"}, "cache_url must be a Redis URL"),
    ({"worker_devices": ["cpu"]}, "worker_devices takes GPUs as 'cuda:N'"),
    ({"worker_devices": "cuda"}, "worker_devices takes GPUs as 'cuda:N'"),
    ({"worker_devices": [1]}, "worker_devices must be a list"),
])
def test_bad_fleet_options_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Options.create(**options)


def test_fleet_options_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSWAP_EXECUTOR", "dask://scheduler:8786")
    monkeypatch.setenv("HOTSWAP_CACHE_URL", "redis://redis:6379/1")
    monkeypatch.setenv("HOTSWAP_WORKER_DEVICES", "cuda:1, cuda:2")
    options = Options.create()
    assert options.executor == "dask://scheduler:8786"
    assert options.cache_url == "redis://redis:6379/1"
    assert options.worker_devices == ("cuda:1", "cuda:2")
    assert Options.create(executor="local").executor is None
    monkeypatch.setenv("HOTSWAP_EXECUTOR", "nowhere")
    with pytest.raises(ValueError, match="got 'nowhere'"):
        Options.create()


def test_a_worker_gpu_is_swapped_with_the_serving_one() -> None:
    assert visible_devices("cuda:1", None, 2) == "1,0"
    assert visible_devices("cuda:2", None, 4) == "2,1,0,3"
    assert visible_devices("cuda:1", "4,5", 8) == "5,4"  # this process's own numbering
    with pytest.raises(ValueError, match="sees 2 GPU"):
        visible_devices("cuda:3", None, 2)
