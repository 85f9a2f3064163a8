"""A model zoo for profiling, stress tests and benchmarks, built from code (nothing downloaded).

Each entry builds a ``Workload``: the thing to compile (a module or function), inputs per step,
and an eager reference to check outputs against. Sizes differ per device (a CPU size that
compiles and runs in seconds; a CUDA size big enough for kernels to matter).

    >>> w = make("mlp", device="cpu")
    >>> compiled = hotswap.compile(w.target)
    >>> err = w.error(compiled(*w.inputs(0)), 0)   # max abs error vs eager, in w.tolerance
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hotswap.tools.common import Workload, tolerance

__all__ = ["MODELS", "Workload", "known", "make", "tolerance"]


class MLP(nn.Sequential):
    def __init__(self, width: int, depth: int) -> None:
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        super().__init__(*layers, nn.Linear(width, width))


class ConvNet(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]


class TransformerBlock(nn.Module):
    """Pre-norm block: attention through scaled_dot_product_attention, then an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        attn = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))  # type: ignore[no-any-return]


def reductions(x: torch.Tensor) -> torch.Tensor:
    y = torch.softmax(x, dim=-1)
    y = nn.functional.layer_norm(y * x, x.shape[-1:])
    return y.sum(dim=-1, keepdim=True) + y.amax(dim=-1, keepdim=True) - y.mean()


