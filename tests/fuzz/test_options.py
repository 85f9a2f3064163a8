"""Fuzz: any value for each option of ``Options.create``, ``hotswap.compile`` and the
``torch.compile(backend="hotswap", options=...)`` entry point, and any ``HOTSWAP_*`` value.

A value hotswap cannot take is the user's own error: ``ValueError``, ``TypeError`` or
``LookupError`` with a message, never an internal one (AttributeError, AssertionError,
OverflowError...). No compile starts: the backends are stand-ins once the options are built.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import hotswap
from hotswap.engine import api
from hotswap.engine.options import Options
from tests.fuzz.cases import count

USER_ERRORS = (ValueError, TypeError, LookupError)
FIELDS = sorted([*Options.__dataclass_fields__, "options"])

leaves = (st.none() | st.booleans() | st.integers() | st.integers(-2**70, 2**70).map(lambda n: n * 10**300)
          | st.floats() | st.text(max_size=20) | st.binary(max_size=8))
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=3)
                      | st.lists(inner, max_size=3).map(tuple)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=10)
# Values near the valid ones for each option, so that checks past the first are reached.
near = {
    "mode": st.sampled_from(["inprocess", "subprocess", "async", "progressive", "", "Async"]),
    "tiers": st.one_of(
        st.sampled_from(["default", "default,max-autotune", "max-autotune,", ",", "reduce-overhead"]),
        st.lists(st.sampled_from(["default", "max-autotune", "nope"]) | st.fixed_dictionaries(
            {"name": st.text(max_size=6) | values},
            optional={"config": st.dictionaries(st.sampled_from(
                ["max_autotune", "cpu_gpu_bw", "min_overlap_ratio", "nonexistent_key", "debug"]),
                values, max_size=2) | values, "cudagraphs": values}), max_size=3)),
    "workers": st.integers(-2, 2**70),
    "timeout_s": st.floats() | st.integers(-1, 2**70) | st.just(10**400),
    "gate_threshold": st.floats() | st.just(10**400),
    "cache_dir": st.text(max_size=20),
    "profile_dir": st.text(max_size=20),
    "force_tier": st.sampled_from(["default", "max-autotune", "x"]),
    "executor": st.sampled_from(["local", "dask://h:1", "tcp://h:1", "http://h"]),
    "cache_url": st.sampled_from(["redis://h:1/0", "rediss://h", "unix:///s", "http://h"]),
    "worker_devices": st.sampled_from(["cuda:0", "cuda:0,cuda:1", "cpu", "cuda:", "cuda:x"])
    | st.lists(st.text(max_size=6), max_size=2),
    # inductor config keys (nested, dashed, mistyped) and hotswap's own names
    "options": st.dictionaries(st.sampled_from(
        ["max_autotune", "max-autotune", "triton.cudagraphs", "cpp.simdlen", "epilogue_fusion",
         "max_autotun", "mode", "tiers", "options", ""]), values, max_size=3) | values,
}
options = st.dictionaries(st.sampled_from([*FIELDS, "nope"]), values, max_size=4) | st.fixed_dictionaries(
    {}, optional={name: near.get(name, values) for name in FIELDS})


def _user_error(e: BaseException) -> None:
    assert isinstance(e, USER_ERRORS), f"{type(e).__name__}: {e}"
    assert str(e).strip(), f"{type(e).__name__} without a message"


@given(kwargs=options)
@example(kwargs={"timeout_s": 10**400})
@example(kwargs={"tiers": [{"name": "t", "config": {"min_overlap_ratio": 10**400}}]})
def test_options_create(kwargs: dict[str, Any]) -> None:
    count("options")
    try:
        made = Options.create(**kwargs)
    except Exception as e:
        _user_error(e)
    else:
        assert made.plan and made.tiers and made.limit_s() > 0


class _Backend:
    """Stands in for a coordinator: the options were built, nothing compiles."""

    def __init__(self, options: Options, *args: Any) -> None:
        self.options = options
        self.reset_by_dynamo = False

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return gm.forward


@pytest.fixture(scope="module")
def no_compiles() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(api, "Coordinator", _Backend)
        m.setattr(api, "_shared", {})
        m.setattr(api, "_entry_point", {})
        yield


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@given(kwargs=options)
def test_compile(no_compiles: None, kwargs: dict[str, Any]) -> None:
    count("options")
    try:
        compiled = hotswap.compile(_identity, **kwargs)
    except Exception as e:
        _user_error(e)
    else:
        assert callable(compiled)


# torch.compile's options: hotswap's names and inductor's in one dict
torch_options = st.dictionaries(st.sampled_from(
    [*FIELDS, "max_autotune", "triton.cudagraphs", "cpp.simdlen", "max_autotun"]),
    values, max_size=4)


@given(opts=options | torch_options | values, mode=st.none() | st.sampled_from(
    ["default", "max-autotune", "reduce-overhead", "async", "nope"]))
def test_torch_compile_entry_point(no_compiles: None, opts: Any, mode: str | None) -> None:
    count("options")
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    try:
        fn = api.hotswap_backend(gm, [torch.ones(2)], options=opts, mode=mode)
    except Exception as e:
        _user_error(e)
    else:
        assert callable(fn)


ENV = ["HOTSWAP_MODE", "HOTSWAP_TIERS", "HOTSWAP_WORKERS", "HOTSWAP_CACHE_DIR",
       "HOTSWAP_TIMEOUT_S", "HOTSWAP_GATE_THRESHOLD", "HOTSWAP_PROFILE_DIR", "HOTSWAP_EXECUTOR",
       "HOTSWAP_CACHE_URL", "HOTSWAP_WORKER_DEVICES", "HOTSWAP_WORKER_NICE", "HOTSWAP_WORKER_IDLE",
       "HOTSWAP_WORKER_RSS_LIMIT_BYTES", "HOTSWAP_CACHE_MAX_BYTES", "HOTSWAP_SWITCH_INTERVAL_S",
       "HOTSWAP_LOG", "HOTSWAP_WORKER_IDLE_EXIT_S", "HOTSWAP_CLAIM_TTL_S", "HOTSWAP_GC_FREEZE",
       "HOTSWAP_WORKER_YIELD", "HOTSWAP_START_EARLY", "HOTSWAP_EAGER_THREADS"]
# What an environment variable can hold: text without NUL (and without lone surrogates).
env_text = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"),
                   max_size=24)
env_values = env_text | st.sampled_from(
    ["1", "0", "-1", "1e999", "nan", "inf", " 2 ", "0x10", "1_000", "\u0661", "9" * 5000, "info", "off",
     "default,max-autotune", "cuda:0", "0.5", "async", "caller", "all"])


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.startswith("HOTSWAP_")}
    for k in saved:
        del os.environ[k]
    os.environ.update(env)
    try:
        yield
    finally:
        for k in env:
            os.environ.pop(k, None)
        os.environ.update(saved)


@given(env=st.dictionaries(st.sampled_from(ENV), env_values, max_size=4))
def test_environment(env: dict[str, str]) -> None:
    count("HOTSWAP_* environment")
    with _environment(env):
        try:
            Options.create()
        except Exception as e:
            _user_error(e)
