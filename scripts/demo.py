"""hotswap demo: a model served at once, sped up in the background.

A service loop calls an MLP every few milliseconds. hotswap answers the first call eagerly
(no compile in this process), compiles the tiers of the ladder in worker processes, and swaps
each in when it is ready. The loop prints every tier change as it happens, then a summary.
No `if __name__ == "__main__":` guard on purpose: workers never re-run this script.
"""

import statistics
import sys
import time

import torch

import hotswap

cuda = torch.cuda.is_available()
device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
width, depth, batch = (4096, 8, 512) if cuda else (512, 4, 64)
layers = []
for _ in range(depth):
    layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
model = torch.nn.Sequential(*layers).to(device, dtype).eval()
x = torch.randn(batch, width, device=device, dtype=dtype)
sync = torch.cuda.synchronize if cuda else (lambda: None)

# What a service does at start-up, before it serves: start the compile workers and warm this
# process's load path, so neither delays the first swap nor competes with served calls.
t = time.perf_counter()
hotswap.prepare(wait=True, timeout_s=300)
print(f"hotswap.prepare: workers ready and this process warmed in {time.perf_counter() - t:.1f} s")

tiers = ["default", "max-autotune-no-cudagraphs"]
print(f"{depth}-layer MLP, width {width}, batch {batch}, {device} {dtype}; ladder: eager -> "
      f"{' -> '.join(tiers)}")
fast = hotswap.compile(model, mode="progressive", tiers=tiers)

latencies: dict[str, list[float]] = {}
# On a terminal the progress line rewrites itself; in a log or a pipe each is a line of its own.
live = sys.stdout.isatty()
start = time.perf_counter()
tier, last_print = None, 0.0
with torch.no_grad():
    while time.perf_counter() - start < 600:
        serving = hotswap.status(fast)[0].tier if hotswap.status(fast) else "eager"
        t = time.perf_counter()
        y = fast(x)
        sync()
        elapsed_ms = (time.perf_counter() - t) * 1e3
        latencies.setdefault(serving, []).append(elapsed_ms)
        now = time.perf_counter() - start
        if serving != tier:
            print(f"{chr(10) if live else ''}[{now:7.2f} s] now served by {serving!r}: "
                  f"{elapsed_ms:.2f} ms/call")
            tier = serving
        elif now - last_print > (1.0 if live else 5.0):
            status = hotswap.status(fast)[0]
            line = (f"[{now:7.2f} s] serving {status.tier!r}, compiling "
                    f"{', '.join(status.pending) or 'nothing'} ..."
                    + (f" ({status.waiting})" if status.waiting else ""))
            sys.stdout.write(f"\r{line}" if live else f"{line}\n")
            sys.stdout.flush()
            last_print = now
        statuses = hotswap.status(fast)
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
print(f"final tier: {status.tier!r}; failures: {list(status.failures) or 'none'}; "
      f"kept back: {list(status.kept) or 'none'}")
print("where the time went (seconds):")
for stage, seconds in status.timings_s.items():
    print(f"  {stage:<45} {seconds:7.3f}")
print("counters:", hotswap.counters())
