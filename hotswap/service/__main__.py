"""``python -m hotswap.service --dir DIR``: run this build's compile service in DIR (clients
start it so, detached, on demand; ``hotswap service start`` too)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from hotswap import settings
from hotswap.service.control import NotAnswering, OtherBuild, probe
from hotswap.service.place import Place, authkey, check_dir, default_dir, stamp
from hotswap.service.server import Service, install_signals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hotswap.service")
    parser.add_argument("--dir", default=None, help="the private folder (default: "
                                                    "HOTSWAP_SERVICE_DIR, else the usual one)")
    parser.add_argument("--idle-exit-s", type=float, default=None,
                        help="exit after this long without a job (default "
                             "HOTSWAP_SERVICE_IDLE_EXIT_S, else 600)")
    parser.add_argument("--first-job-within-s", type=float, default=None,
                        help="until a first job comes, exit after this long without one (a "
                             "service started as hotswap was imported: it may get none)")
    parser.add_argument("--stamp", default=None,
                        help="the build stamp to serve (default: this environment's); the "
                             "client that starts the service passes the one it computed, so "
                             "that a source file changed meanwhile cannot part them")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(message)s")
    place = Place(Path(os.path.abspath(args.dir)) if args.dir else default_dir(),
                  args.stamp or stamp())
    check_dir(place.dir, create=True)
    try:
        if probe(place, authkey(place, create=True)) is not None:
            print(f"a compile service of build {place.stamp} already runs on {place.socket}",
                  file=sys.stderr)
            return 0
    except (NotAnswering, OtherBuild) as e:
        print(f"not started: {e}", file=sys.stderr)
        return 1
    # The service's own idle exit governs its workers: its pool never stops them early.
    os.environ["HOTSWAP_WORKER_IDLE_EXIT_S"] = "0"
    idle = args.idle_exit_s if args.idle_exit_s is not None else settings.service_idle_exit_s()
    service = Service(place, idle_exit_s=idle, first_job_within_s=args.first_job_within_s)
    install_signals(service)
    service.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
