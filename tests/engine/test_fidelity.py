"""A tier is what it says: its inductor config takes effect in the worker as in-process
torch.compile applies it, and its artifact loads under it (no kernel rebuilt for other flags)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import hotswap

pytestmark = pytest.mark.slow


def _chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = torch.nn.functional.layer_norm(x, (64,), w)
    return torch.nn.functional.gelu(x).sin() @ w.view(64, 1).expand(64, 8)


def _normalized(codes: list[str]) -> str:
    """The generated wrapper and kernels, without what names differ between two compiles of
    one graph: the graph's number, cache hashes and paths, and the autotuning prelude a
    saveable compile keeps."""
    text = "\n".join(c[c.index("# AOT ID"):] if "# AOT ID" in c else c for c in codes)
    text = re.sub(r"\b[a-z0-9]{52}\b", "HASH", text)
    text = re.sub(r"(graph|AOT ID: \[')_?\d+_", r"\1N_", text)
    return re.sub(r"/\S+/", "PATH/", text)


@pytest.fixture
def cpp_builds(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Kernel libraries this process builds (inductor's CppBuilder.build of a .so)."""
    from torch._inductor import cpp_builder

    built: list[str] = []
    original = cpp_builder.CppBuilder.build

    def build(self: Any) -> Any:
        target = str(self.get_target_file_path())
        if target.endswith(".so"):
            built.append(target)
        return original(self)

    monkeypatch.setattr(cpp_builder.CppBuilder, "build", build)
    yield built


CONFIGS = {
    "vector width": {"cpp.simdlen": 1},
    "max-autotune": {"max_autotune": True},
    "unique kernel names": {"triton.unique_kernel_names": True},
    "codegen flag": {"cpp.enable_kernel_profile": True},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tier_generates_what_torch_compile_generates(name: str, cpp_builds: list[str]) -> None:
    config = CONFIGS[name]
    x, w = torch.randn(32, 64), torch.randn(64)
    compiled = hotswap.compile(_chain, mode="subprocess", workers=1,
                               tiers=[{"name": "tier", "config": config}])
    out, ours = run_and_get_code(compiled, x, w)
    (status,) = hotswap.status(compiled)
    assert status.tier == "tier" and status.path == "worker", status
    # The worker built every kernel library under the tier's flags; loading under the same
    # config finds them (another config would rebuild them for this process's vector ISA).
    assert cpp_builds == []
    torch._dynamo.reset()
    ref, theirs = run_and_get_code(torch.compile(_chain, options=config), x, w)
    assert _normalized(ours) == _normalized(theirs)
    torch.testing.assert_close(out, ref)
    if name == "vector width":
        assert "Vectorized" not in "".join(ours)


@pytest.mark.parametrize("spelling", ["torch.compile", "hotswap.compile"])
def test_options_generate_what_torch_compile_options_generate(spelling: str,
                                                              cpp_builds: list[str]) -> None:
    """``options=`` with inductor keys, as torch.compile users write it, patches the tier's
    config: the same code as ``torch.compile(options=...)`` in this process."""
    options = {"cpp.simdlen": 1, "max_autotune": True}
    x, w = torch.randn(32, 64), torch.randn(64)
    if spelling == "torch.compile":
        compiled = torch.compile(_chain, backend="hotswap", options={
            "mode": "subprocess", "workers": 1, "tiers": ["default"], **options})
    else:
        compiled = hotswap.compile(_chain, mode="subprocess", workers=1, tiers=["default"],
                                   options=options)
    out, ours = run_and_get_code(compiled, x, w)
    (status,) = hotswap.status(compiled)
    assert status.tier == "default" and status.path == "worker", status
    assert cpp_builds == []
    torch._dynamo.reset()
    ref, theirs = run_and_get_code(torch.compile(_chain, options=options), x, w)
    assert _normalized(ours) == _normalized(theirs)
    assert "Vectorized" not in "".join(ours)
    torch.testing.assert_close(out, ref)
