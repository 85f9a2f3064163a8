"""``hotswap bench --service``: the windows and the settle time on made-up requests (exact
numbers), and a short run of real servers driven over HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hotswap.tools.bench import latency
from hotswap.tools.bench import main as bench
from hotswap.tools.bench.latency import Request

ROOT = Path(__file__).resolve().parents[2]


def ok(sent_s: float, ms: float) -> Request:
    return Request(sent_s, ms / 1e3, 200)


# Five 10 s windows: two refused and a slow answer while the server starts, a queue draining,
# then three calm windows.
REQUESTS = [
    Request(0.0, None, None, "refused"), Request(5.0, None, None, "refused"), ok(8.0, 100),
    ok(10, 50), ok(12, 20), ok(14, 30), ok(16, 40),
    ok(20, 10), ok(22, 11), ok(24, 12), ok(26, 13),
    ok(30, 10), ok(32, 12), ok(34, 11), ok(36, 12),
    ok(40, 11), ok(42, 12), ok(44, 12), ok(46, 10),
]


def test_percentile_is_nearest_rank() -> None:
    values = list(range(100, 0, -1))  # 1..100, unsorted
    assert latency.percentile(values, 0.99) == 99
    assert latency.percentile(values, 0.5) == 50
    assert latency.percentile(values, 1.0) == 100
    assert latency.percentile([20, 30, 40, 50], 0.5) == 30
    assert latency.percentile([20, 30, 40, 50], 0.99) == 50
    assert latency.percentile([7.0], 0.99) == 7.0


def test_windows_count_answered_and_failed_and_take_percentiles() -> None:
    spans = latency.windows(REQUESTS, 10, 50)
    assert [(w.start_s, w.end_s, w.sent, w.answered, w.failed) for w in spans] == [
        (0, 10, 3, 1, 2), (10, 20, 4, 4, 0), (20, 30, 4, 4, 0), (30, 40, 4, 4, 0),
        (40, 50, 4, 4, 0)]
    assert [ms for w in spans for ms in (w.p50_ms, w.p99_ms, w.max_ms)] == pytest.approx(
        [100, 100, 100, 30, 50, 50, 11, 13, 13, 11, 12, 12, 11, 12, 12])
    # the last window is shorter when the windows do not divide the run; none is empty-handed
    assert [(w.start_s, w.end_s) for w in latency.windows(REQUESTS, 20, 50)] == [
        (0, 20), (20, 40), (40, 50)]
    empty = latency.windows([], 10, 20)
    assert [(w.sent, w.p99_ms) for w in empty] == [(0, None), (0, None)]


def test_final_p99_pools_the_last_windows_and_settle_is_read_off_them() -> None:
    spans = latency.windows(REQUESTS, 10, 50)
    # the last three windows: 10,10,10,11,11,11,12,12,12,12,12,13 -> the 12th of 12
    assert latency.FINAL_WINDOWS == 3
    assert latency.final_p99_ms(REQUESTS, spans) == pytest.approx(13)
    assert latency.final_p99_ms(REQUESTS, spans, final_windows=1) == pytest.approx(12)
    # 10-20 s stood at 50 ms > 1.1 x 13; from 20 s on every window is within
    assert latency.settled_s(spans, 13) == 20
    # at exactly 1.1x it is settled; a window below the final p99 is settled too
    assert latency.settled_s(spans, 50 / 1.1) == 10
    assert latency.settled_s(spans, 100) == 10  # 0-10 s failed two requests: never settled
    # the last window failing a request, or standing above, settles nothing
    late = [*REQUESTS, Request(48, None, None, "timeout")]
    assert latency.settled_s(latency.windows(late, 10, 50), 13) is None
    assert latency.settled_s(spans, 10) is None
    assert latency.settled_s(spans, None) is None


def test_summary_and_report() -> None:
    summary = latency.summarize("hotswap:async", REQUESTS, 10, 50)
    assert summary.first_answer_s == pytest.approx(8.1)  # sent at 8 s, answered 100 ms later
    assert (summary.refused, summary.failed) == (2, 2)
    assert summary.final_p99_ms == pytest.approx(13) and summary.settled_s == 20
    assert summary.max_ms == pytest.approx(100)
    never = latency.summarize("eager", [Request(0.0, None, None, "refused")], 10, 10)
    assert never.first_answer_s is None and never.settled_s is None
    lines = latency.report([summary, never], {"hotswap:async": "listening at 7.90 s"})
    text = "\n".join(lines)
    assert ("hotswap:async: first answer 8.10 s, 2 refused before it listened, 0 other "
            "failures; listening at 7.90 s") in text
    assert "  20-30            4     4      0    11.00    13.00     13.0" in lines
    row = next(line for line in lines if line.startswith("hotswap:async "))
    assert row.split() == ["hotswap:async", "8.10", "20", "13.00", "100.0", "2"]
    assert next(line for line in lines if line.startswith("eager ")).split()[2] == "never"


def test_bad_variants_and_rates() -> None:
    with pytest.raises(SystemExit, match="unknown variants"):
        bench.main(["--service", "--variants", "eager,hotswap:warp", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--rate must be > 0"):
        bench.main(["--service", "--rate", "0", "--device", "cpu"])
    with pytest.raises(SystemExit, match="unknown bench models"):
        bench.main(["--service", "--models", "training", "--device", "cpu"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_short_run_records_every_request(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    rate, duration_s, variants = 20, 8, ["eager", "hotswap:async"]
    argv = ["--service", "--models", "mlp", "--variants", ",".join(variants), "--rate",
            str(rate), "--duration-s", str(duration_s), "--window-s", "2", "--device", "cpu",
            "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    data = json.loads((tmp_path / "serve-mlp.json").read_text())
    assert (data["rate"], data["duration_s"], data["model"]) == (rate, duration_s, "mlp")
    assert list(data["variants"]) == variants
    for name, run in data["variants"].items():
        requests = run["requests"]
        # one record per request sent, on the open loop's schedule, each answered or failed
        assert [r["sent_s"] for r in requests] == pytest.approx(
            [i / rate for i in range(rate * duration_s)])
        for r in requests:
            answered = r["status"] == 200 and r["latency_ms"] is not None and r["error"] is None
            assert answered or r["error"], r
        windows = run["summary"]["windows"]
        assert [(w["start_s"], w["end_s"]) for w in windows] == [(0, 2), (2, 4), (4, 6), (6, 8)]
        assert sum(w["sent"] for w in windows) == len(requests)
        assert sum(w["failed"] for w in windows) == run["summary"]["failed"]
        assert Path(run["log"]).exists(), name
    eager = data["variants"]["eager"]
    # the eager server listens within seconds: from then on requests are answered
    assert eager["server"]["ready_s"] is not None
    assert eager["summary"]["first_answer_s"] >= eager["summary"]["refused"] / rate - 0.1
    assert any(w["p99_ms"] is not None for w in eager["summary"]["windows"])
    assert (tmp_path / "serve-mlp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "p99 settled s" in out and "hotswap:async: first answer" in out


def test_example_is_the_bench_with_service() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "serve_bench.py"), "--help"],
                          capture_output=True, text=True, timeout=60, check=True)
    assert "--duration-s" in proc.stdout and "--variants" in proc.stdout
