"""The HTTP inference server of ``hotswap bench --service``: one process per variant, started
by the bench (``python -m hotswap.tools.bench.serve``), a FastAPI app on uvicorn.

Its startup (FastAPI's lifespan) does what a service owner's does: for hotswap's variants,
``hotswap.prepare()`` first (as the README advises), then it builds the model, wraps it the
variant's way (the bench rows' ``wrap_row``: eager, ``torch.compile``, PyTorch's
``async+subprocess``, ``hotswap.compile``) and calls it once, so that it listens only once a
request can be answered (uvicorn binds its port after the startup). Until then a connection is
refused.

  POST /infer   runs the model once on the workload's inputs; answers {"id", "checksum"}
  GET  /stats   when it was ready, when its final code served (the bench row's test), its
                hotswap counters and tiers

Calls run one at a time on one model thread, as a single-model server's do: the event loop
keeps accepting while a call runs, and the requests wait in line (open-loop queueing shows as
latency). Times are seconds since ``--launched-at`` (the bench's clock when it launched this
process).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

# At module level: FastAPI reads the handlers' annotations (strings here) from these globals.
from fastapi import FastAPI, Request

__all__ = ["create_app", "main"]


class _Model:
    """The variant's callable on the model thread, and when it became ready and final."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.call: Callable[[], Any] | None = None
        self.is_final: Callable[[], bool] = lambda: True
        self.ready_s: float | None = None
        self.final_s: float | None = None
        self.before: dict[str, int] = {}
        self.wrapped: Any = None

    def since_launch(self) -> float:
        return time.time() - float(self.args.launched_at)

    def load(self) -> None:
        """Build, wrap and call once (runs on the model thread)."""
        import torch

        args = self.args
        if args.threads:
            torch.set_num_threads(args.threads)
        hot = args.variant.startswith("hotswap:")
        if hot:
            import hotswap

            hotswap.prepare(workers=args.workers, devices=[args.device])
        from hotswap.tools.bench.row import build, wrap_row

        model, inputs = build(args.model, args.device)
        if args.variant == "eager":
            wrapped: Any = model
        else:
            wrapped, self.is_final, _ = wrap_row(args.variant, model, args)
        if hot:
            import hotswap

            self.before = dict(hotswap.counters())
        self.wrapped = wrapped

        def call() -> float:
            with torch.no_grad():
                out = wrapped(*inputs)
            leaf = next(t for t in torch.utils._pytree.tree_leaves(out)
                        if isinstance(t, torch.Tensor))
            return float(leaf.float().sum().item())  # .item() waits for the device

        call()
        self.call = call
        self.ready_s = self.since_launch()

    def watch(self) -> None:
        """Note when the final code serves (the bench row's own test), polled."""
        while self.final_s is None:
            if self.is_final():
                self.final_s = self.since_launch()
                return
            time.sleep(0.2)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"variant": self.args.variant, "ready_s": self.ready_s,
                               "final_s": self.final_s}
        if self.args.variant.startswith("hotswap:"):
            import hotswap

            out["counters"] = {k: v - self.before.get(k, 0)
                               for k, v in hotswap.counters().items() if v != self.before.get(k, 0)}
            out["tiers"] = [s.tier for s in hotswap.status(self.wrapped)]
        return out


def create_app(args: argparse.Namespace) -> FastAPI:
    """The server's app for ``args`` (``variant``, ``model``, ``device``, ``workers``,
    ``threads``, ``launched_at``)."""
    model = _Model(args)
    pool = ThreadPoolExecutor(1, thread_name_prefix="model")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.get_running_loop().run_in_executor(pool, model.load)
        threading.Thread(target=model.watch, name="final-watch", daemon=True).start()
        yield
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(lifespan=lifespan)

    @app.post("/infer")
    async def infer(request: Request) -> dict[str, Any]:
        body = await request.json()
        assert model.call is not None  # the lifespan set it before uvicorn listened
        checksum = await asyncio.get_running_loop().run_in_executor(pool, model.call)
        return {"id": body.get("id"), "checksum": checksum}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return model.stats()

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hotswap.tools.bench.serve",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--variant", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--launched-at", type=float, default=time.time())
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    import uvicorn

    uvicorn.run(create_app(args), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
