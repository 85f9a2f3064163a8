"""Service metrics for Prometheus: ``hotswap.serve_metrics(port)``.

Read at each scrape from what hotswap already keeps (``hotswap.counters()`` and
``hotswap.status()``), so serving pays nothing between scrapes:

    hotswap_graphs_serving{tier}          graphs serving each tier now ("eager" included)
    hotswap_tiers_pending                 tiers compiling, loading or being measured: the queue
    hotswap_compiles_total{where}         compiles that finished: local (a worker here),
                                          remote (the cluster), inprocess
    hotswap_cache_hits_total{where}       artifacts found instead of compiled: local, remote
    hotswap_failures_total{reason}        crashes, timeouts, memory kills, refused entries,
                                          fleet store errors, cluster fallbacks, tier failures
    hotswap_events_total{event}           every counter of ``hotswap.counters()``
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

__all__ = ["FAILURES", "serve_metrics"]

# counters() names that count something going wrong, exported as failure reasons
FAILURES = ("worker_crashes", "job_timeouts", "memory_limit_kills", "serialization_failures",
            "cache_rejects", "fleet_store_errors", "cluster_fallbacks", "fallbacks",
            "internal_errors")


class _Collector:
    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        import hotswap

        counts = hotswap.counters()
        statuses = hotswap.status()
        serving = GaugeMetricFamily("hotswap_graphs_serving", "graphs serving each tier now",
                                    labels=["tier"])
        for tier, n in sorted(collections.Counter(s.tier for s in statuses).items()):
            serving.add_metric([tier], n)
        yield serving
        yield GaugeMetricFamily("hotswap_tiers_pending",
                                "tiers compiling, loading or being measured now",
                                value=sum(len(s.pending) for s in statuses))
        compiles = CounterMetricFamily("hotswap_compiles", "compiles that finished",
                                       labels=["where"])
        remote = counts.get("remote_compiles", 0)
        compiles.add_metric(["local"], counts.get("worker_compiles", 0) - remote)
        compiles.add_metric(["remote"], remote)
        compiles.add_metric(["inprocess"], counts.get("inprocess_compiles", 0))
        yield compiles
        hits = CounterMetricFamily("hotswap_cache_hits", "artifacts found instead of compiled",
                                   labels=["where"])
        remote_hits = counts.get("remote_cache_hits", 0)
        hits.add_metric(["local"], counts.get("cache_hits", 0) - remote_hits)
        hits.add_metric(["remote"], remote_hits)
        yield hits
        failures = CounterMetricFamily("hotswap_failures", "what went wrong, by reason",
                                       labels=["reason"])
        for reason in FAILURES:
            failures.add_metric([reason], counts.get(reason, 0))
        yield failures
        events = CounterMetricFamily("hotswap_events", "every hotswap counter",
                                     labels=["event"])
        for name, n in sorted(counts.items()):
            events.add_metric([name], n)
        yield events


def serve_metrics(port: int = 9464, addr: str = "0.0.0.0") -> Any:
    """Serve hotswap's metrics at ``http://addr:port/metrics`` from a daemon thread (needs
    ``prometheus_client``: the ``fleet`` extra). Returns the HTTP server; ``.shutdown()``
    stops it."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as e:
        raise ValueError("serve_metrics needs prometheus_client: pip install 'hotswap[fleet]'"
                         ) from e
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_Collector())
    server, _ = start_http_server(port, addr=addr, registry=registry)
    return server
