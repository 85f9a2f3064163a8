"""Entry point of a worker process; see hotswap/workers/child.py."""

import sys

from hotswap.workers.child import main

sys.exit(main())
