"""``options=`` as torch.compile users write it: inductor config keys, applied to every tier as
torch applies them to its compile (over its mode's presets), beside hotswap's own options."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import hotswap
from hotswap.engine.coordinator import Coordinator
from hotswap.engine.options import Options, Tier
from hotswap.testing.fake import FakeCompiler
from tests.engine.models import mlp
from tests.engine.test_torch_habits import _value_error


def test_inductor_keys_patch_every_tier_and_win_over_a_tiers_own() -> None:
    """As torch applies options after its mode's presets: a key both set is the options'."""
    made = Options.create(mode="progressive", tiers=["default", "max-autotune"],
                          options={"max_autotune": False, "epilogue-fusion": False})
    assert made.tiers == (
        Tier("default", {"max_autotune": False, "epilogue_fusion": False}),
        Tier("max-autotune", {"max_autotune": False, "coordinate_descent_tuning": True,
                              "epilogue_fusion": False}))


def test_torch_cudagraphs_key_makes_every_tier_serve_through_cuda_graphs() -> None:
    """Inductor loads artifacts with CUDA graphs off; hotswap captures them after the swap,
    as for the reduce-overhead preset (whose tier is the same)."""
    made = Options.create(tiers=["default", "reduce-overhead"],
                          options={"triton.cudagraphs": True})
    assert [(t.config, t.cudagraphs) for t in made.tiers] == [({}, True), ({}, True)]
    off = Options.create(tiers=["reduce-overhead"], options={"triton.cudagraphs": False})
    assert not off.tiers[0].cudagraphs


def test_an_autotuning_option_gives_every_tier_the_autotuning_time_limit() -> None:
    made = Options.create(mode="async", tiers=["default"], options={"max_autotune": True})
    plain = Options.create(mode="async", tiers=["default"])
    assert made.limit_s(made.tiers[0]) == 3 * plain.limit_s(plain.tiers[0])


def test_no_option_of_hotswap_is_spelled_like_an_inductor_config_key() -> None:
    """torch.compile(backend="hotswap", options=...) reads hotswap's names first: no inductor
    key may be shadowed by one (on whichever torch runs the tests)."""
    from torch._inductor import config

    assert set(Options.__dataclass_fields__) & set(config.get_config_copy()) == set()


@pytest.mark.parametrize(("options", "closest"), [
    ({"max_autotun": True}, "max_autotune"),
    ({"triton.cudagraph": True}, "triton.cudagraphs"),
    ({"wokers": 2}, "workers"),
])
def test_an_unknown_key_names_the_closest_one_and_the_tiers_form(options: dict[str, Any],
                                                                 closest: str) -> None:
    model, inputs = mlp()
    compiled = torch.compile(model, backend="hotswap", options=options)
    with pytest.raises(Exception) as info:
        compiled(*inputs)
    error = _value_error(info.value)
    assert error is not None, info.value
    assert f"did you mean {closest!r}" in str(error)
    assert "tiers=[{'name': ..., 'config': {" in str(error)


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"options": {"mode": "async"}}, "pass it as mode=..."),
    ({"options": {"max_autotune": "yes"}}, "'max_autotune' takes a bool"),
    ({"options": ["max_autotune"]}, "options must be a dict"),
])
def test_hotswap_compile_options_take_inductor_keys_only(kwargs: dict[str, Any],
                                                         needle: str) -> None:
    with pytest.raises(ValueError) as info:
        hotswap.compile(torch.nn.Linear(2, 2), **kwargs)
    assert needle in str(info.value)


def test_an_entry_compiled_under_other_options_is_never_served(tmp_path: Path) -> None:
    """The options are in the tier's config, so in its cache key."""
    def run(options: dict[str, Any] | None) -> dict[str, int]:
        fake = FakeCompiler()
        torch._dynamo.reset()
        model, inputs = mlp()
        backend = Coordinator(Options.create(mode="async", tiers=["default"],
                                             cache_dir=str(tmp_path), options=options),
                              compiler=fake, measure=fake.measure)
        compiled = torch.compile(model, backend=backend)
        with hotswap.counters_delta() as d:
            torch.testing.assert_close(compiled(*inputs), model(*inputs))
            [status] = backend.wait(timeout_s=30)
        assert status.tier == "default", status
        return {"hits": d["cache_hits"], "compiles": len(fake.compiles)}

    assert run(None) == {"hits": 0, "compiles": 1}
    assert run({"epilogue_fusion": False}) == {"hits": 0, "compiles": 1}
    assert run({"epilogue_fusion": False}) == {"hits": 1, "compiles": 0}
    assert run(None) == {"hits": 1, "compiles": 0}


def test_hotswap_compile_and_the_entry_point_take_the_same_inductor_options() -> None:
    """Both reach their tier with the options in its config (the fidelity test compares the
    generated code with torch.compile's)."""
    model, inputs = mlp()
    options = {"epilogue_fusion": False}
    ours = hotswap.compile(model, mode="subprocess", workers=1, tiers=["default"],
                           options=options)
    torch.testing.assert_close(ours(*inputs), model(*inputs))
    torch._dynamo.reset()
    theirs = torch.compile(model, backend="hotswap",
                           options={"mode": "subprocess", "workers": 1, "tiers": ["default"],
                                    **options})
    with hotswap.counters_delta() as d:
        torch.testing.assert_close(theirs(*inputs), model(*inputs))
    assert [s.tier for s in hotswap.status(theirs)] == ["default"]
    assert d["cache_hits"] == 1  # the same tier config, so the same entry
