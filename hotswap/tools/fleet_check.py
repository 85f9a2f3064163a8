"""``hotswap doctor``'s fleet checks: can this process use the cluster and the store it is
configured with, and if not, why (each prints what it found; False when it failed)."""

from __future__ import annotations

import os
import time

__all__ = ["check_executor", "check_store"]


def check_executor(address: str, timeout_s: float) -> bool:
    """Connect to the Dask cluster as a coordinator would, and compare every worker's build
    with this process's."""
    from hotswap.fleet import Cluster

    t = time.monotonic()
    cluster = Cluster(address, warm=False)
    client = cluster.client(timeout_s)
    if client is None:
        print(f"executor {address}: NOT usable ({cluster.refused or 'no answer in time'}); "
              "hotswap would compile in the local pool")
        return False
    workers = client.scheduler_info().get("workers", {})
    print(f"executor {address}: {len(workers)} worker(s), same build as this process "
          f"(connected and checked in {time.monotonic() - t:.2f} s)")
    client.close()
    return True


def check_store(url: str) -> bool:
    """Read the fleet key, then a round trip through the store: write, read back (verified),
    claim, release, remove."""
    from hotswap.fleet import FleetStore, load_fleet_key

    try:
        store = FleetStore(url, load_fleet_key(), {"doctor": True})
        t = time.monotonic()
        store.ping()
        ping_ms = (time.monotonic() - t) * 1e3
        key = os.urandom(32).hex()
        store.put(key, b"hotswap doctor", tier="doctor")
        back = store.get(key)
        claimed = store.claim(key)
        store.release(key)
        store.clear("doctor")
    except (ValueError, OSError) as e:
        print(f"fleet store {url}: NOT usable: {e}")
        return False
    if back != b"hotswap doctor" or not claimed:
        print(f"fleet store {url}: NOT usable: an entry did not read back or a claim failed")
        return False
    entries = len([e for e in store.entries() if e.tier != "doctor"])
    print(f"fleet store {url}: reachable ({ping_ms:.1f} ms), key file good, write/read/claim "
          f"round trip passed; {entries} entries")
    return True
