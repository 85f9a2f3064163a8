"""CUDA graphs captured in the serving process after the swap (engine/loading/cudagraphs.py)."""

from __future__ import annotations

import torch

import hotswap
from hotswap.engine.loading.cudagraphs import CudaGraphed


def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64)).cuda()
    return model, torch.randn(32, 64, device="cuda")


def test_capture_on_the_second_call_then_replay_with_new_inputs() -> None:
    model, x = _model()
    weight = model[0].weight
    fn = torch.compile(model)  # an inductor callable taking the user's input

    def call(w: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        assert w is weight
        return fn(inp)

    graphed = CudaGraphed(call, "g1")
    with torch.no_grad():
        first = graphed(weight, x)
        assert not graphed.captured
        torch.testing.assert_close(graphed(weight, x.clone()), model(x))  # captured here
        assert graphed.captured and graphed.why_not == ""
        outputs = []
        for _ in range(3):  # new values, new tensors: copied in, outputs not overwritten
            y = torch.randn(32, 64, device="cuda")
            outputs.append((graphed(weight, y), model(y)))
        for got, want in outputs:
            torch.testing.assert_close(got, want)
        # Another shape: not what was captured, so it runs as it is.
        z = torch.randn(8, 64, device="cuda")
        torch.testing.assert_close(graphed(weight, z), model(z))
    torch.testing.assert_close(first, model(x))


def test_replays_lend_their_outputs_and_never_overwrite_one_held() -> None:
    model, x = _model()
    graphed = CudaGraphed(model, "g1")
    with torch.no_grad():
        out = graphed(x)
        for _ in range(10):  # `out = model(x)` in a loop: the last output held during a call
            previous, want = out, out.clone()
            y = torch.randn_like(x)
            out = graphed(y)
            torch.testing.assert_close(out, model(y))
            torch.testing.assert_close(previous, want)  # not overwritten by the replay
            del previous
        assert graphed.lending and len(graphed._graphs) == 2
        addresses = set()
        for _ in range(4):  # each output dropped at once: one graph's own memory, no copy
            addresses.add(graphed(x).data_ptr())
        assert len(addresses) == 1
        assert addresses <= {o._leaves[0].data_ptr() for _, o in graphed._graphs}
        kept = [graphed(torch.full_like(x, float(i))) for i in range(6)]  # kept for good
        for i, got in enumerate(kept):
            torch.testing.assert_close(got, model(torch.full_like(x, float(i))))
        assert not graphed.lending


def test_a_graph_that_writes_to_its_input_is_not_captured() -> None:
    def bump(x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x * 2

    graphed = CudaGraphed(bump, "g1")
    for _ in range(3):
        x = torch.zeros(4, device="cuda")
        out = graphed(x)
        torch.testing.assert_close(x, torch.ones(4, device="cuda"))  # the caller's tensor
        torch.testing.assert_close(out, torch.full((4,), 2.0, device="cuda"))
    assert not graphed.captured and "writes to an argument" in graphed.why_not


def test_torch_mode_reduce_overhead_serves_a_captured_tier() -> None:
    model, x = _model()
    compiled = torch.compile(model, backend="hotswap", mode="reduce-overhead")
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(compiled(x), want)
        [status] = hotswap.wait(compiled, timeout_s=400, raise_on_timeout=True)
        assert [t for t, _ in status.states] == ["default", "reduce-overhead"]
        assert not status.failures, status
        for _ in range(4):
            y = torch.randn_like(x)
            torch.testing.assert_close(compiled(y), model(y))