def pointwise(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((x + y).sin().cos() * torch.sigmoid(x) - y.tanh()).relu()


def graph_break(x: torch.Tensor) -> torch.Tensor:
    y = torch.relu(x @ x.T)
    torch._dynamo.graph_break()
    return (y.softmax(-1) @ x).tanh()


def matmul_relu(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x @ y).relu()


def adds500(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """PyTorch's own async-compile test: a long chain of adds (forward and backward)."""
    for _ in range(500):
        x = x + y
    return x


def _fixed(*tensors: torch.Tensor) -> Callable[[int], tuple[Any, ...]]:
    return lambda step: tensors


def _module(name: str, module: nn.Module, inputs: Callable[[int], tuple[Any, ...]],
            dtype: torch.dtype) -> Workload:
    reference = copy.deepcopy(module)
    return Workload(name, module, inputs, lambda step: reference(*inputs(step)),
                    tolerance(dtype))


def _function(name: str, fn: Callable[..., Any], inputs: Callable[[int], tuple[Any, ...]],
              dtype: torch.dtype) -> Workload:
    return Workload(name, fn, inputs, lambda step: fn(*inputs(step)), tolerance(dtype))


def _rand(*shape: int, device: str, dtype: torch.dtype, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)


def _mlp(device: str, dtype: torch.dtype) -> Workload:
    width, batch = (256, 64) if device == "cpu" else (2048, 1024)
    model = MLP(width, 3).to(device, dtype).eval()
    return _module("mlp", model, _fixed(_rand(batch, width, device=device, dtype=dtype)), dtype)


def _convnet(device: str, dtype: torch.dtype) -> Workload:
    channels, batch, size = (16, 4, 32) if device == "cpu" else (64, 64, 64)
    model = ConvNet(channels).to(device, dtype).eval()
    x = _rand(batch, 3, size, size, device=device, dtype=dtype)
    return _module("convnet", model, _fixed(x), dtype)


def _transformer(device: str, dtype: torch.dtype) -> Workload:
    dim, heads, batch, seq = (128, 4, 4, 64) if device == "cpu" else (1024, 16, 8, 512)
    model = TransformerBlock(dim, heads).to(device, dtype).eval()
    return _module("transformer", model, _fixed(_rand(batch, seq, dim, device=device,
                                                      dtype=dtype)), dtype)


def _reductions(device: str, dtype: torch.dtype) -> Workload:
    shape = (256, 512) if device == "cpu" else (8192, 4096)
    return _function("reductions", reductions, _fixed(_rand(*shape, device=device, dtype=dtype)),
                     dtype)


def _pointwise(device: str, dtype: torch.dtype) -> Workload:
    n = 1 << 16 if device == "cpu" else 1 << 24
    return _function("pointwise", pointwise, _fixed(_rand(n, device=device, dtype=dtype),
                                                     _rand(n, device=device, dtype=dtype)), dtype)


def _matmul_relu(device: str, dtype: torch.dtype) -> Workload:
    """PyTorch's own progressive-compile test: (x @ y).relu(), x 1152x1024, y 1024x1024."""
    n, k = (288, 256) if device == "cpu" else (1152, 1024)
    return _function("matmul-relu", matmul_relu, _fixed(_rand(n, k, device=device, dtype=dtype),
                                                        _rand(k, k, device=device, dtype=dtype)),
                     dtype)


def _graph_break(device: str, dtype: torch.dtype) -> Workload:
    shape = (64, 32) if device == "cpu" else (2048, 1024)
    return _function("graph-break", graph_break, _fixed(_rand(*shape, device=device,
                                                              dtype=dtype)), dtype)


def _adds500(device: str, dtype: torch.dtype) -> Workload:
    x = _rand(64, device=device, dtype=dtype, grad=True)
    y = _rand(64, device=device, dtype=dtype, grad=True)

    def run(fn: Any, step: int) -> Any:
        out = fn(x, y)
        gx, gy = torch.autograd.grad(out.sum(), (x, y))
        return out.detach(), gx, gy

    workload = _function("adds500", adds500, _fixed(x, y), dtype)
    workload.call = run
    workload.reference = lambda step: run(adds500, step)
    return workload


def _training(device: str, dtype: torch.dtype) -> Workload:
    """One optimizer step per call: forward, backward and SGD update, all in the function."""
    width, batch = (64, 32) if device == "cpu" else (1024, 512)
    torch.manual_seed(0)
    model = MLP(width, 2).to(device, dtype)
    twin = copy.deepcopy(model)
    data = [(_rand(batch, width, device=device, dtype=dtype),
             _rand(batch, width, device=device, dtype=dtype)) for _ in range(4)]

    def make_step(net: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)

        def train_step(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(net(x), target)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            return loss.detach()

        return train_step

    step_fn, twin_step = make_step(model), make_step(twin)
    losses: list[Any] = []

    def reference(step: int) -> Any:  # the eager twin catches up, one optimizer step at a time
        while len(losses) <= step:
            losses.append(twin_step(*data[len(losses) % len(data)]))
        return losses[step]

    return Workload("training", step_fn, lambda step: data[step % len(data)], reference,
                    tolerance(dtype) * 10)


def _dynamic(device: str, dtype: torch.dtype) -> Workload:
    width = 64 if device == "cpu" else 1024
    sizes = (4, 7, 16, 9, 33, 12)
    model = MLP(width, 2).to(device, dtype).eval()
    xs = {n: _rand(n, width, device=device, dtype=dtype) for n in sizes}
    return _module("dynamic", model, lambda step: (xs[sizes[step % len(sizes)]],), dtype)


MODELS: dict[str, Callable[[str, torch.dtype], Workload]] = {
    "mlp": _mlp,
    "convnet": _convnet,
    "transformer": _transformer,
    "reductions": _reductions,
    "pointwise": _pointwise,
    "matmul-relu": _matmul_relu,
    "graph-break": _graph_break,
    "training": _training,
    "dynamic": _dynamic,
    "adds500": _adds500,
}


def known(name: str) -> bool:
    """A zoo model, or ``corpus:NAME`` for a real architecture of ``hotswap.tools.corpus``."""
    if name.startswith("corpus:"):
        from hotswap.tools import corpus

        return name.removeprefix("corpus:") in corpus.MODELS
    return name in MODELS


def make(name: str, *, device: str = "cpu", dtype: torch.dtype | str = torch.float32) -> Workload:
    """Build zoo model ``name`` (see ``MODELS``; ``corpus:NAME`` builds ``hotswap.tools.corpus``'s
    model NAME) for ``device`` and ``dtype``."""
    if name.startswith("corpus:"):
        from hotswap.tools import corpus

        return corpus.make(name.removeprefix("corpus:"), device=device, dtype=dtype)
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; the zoo has {sorted(MODELS)}, and "
                         "'corpus:NAME' for the real models of hotswap.tools.corpus")
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
        dtype = resolved
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MODELS[name](device, dtype)
