"""hotswap demo: a model served at once, sped up in the background, beside plain torch.compile.

A service loop calls a model every few milliseconds. hotswap answers the first call eagerly
(no compile in this process), compiles the tiers of the ladder in worker processes, measures
each against what serves, and swaps it in when it is faster. The loop prints every change as
it happens, then a summary; last, plain torch.compile runs the same model in a fresh process,
and the two are compared from process start. No `if __name__ == "__main__":` guard on
purpose: workers never re-run this script.

    scripts/demo                  the whole demo
    scripts/demo --torch-compile  (used by the demo) plain torch.compile's first call alone
"""

import getpass
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import psutil
import torch

import hotswap


def since_start() -> float:
    """Seconds since this process started: the user's clock."""
    return time.time() - psutil.Process().create_time()


class Block(torch.nn.Module):
    """A linear layer, a hand-written norm and a residual: eager runs each op on its own, and
    inductor fuses the norm's ops into a few loops."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        mean = y.mean(-1, keepdim=True)
        var = ((y - mean) ** 2).mean(-1, keepdim=True)
        y = (y - mean) * torch.rsqrt(var + 1e-5)
        return x + torch.relu(y) * 0.5


if "--torch-compile" not in sys.argv:
    # What a service does first thing: start the compile workers and warm this process's load
    # path in the background, while it builds its model (nothing here waits for them).
    hotswap.prepare()

cuda = torch.cuda.is_available()
device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
if not cuda:
    # The loop's calls leave a core (of those this process may use) to the compile and the
    # gate's measurements (both processes of the comparison alike). On 2 cores, with torch's
    # two threads the loop took both: the workers ran on what it left, every measurement was
    # contended, and the demo took 119 s cold against 55-58 s so.
    torch.set_num_threads(max(1, min(torch.get_num_threads(), len(os.sched_getaffinity(0)) - 1)))
width, depth, batch = (4096, 8, 512) if cuda else (256, 8, 256)
torch.manual_seed(0)
model = torch.nn.Sequential(*[Block(width) for _ in range(depth)]).to(device, dtype).eval()
x = torch.randn(batch, width, device=device, dtype=dtype)
sync = torch.cuda.synchronize if cuda else (lambda: None)

if "--torch-compile" in sys.argv:
    plain = torch.compile(model)
    with torch.no_grad():
        plain(x)
    sync()
    print(json.dumps({"first_compiled_call_s": since_start()}), flush=True)
    # Measured: skip the interpreter's teardown (inductor's compile processes, torch's exit
    # handlers), 1.4-1.7 s on 2 busy cores that the demo would otherwise wait out. Its
    # compile processes end on their own once this one is gone.
    os._exit(0)

tiers = ["default", "max-autotune-no-cudagraphs"]
# The blocks repeat: the ladder starts with the first tier, each distinct block compiled once
# (docs/regions.md), its rung "default-regions".
print(f"{depth} blocks (linear, norm, residual), width {width}, batch {batch}, {device} {dtype}; "
      f"ladder: eager -> default-regions -> {' -> '.join(tiers)}")
fast = hotswap.compile(model, mode="progressive", tiers=tiers)

latencies: dict[str, list[float]] = {}
first_compiled_s = None
# On a terminal the progress line rewrites itself; in a log or a pipe each is a line of its own.
live = sys.stdout.isatty()
start = time.perf_counter()
tier, last_print = None, 0.0
with torch.no_grad():
    while time.perf_counter() - start < 600:
        statuses = hotswap.status(fast)
        serving = statuses[0].tier if statuses else "eager"
        t = time.perf_counter()
        fast(x)
        sync()
        elapsed_ms = (time.perf_counter() - t) * 1e3
        latencies.setdefault(serving, []).append(elapsed_ms)
        now = time.perf_counter() - start
        if serving != tier:
            print(f"{chr(10) if live else ''}[{now:7.2f} s] now served by {serving!r}: "
                  f"{elapsed_ms:.2f} ms/call")
            tier = serving
            if serving != "eager" and first_compiled_s is None:
                first_compiled_s = since_start()
        elif now - last_print > (1.0 if live else 5.0) and statuses:
            status = statuses[0]
            compiling = [name for name, state in status.states if state == "pending"]
            doing = [f"compiling {', '.join(compiling)}"] if compiling else []
            if status.gate:  # the gate's words, without the figures in parentheses
                doing.append(status.gate.split(" (")[0] + status.gate.rsplit(")", 1)[-1]
                             if "(" in status.gate else status.gate)
            line = (f"[{now:7.2f} s] serving {status.tier!r}, {'; '.join(doing) or 'idle'}"
                    + (f" ({status.waiting})" if status.waiting else ""))
            sys.stdout.write(f"\r{line}" if live else f"{line}\n")
            sys.stdout.flush()
            last_print = now
        if statuses and all(s.final for s in statuses) and statuses[0].tier == serving:
            for _ in range(200):  # keep serving a moment on the final tier
                t = time.perf_counter()
                fast(x)
                sync()
                latencies[serving].append((time.perf_counter() - t) * 1e3)
            break
        time.sleep(0.005)
    torch.testing.assert_close(fast(x), model(x), rtol=2e-2, atol=2e-2)
print(("\n\n" if live else "\n") + "output matches eager. calls per tier, median latency:")
for name, values in latencies.items():
    print(f"  {name:<28} {len(values):6d} calls  {statistics.median(values):8.3f} ms")
[status] = hotswap.status(fast)
print(f"final tier: {status.tier!r}; failures: {list(status.failures) or 'none'}")
for name, why in status.kept:
    print(f"  kept back {name!r}: {why}")
print("where the time went (seconds):")
for stage, seconds in status.timings_s.items():
    print(f"  {stage:<45} {seconds:7.3f}")
print("counters:", {k: v for k, v in hotswap.counters().items() if v})
hotswap.shutdown()

# Plain torch.compile, the same model in a fresh process with an inductor cache of its own:
# cold on the demo's first run, warm on later ones, as hotswap's. (This run's cache would hand
# it the kernels hotswap's workers just built, and its temporary folder the C++ header that
# inductor precompiles there whatever its cache: 4.5 s of a cold first call on 2 cores.)
inductor = (os.environ.get("TORCHINDUCTOR_CACHE_DIR", "").rstrip(os.sep)
            or os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
os.makedirs(inductor + "-plain-tmp", mode=0o700, exist_ok=True)
print("\nplain torch.compile, the same model in a fresh process ...", flush=True)
done = subprocess.run([sys.executable, __file__, "--torch-compile"], capture_output=True,
                      text=True, timeout=900,
                      env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor + "-plain",
                           "TMPDIR": inductor + "-plain-tmp",
                           # a program without hotswap: no compile workers beside it
                           "HOTSWAP_START_EARLY": "off"})
try:
    plain_s = json.loads(done.stdout.strip().splitlines()[-1])["first_compiled_call_s"]
except (IndexError, ValueError, KeyError):
    print(f"  it failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
else:
    ours = (f"compiled code served {first_compiled_s:.1f} s" if first_compiled_s is not None
            else f"eager kept ({status.tier!r} measured fastest)")
    print(f"from process start: hotswap answered at once and {ours} after its start; "
          f"torch.compile's first call returned after {plain_s:.1f} s, and every call "
          f"before it would have waited")
