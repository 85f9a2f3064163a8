"""``hotswap bench --service``: a real HTTP inference server per variant, each a fresh process
with cold caches, driven at a fixed request rate from the moment it is launched.

  bench process (here: one asyncio loop)            server process (serve.py), per variant
  --------------------------------------            --------------------------------------
  @service variants: start the compile service
    and have it compile another model (off the
    clock)
  an httpx client made, then the server launched -> imports; startup: prepare (hotswap),
    (the clock starts: sent and latency are s         build, wrap, call once; then listen
    from here)
  POST /infer every 1/rate s, whether or not     -> event loop -> the model thread, one call
    earlier ones came back (open loop); each         at a time (requests queue in line)
    request a task, recorded as it ends
    (refused until the server listens)
  GET /stats                                     -> ready_s, final_s, counters, tiers
  SIGTERM; SIGKILL to its process group after 20 s

A request's latency runs from its scheduled send time, not from when the loop got to it, so a
late client does not hide a slow server. A request the server does not answer within
ANSWER_TIMEOUT_S is a failure ("timeout"); one sent before the server listens fails at once
("refused"): the time to the first answer, from launch, is what a user waits.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

from hotswap.tools.bench import latency
from hotswap.tools.bench.latency import Request

if TYPE_CHECKING:
    import httpx

__all__ = ["ANSWER_TIMEOUT_S", "DEFAULT_VARIANTS", "VARIANTS", "run"]

VARIANTS = {
    "eager": "the model as built: no compile, the floor",
    "torch:default": "torch.compile(model); the startup's call compiles, in the server's "
                     "process, before it listens",
    "pytorch:async+subprocess": "torch.compile with TORCHINDUCTOR_FX_COMPILE_MODE="
                                "async+subprocess: eager until a subprocess compiled",
    "hotswap:async": "hotswap.compile(mode='async'), the first process ever: its own "
                     "workers, cold caches, the compile service off",
    "hotswap:async@service": "the same with HOTSWAP_SERVICE=on: the machine's compile service "
                             "running and warm (it compiled another model), cold for this one",
    "hotswap:progressive": "hotswap.compile() (progressive: default, then max-autotune), the "
                           "first process ever, the compile service off",
    "hotswap:progressive@service": "progressive, the compile service running and warm",
}
DEFAULT_VARIANTS = "eager,torch:default,pytorch:async+subprocess,hotswap:async,hotswap:async@service"
ANSWER_TIMEOUT_S = 60.0


def run(args: argparse.Namespace) -> int:
    """Every model, every variant: serve, drive, then print, plot and save."""
    from hotswap.tools.bench.report import machine
    from hotswap.tools.bench.row import bench_models

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    models = bench_models(args.models)
    for name, value in (("--rate", args.rate), ("--duration-s", args.duration_s),
                        ("--window-s", args.window_s)):
        if value <= 0:
            raise SystemExit(f"{name} must be > 0, got {value:g}")
    _check_installed()
    os.makedirs(args.out, exist_ok=True)
    meta = {"machine": machine(), "device": args.device, "rate": args.rate,
            "duration_s": args.duration_s, "window_s": args.window_s,
            "command": "hotswap bench " + " ".join(sys.argv[1:])}
    for model in models:
        print(f"\n== {model} on {args.device}: {args.rate:g} requests/s for {args.duration_s:g} s, "
              "open loop, from each server process's launch (fresh process, cold caches) ==",
              file=sys.stderr)
        runs = {v: serve_variant(v, model, args) for v in variants}
        summaries = [latency.summarize(v, runs[v]["requests"], args.window_s, args.duration_s)
                     for v in variants]
        lines = latency.report(summaries, {v: _note(r) for v, r in runs.items()})
        print(f"\n{model} on {args.device}, {args.rate:g} requests/s for {args.duration_s:g} s "
              "(times in s from the server process's launch)\n" + "\n".join(lines))
        stem = os.path.join(args.out, f"serve-{_slug(model)}")
        latency.write_json(stem + ".json", {**meta, "model": model}, runs, summaries)
        latency.plot(stem + ".png", f"{model} on {args.device}: {args.rate:g} requests/s, open "
                     "loop, from process launch", {v: r["requests"] for v, r in runs.items()},
                     summaries)
        print(f"wrote {stem}.json and {stem}.png", file=sys.stderr)
    return 0


def serve_variant(variant: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """Launch ``variant``'s server in a fresh process with cold caches, drive it for
    ``args.duration_s``, and return its requests and what it said of itself."""
    from hotswap.tools.bench.spawn import row_env, stop_service, warm_service

    start = time.monotonic()
    # ignore_cleanup_errors: a file a straggler wrote must not end the whole benchmark
    with tempfile.TemporaryDirectory(prefix="hotswap-serve-", ignore_cleanup_errors=True) as cache:
        namespace = argparse.Namespace(**{**vars(args), "service_dir":
                                          os.path.join(cache, "service")})
        env = row_env(variant, cache, namespace)
        if "@service" not in variant:
            env["HOTSWAP_SERVICE"] = "off"  # cold: hotswap's own workers alone
        if "HOTSWAP_WORKER_IDLE_EXIT_S" not in os.environ:
            del env["HOTSWAP_WORKER_IDLE_EXIT_S"]  # a server keeps hotswap's default
        if "@service" in variant:
            warm_service(namespace)
        print(f"  serving {model} as {variant} ...", end="", flush=True, file=sys.stderr)
        log_path = os.path.join(args.out, f"serve-{_slug(model)}-{_slug(variant)}.log")
        try:
            with open(log_path, "w") as log:
                result = asyncio.run(_session(variant, model, args, env, log))
        finally:
            if "@service" in variant:
                stop_service(env)
    result["log"] = log_path
    print(f" {time.monotonic() - start:.0f} s", file=sys.stderr)
    return result


async def _session(variant: str, model: str, args: argparse.Namespace, env: dict[str, str],
                   log: Any) -> dict[str, Any]:
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=ANSWER_TIMEOUT_S) as client:
        started, launched_at = time.monotonic(), time.time()
        cmd = [sys.executable, "-m", "hotswap.tools.bench.serve", "--variant", variant,
               "--model", model, "--device", args.device, "--port", str(port),
               "--launched-at", repr(launched_at)] + (
                   ["--workers", str(args.workers)] if args.workers else []) + (
                   ["--threads", str(args.threads)] if args.threads else [])
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            requests = await _drive(client, url + "/infer", args.rate, args.duration_s,
                                    started, proc)
            exited = proc.poll()
            stats: dict[str, Any] = {}
            if exited is None:
                try:
                    stats = (await client.get(url + "/stats", timeout=10)).json()
                except httpx.HTTPError as e:
                    stats = {"error": f"no stats: {type(e).__name__}"}
            else:
                stats = {"error": f"the server exited with code {exited} before the run "
                                  f"ended (its log: {log.name})"}
        finally:
            _stop(proc)
    return {"requests": requests, "server": stats}


async def _drive(client: httpx.AsyncClient, url: str, rate: float, duration_s: float,
                 started: float, proc: subprocess.Popen[bytes]) -> list[Request]:
    """Send a request every 1/rate s from ``started`` for ``duration_s`` (open loop), until
    the server exits; wait for every answer."""
    tasks = []
    for i in range(round(rate * duration_s)):
        due = started + i / rate
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if proc.poll() is not None:
            break
        tasks.append(asyncio.create_task(_send(client, url, i, due, started)))
    return list(await asyncio.gather(*tasks))


async def _send(client: httpx.AsyncClient, url: str, i: int, due: float,
                started: float) -> Request:
    import httpx

    sent_s = due - started
    try:
        response = await client.post(url, json={"id": i})
    except httpx.ConnectError:
        return Request(sent_s, None, None, "refused")
    except httpx.TimeoutException:
        return Request(sent_s, None, None, "timeout")
    except httpx.HTTPError as e:
        return Request(sent_s, None, None, type(e).__name__)
    status = response.status_code
    return Request(sent_s, time.monotonic() - due, status, None if status == 200 else f"HTTP {status}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (uvicorn's graceful stop), then SIGKILL to what is left of its process group,
    then to every process it had started (compile workers, their compile pools): they write
    into the variant's cache folders, which are removed next."""
    import psutil

    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    _, alive = psutil.wait_procs(tree, timeout=10)  # workers exit once their parent has
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=10)


def _note(run: dict[str, Any]) -> str:
    stats = run["server"]
    if "error" in stats:
        return str(stats["error"])
    parts = [f"listening at {stats['ready_s']:.2f} s" if stats.get("ready_s") is not None
             else "never ready"]
    final = stats.get("final_s")
    parts.append(f"final code served at {final:.2f} s" if final is not None
                 else "final code not serving by the end")
    counters = stats.get("counters") or {}
    compiles = {k: counters[k] for k in ("worker_compiles", "remote_compiles", "swaps")
                if counters.get(k)}
    if compiles:
        parts.append(", ".join(f"{k} {v}" for k, v in compiles.items()))
    return "; ".join(parts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)


def _check_installed() -> None:
    missing = []
    for module in ("fastapi", "uvicorn", "httpx", "matplotlib"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise SystemExit(f"hotswap bench --service needs {', '.join(missing)}: "
                         "pip install -e '.[serve-bench]'")
