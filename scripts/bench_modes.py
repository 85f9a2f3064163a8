"""Kept for older instructions: the same as ``hotswap bench`` (see hotswap/tools/bench/main.py)."""

import sys
from pathlib import Path

# Runs from a checkout as it is (e.g. on a GPU machine without network): hotswap is one level up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hotswap.tools.bench.main import main

sys.exit(main())
