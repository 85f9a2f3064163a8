"""Everything that differs between the torch versions hotswap supports (2.11 and 2.13).

Both expose ``torch._inductor.standalone_compile(gm, inputs, dynamic_shapes=..., options=...)``
and ``CompiledArtifact.save/load(path=..., format="binary")``; keep version checks here.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["TORCH_VERSION", "artifact_from_bytes", "artifact_to_bytes", "standalone_compile"]

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def standalone_compile(gm: torch.fx.GraphModule, inputs: list[Any],
                       config_patches: dict[str, Any], *, dynamic: bool = False) -> Any:
    """Compile for saving. ``dynamic``: the graph's placeholders carry symbolic fake values.

    Training graphs must lower their backward now, while the artifact recorder runs: 2.13's
    standalone_compile forces that itself; on 2.11 the backward is lowered lazily (on GPU) and
    the saved artifact has no AOTAutograd entry, so force it here where the flag exists.
    """
    from torch._functorch import config as functorch_config
    from torch._inductor import standalone_compile as compile_

    patches = {}
    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        patches["force_non_lazy_backward_lowering"] = True
    with functorch_config.patch(patches):
        return compile_(gm, inputs,
                        dynamic_shapes="from_graph" if dynamic else "from_example_inputs",
                        options={"config_patches": dict(config_patches)})


def compile_saveable(gm: torch.fx.GraphModule, inputs: list[Any],
                     config_patches: dict[str, Any], *, dynamic: bool = False) -> bytes:
    return artifact_to_bytes(standalone_compile(gm, inputs, config_patches, dynamic=dynamic))


def artifact_to_bytes(artifact: Any) -> bytes:
    with tempfile.TemporaryDirectory(prefix="hotswap-art-") as tmp:
        path = os.path.join(tmp, "artifact.bin")
        artifact.save(path=path, format="binary")
        with open(path, "rb") as f:
            return f.read()


def artifact_from_bytes(data: bytes) -> Callable[..., Any]:
    from torch._inductor.standalone_compile import CompiledArtifact

    with tempfile.TemporaryDirectory(prefix="hotswap-art-") as tmp:
        path = os.path.join(tmp, "artifact.bin")
        with open(path, "wb") as f:
            f.write(data)
        loaded: Callable[..., Any] = CompiledArtifact.load(path=path, format="binary")
        return loaded
