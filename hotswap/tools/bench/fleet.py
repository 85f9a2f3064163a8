"""``hotswap fleet-bench``: replicas of one model on two "machines", sharing one Redis fleet
store and one Dask cluster, started together; then one more replica on a third machine.

On one box a "machine" is a pair of directories: its hotswap cache and its inductor (and
triton) cache; what its replicas share with the other machine's goes through Redis and the
cluster only. Before any replica starts (each on no replica's clock, reported): redis-server
on a free localhost port (or --redis URL), a fleet key (0600), and a Dask cluster
(--cluster-workers LocalCluster worker processes, warmed; or --cluster ADDRESS).

Each replica is a fresh process (``hotswap bench``'s row: times from its start, nothing left
out; ``hotswap.prepare()`` first thing, as the README advises, unless --no-prepare: its time
is a column of its own, inside the rest) that serves the model, a call every --interval-ms,
until its final tier serves, with ``cache_url`` and ``executor`` set. Then, once they have
all finished, a later replica on a third machine (empty directories) does the same: all it
can get from the fleet is in Redis.

Targets: each (graph, tier) compiled exactly once across the fleet (compiles summed over the
replicas = distinct entries in the store); every replica serving its final tier; the later
replica's compiled code <= 1.2x its own dynamo + eager first output. On one box the cluster,
Redis and every replica share the same cores: a simulation of a fleet's protocol (who
compiles, who waits, who loads what), not of its speed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hotswap.fleet import LocalCluster
from hotswap.testing.servers import RedisServer, free_port
from hotswap.tools.bench.row import is_bench_model
from hotswap.tools.bench.spawn import spawn_row
from hotswap.tools.common import cuda_available, standalone, subcommand

__all__ = ["add_parser", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="mlp", help="a zoo model or corpus:NAME (default mlp)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--replicas", type=int, default=4,
                        help="replicas started together, split over the two machines (default 4)")
    parser.add_argument("--mode", choices=("async", "progressive"), default="progressive")
    parser.add_argument("--redis", default=None,
                        help="a Redis URL to use (default: start redis-server on a free port)")
    parser.add_argument("--cluster", default=None,
                        help="a Dask scheduler address (default: start a LocalCluster)")
    parser.add_argument("--cluster-workers", type=int, default=1,
                        help="worker processes of the LocalCluster (default 1)")
    parser.add_argument("--interval-ms", type=float, default=20.0,
                        help="pause between each replica's calls (default 20)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per replica (default 600)")
    parser.add_argument("--no-prepare", dest="prepare", action="store_false",
                        help="replicas skip hotswap.prepare() (by default each calls it first "
                             "thing, as the README advises; its time is its own column)")
    parser.add_argument("--json", default=None, help="also write every replica's results here")


def run(args: argparse.Namespace) -> int:
    args.device = args.device or ("cuda" if cuda_available() else "cpu")
    if not is_bench_model(args.model):
        raise SystemExit(f"unknown bench model {args.model!r}")
    if args.replicas < 1:
        raise SystemExit(f"--replicas must be >= 1, got {args.replicas}")
    with tempfile.TemporaryDirectory(prefix="hotswap-fleet-") as root:
        setup: dict[str, float] = {}
        redis = cluster = None
        try:
            t = time.monotonic()
            if args.redis is None:
                redis, args.redis = _redis_server(Path(root))
            setup["redis"] = time.monotonic() - t
            t = time.monotonic()
            if args.cluster is None:
                cluster = LocalCluster(args.cluster_workers)
                args.cluster = cluster.scheduler_address
            setup["cluster"] = time.monotonic() - t
            key = Path(root) / "fleet.key"
            key.write_bytes(os.urandom(32))
            key.chmod(0o600)
            results = _replicas(args, Path(root), key)
            entries = _entries(args.redis)
        finally:
            if cluster is not None:
                cluster.close()
            if redis is not None:
                redis.stop()
    lines = _report(args, setup, results, entries)
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup_s": setup, "entries": entries, "replicas": results}, f, indent=2)
    return 0 if not any("MISSED" in line or "failed" in line for line in lines) else 1


def _redis_server(root: Path) -> tuple[RedisServer, str]:
    server = RedisServer(free_port(), root)
    try:
        server.start()
    except RuntimeError as e:
        raise SystemExit(f"{e}; or pass --redis URL") from e
    return server, server.url


def _row_args(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(model=args.model, device=args.device, timeout_s=args.timeout_s,
                              interval_ms=args.interval_ms, floor_s=1.0, caller="busy",
                              threads=None, workers=None, prepare=args.prepare)


def _machine_env(root: Path, machine: str, args: argparse.Namespace,
                 key: Path) -> dict[str, str]:
    base = root / machine
    return {"HOTSWAP_CACHE_DIR": str(base / "hotswap"),
            "TORCHINDUCTOR_CACHE_DIR": str(base / "inductor"),
            "TRITON_CACHE_DIR": str(base / "triton"),
            "HOTSWAP_CACHE_URL": args.redis, "HOTSWAP_CACHE_KEY_FILE": str(key),
            "HOTSWAP_EXECUTOR": args.cluster}


def _replicas(args: argparse.Namespace, root: Path, key: Path) -> list[dict[str, Any]]:
    row = f"hotswap:{args.mode}"
    machines = [f"machine-{'ab'[i % 2]}" for i in range(args.replicas)]
    print(f"  starting {args.replicas} replicas of {args.model} together on "
          f"{sorted(set(machines))} ...", file=sys.stderr, flush=True)
    with ThreadPoolExecutor(args.replicas) as pool:
        futures = [pool.submit(spawn_row, row, _row_args(args),
                               env=_machine_env(root, m, args, key)) for m in machines]
        results = [f.result() for f in futures]
    for result, machine in zip(results, machines, strict=True):
        result["machine"] = machine
    print("  then a later replica on machine-c (empty directories) ...", file=sys.stderr,
          flush=True)
    later = spawn_row(row, _row_args(args), env=_machine_env(root, "machine-c", args, key))
    later["machine"] = "machine-c (later)"
    eager = spawn_row("torch:eager-backend", _row_args(args))
    eager["machine"] = "machine-c (later)"
    return [*results, later, eager]


def _entries(url: str) -> dict[str, int]:
    """Distinct entries in the fleet store by tier label (verdicts apart)."""
    import msgpack
    import redis

    by_tier: dict[str, int] = {}
    for raw in redis.Redis.from_url(url).hgetall("hotswap:index").values():
        tier = msgpack.unpackb(raw, raw=False).get("tier", "")
        by_tier[tier] = by_tier.get(tier, 0) + 1
    return by_tier


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else "-" if value is None else str(value)


def _report(args: argparse.Namespace, setup: dict[str, float], results: list[dict[str, Any]],
            entries: dict[str, int]) -> list[str]:
    lines = [f"fleet-bench: {args.model} on {args.device}, {args.mode}, {args.replicas} "
             f"replicas on 2 machines + 1 later; one Redis ({args.redis}), one Dask cluster "
             f"({args.cluster}); set up before any replica, on no replica's clock: Redis "
             f"{setup['redis']:.1f} s, cluster started and warmed {setup['cluster']:.1f} s",
             "", f"{'replica':<22}{'machine':<20}{'prepare s':>10}{'first out s':>12}"
             f"{'compiled s':>11}"
             f"{'final s':>9}  {'tiers':<16}{'compiles':>9}{'on cluster':>11}"
             f"{'hits':>6}{'from fleet':>11}"]
    replicas = [r for r in results if r.get("row", "").startswith("hotswap:")]
    for r in results:
        if "error" in r:
            lines.append(f"{r['row']:<22}{r['machine']:<20}failed: {r['error']}")
            continue
        c = r.get("counters", {})
        lines.append(f"{r['row']:<22}{r['machine']:<20}{_fmt(r.get('prepare_s')):>10}"
                     f"{_fmt(r['first_output_s']):>12}"
                     f"{_fmt(r.get('to_compiled_s')):>11}{_fmt(r['to_final_s']):>9}  "
                     f"{','.join(r.get('tiers', [])) or '-':<16}"
                     f"{c.get('worker_compiles', 0):>9}{c.get('remote_compiles', 0):>11}"
                     f"{c.get('cache_hits', 0):>6}{c.get('remote_cache_hits', 0):>11}")
    ok = [r for r in replicas if "error" not in r]
    compiles = sum(r["counters"].get("worker_compiles", 0) for r in ok)
    remote = sum(r["counters"].get("remote_compiles", 0) for r in ok)
    stored = sum(n for tier, n in entries.items() if tier != "gate-verdict")
    lines += ["", "targets",
              f"  each (graph, tier) compiled once across the fleet: {compiles} compiles "
              f"({remote} on the cluster) for {stored} distinct entries in the store "
              f"{dict(sorted(entries.items()))}: "
              + ("met" if compiles == stored and len(ok) == len(replicas) else "MISSED")]
    finals = {tuple(r["tiers"]) for r in ok}
    lines.append(f"  every replica serving its final tier: {len(ok)} of {len(replicas)} "
                 f"final, serving {sorted(finals)}: "
                 + ("met" if len(ok) == len(replicas) and len(finals) == 1 else "MISSED"))
    later = next((r for r in ok if r["machine"].endswith("(later)")), None)
    if later is not None and later.get("to_compiled_s") is not None:
        own = later["to_compiled_s"] / later["first_output_s"]
        lines.append(f"  later replica's compiled code vs its own dynamo + eager first output: "
                     f"{later['to_compiled_s']:.2f} / {later['first_output_s']:.2f} = "
                     f"{own:.2f}x (target <= 1.2x) {'met' if own <= 1.2 else 'MISSED'}")
        eager = next((r for r in results if r.get("row") == "torch:eager-backend"
                      and "error" not in r), None)
        if eager is not None:
            lines.append(f"  (beside torch.compile(backend='eager') in a fresh process: "
                         f"{later['to_compiled_s']:.2f} / {eager['first_output_s']:.2f} = "
                         f"{later['to_compiled_s'] / eager['first_output_s']:.2f}x)")
    else:
        lines.append("  later replica's compiled code: not measured (it failed)")
    return lines


def add_parser(sub: Any) -> None:
    subcommand(sub, "fleet-bench", "replicas on two machines sharing Redis and a Dask cluster",
               __doc__, add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    return standalone("hotswap fleet-bench", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
