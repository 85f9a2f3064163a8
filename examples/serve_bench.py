"""A benchmark a service owner can believe: a real HTTP inference server (FastAPI on uvicorn),
started fresh for each way of serving the model, driven at a fixed request rate by an httpx
client from the moment its process is launched.

    pip install -e '.[serve-bench]'
    python examples/serve_bench.py                          # mlp, every variant, 120 s each
    python examples/serve_bench.py --models corpus:gpt2 --device cuda --rate 50
    python examples/serve_bench.py --variants eager,hotswap:async --duration-s 30 --out /tmp/sb

It is ``hotswap bench --service`` (the same code and flags; ``--help`` lists them) and writes
per model serve-MODEL.png (latency over time) and serve-MODEL.json (every request) into
``--out``. docs/bench.md says what each variant is and how to read the settle time.
"""

import sys

from hotswap.tools.bench.main import main

if __name__ == "__main__":
    sys.exit(main(["--service", *sys.argv[1:]]))
