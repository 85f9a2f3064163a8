"""With ``TORCH_TRACE=DIR``, each compile worker writes its trace in a folder named for it
(``DIR/worker-<slot>``), the caller's file alone in DIR: ``ls DIR`` tells them apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hotswap.executors.local import trace_dirs

# torch reads TORCH_TRACE when it is imported: the caller is a process of its own.
CALLER = """
import json, torch, hotswap
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
compiled = hotswap.compile(model, mode="async")
x = torch.randn(4, 8)
compiled(x)
[status] = hotswap.wait(compiled, timeout_s=120)
print(json.dumps({"final": status.final, "path": status.path,
                  "workers": hotswap.runtime().worker_pids()}))
"""


def test_a_worker_writes_its_trace_in_a_folder_named_for_it(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    env = {**os.environ, "TORCH_TRACE": str(trace),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    out = subprocess.run([sys.executable, "-c", CALLER], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["final"] and result["path"] == "worker", (result, out.stderr[-2000:])
    [caller] = [p for p in trace.iterdir() if p.is_file()]
    assert caller.name.startswith("dedicated_log_torch_trace_")
    assert '"dynamo_start"' in caller.read_text()
    folders = [p for p in trace.iterdir() if p.is_dir()]
    assert [p.name for p in folders] == ["worker-0"]
    [worker] = folders[0].iterdir()  # one worker compiled, and wrote one file
    assert worker.name.startswith("dedicated_log_torch_trace_")
    text = worker.read_text()
    assert '"inductor_output_code"' in text and '"dynamo_start"' not in text
    pids = {int(line.split()[2]) for line in text.splitlines() if line[:1] in "VWIE"}
    assert pids and pids <= set(result["workers"])


def test_only_a_caller_with_torch_trace_gives_its_workers_a_folder(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_TRACE", raising=False)
    monkeypatch.delenv("TORCH_DTRACE", raising=False)
    assert trace_dirs(0) == {}
    monkeypatch.setenv("TORCH_TRACE", "/tmp/t")
    assert trace_dirs(1) == {"TORCH_TRACE": "/tmp/t/worker-1"}
