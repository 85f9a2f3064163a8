"""The service's life: started on demand and by the CLI, one per build however many processes
ask at once, a stale socket replaced, idle exit, cancellation reaching the service."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hotswap import cli
from hotswap.executors import registry
from hotswap.executors.service import ServiceExecutor, ServiceLink
from hotswap.service import control, early
from hotswap.service.place import Place, authkey, find_place, stamp
from hotswap.system import bytecode
from tests.conftest import gone
from tests.service.conftest import kill_services, wait_for

ECHO = "hotswap.testing.faults:echo"
SLEEP = "hotswap.testing.faults:sleep"


def status_json(capsys: pytest.CaptureFixture[str], action: str = "status") -> tuple[int, Any]:
    code = cli.main(["service", action, "--json"])
    return code, json.loads(capsys.readouterr().out)


def current_status() -> dict[str, Any] | None:
    place = find_place(create=False)
    return control.probe(place, authkey(place, create=False))


def test_cli_start_status_stop(service_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["service", "status"]) == 1
    assert "no compile service running" in capsys.readouterr().out
    code, started = status_json(capsys, "start")
    assert code == 0 and started["running"] and started["stamp"] == stamp()
    assert started["uid"] == os.geteuid() and not gone(started["pid"])
    assert (service_dir.stat().st_mode & 0o777) == 0o700
    assert (service_dir / f"{stamp()}.sock").stat().st_mode & 0o077 == 0
    assert (service_dir / "authkey").stat().st_mode & 0o777 == 0o600
    code, again = status_json(capsys, "start")  # already running: the same service
    assert code == 0 and again["pid"] == started["pid"]
    assert cli.main(["service", "status"]) == 0
    text = capsys.readouterr().out
    assert f"compile service {stamp()} (pid {started['pid']})" in text
    for field in ("uptime:", "workers:", "jobs: 0 served", "memory:"):
        assert field in text
    assert cli.main(["service", "stop"]) == 0
    assert "stopped the compile service" in capsys.readouterr().out
    wait_for(lambda: gone(started["pid"]), 15)
    assert not (service_dir / f"{stamp()}.sock").exists()
    assert not (service_dir / f"{stamp()}.pid").exists()
    code, after = status_json(capsys)
    assert code == 1 and after == {"running": False}


def test_jobs_run_in_the_service_and_errors_come_back_whole(service_dir: Path) -> None:
    executor = ServiceExecutor()
    assert executor.submit(ECHO, {"x": 1}, 60).result(60) == {"x": 1}
    failed = executor.submit("hotswap.testing.faults:raise_error", "boom", 60).exception(60)
    assert type(failed).__name__ == "CompileFailed"
    assert failed.job == "hotswap.testing.faults:raise_error"  # type: ignore[union-attr]
    assert failed.remote_message == "boom"  # type: ignore[union-attr]
    crashed = executor.submit("hotswap.testing.faults:sigkill", None, 60).exception(60)
    assert type(crashed).__name__ == "WorkerCrashed"
    assert crashed.signal_name == "SIGKILL"  # type: ignore[union-attr]
    status = current_status()
    assert status is not None
    assert (status["jobs_served"], status["jobs_failed"]) == (1, 2)
    assert executor.note == ""


def test_a_cancelled_job_is_cancelled_in_the_service(service_dir: Path) -> None:
    executor = ServiceExecutor()
    assert executor.submit(ECHO, 0, 60).result(60) == 0  # started and warm
    future = executor.submit(SLEEP, 60.0, 120)
    wait_for(lambda: (current_status() or {}).get("jobs_running") == 1)
    assert future.cancel()
    wait_for(lambda: (current_status() or {}).get("jobs_cancelled") == 1, 15)
    assert current_status()["jobs_running"] == 0  # type: ignore[index]


def test_a_stale_socket_is_replaced(service_dir: Path) -> None:
    place = find_place(create=True)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(place.socket))  # bound, never listened on, closed: nobody answers
    stale.close()
    assert control.probe(place, authkey(place, create=True)) is None
    status = control.ensure(place)
    assert status["stamp"] == place.stamp and not gone(status["pid"])
    assert ServiceExecutor().submit(ECHO, "after", 60).result(60) == "after"


def test_the_service_exits_when_idle(service_dir: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSWAP_SERVICE_IDLE_EXIT_S", "1")
    executor = ServiceExecutor()
    assert executor.submit(SLEEP, 1.5, 60).result(60) == 1.5  # longer than the idle limit
    status = current_status()
    assert status is not None and status["idle_exit_s"] == 1
    wait_for(lambda: gone(status["pid"]), 20)
    assert not find_place(create=False).socket.exists()


def test_a_service_started_early_exits_if_no_job_comes_first(service_dir: Path) -> None:
    place = find_place(create=True)
    unused = control.ensure(place, first_job_within_s=1.0)
    wait_for(lambda: gone(unused["pid"]), 20)  # its idle exit is 120 s (the fixture's)
    used = control.ensure(place, first_job_within_s=5.0)
    assert ServiceExecutor().submit(SLEEP, 0.1, 60).result(60) == 0.1
    time.sleep(max(0.0, 6.0 - used["uptime_s"]))  # past the window: a job came in it,
    assert not gone(used["pid"])                  # the usual idle exit holds from then on


def test_service_start_by_name_keeps_a_service_started_early(
        service_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A service started as hotswap was imported has a first-job window; ``hotswap service
    start`` lifts it, so the service stays until its usual idle exit."""
    place = find_place(create=True)
    early = control.ensure(place, first_job_within_s=2.0)
    assert early["first_job_within_s"] == 2.0
    code, status = status_json(capsys, "start")
    assert code == 0 and status["pid"] == early["pid"] and status["first_job_within_s"] is None
    time.sleep(max(0.0, 3.0 - status["uptime_s"]))  # past the window, with no job
    assert not gone(early["pid"])
    assert control.ensure(place)["first_job_within_s"] is None


def test_a_service_of_another_build_is_not_used(service_dir: Path) -> None:
    """A service whose stamp differs (here: it sees other GPUs) is never asked for a job, even
    when its socket sits where this build's would."""
    other_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "7"}
    folder = find_place(create=True).dir
    other = subprocess.Popen([sys.executable, "-m", "hotswap.service", "--dir", str(folder)],
                             env=other_env, start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        ours = find_place(create=False)
        socks: list[Path] = []
        wait_for(lambda: bool(socks.extend(p for p in folder.glob("*.sock")
                                          if p != ours.socket) or socks))
        theirs = Place(folder, socks[0].name.removesuffix(".sock"))
        assert theirs.stamp != ours.stamp
        os.rename(theirs.socket, ours.socket)  # as a stamp collision would put it
        with pytest.raises(control.OtherBuild):
            control.ensure(ours)
        executor = registry.resolve("service://", workers=1)
        assert executor.submit(ECHO, "here", 60).result(120) == "here"  # the local pool
        link = registry.connect("service://").cluster  # type: ignore[attr-defined]
        assert "serves build" in link.refused
        reply = control.request(ours, authkey(ours, create=False), {"kind": "status"})
        assert reply["stamp"] == theirs.stamp and reply["jobs_served"] == 0
    finally:
        other.kill()
        other.wait()


SUBMITTER = """
import json, sys
from hotswap.executors.service import ServiceExecutor
executor = ServiceExecutor()
n = int(sys.argv[1])
futures = [executor.submit("hotswap.testing.faults:echo", [n, k], 120) for k in range(4)]
results = [f.result(180) for f in futures]
print(json.dumps({"results": results, "pid": executor.cluster.client(0).pid}))
executor.shutdown()
"""


def test_sixteen_processes_at_once_share_one_service(service_dir: Path) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", SUBMITTER, str(n)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for n in range(16)]
    outputs = []
    t = time.monotonic()
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        outputs.append(json.loads(out))
    assert [o["results"] for o in outputs] == [[[n, k] for k in range(4)] for n in range(16)]
    assert len({o["pid"] for o in outputs}) == 1, "more than one service was started"
    status = current_status()
    assert status is not None and status["pid"] == outputs[0]["pid"]
    assert status["jobs_served"] == 64 and status["jobs_failed"] == 0, time.monotonic() - t


def test_the_service_names_its_bytecode_and_template_folders_and_its_clients_are_offered_them(
        service_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSWAP_PYCACHE", "on")  # the service and its workers use the cache
    monkeypatch.setattr(bytecode, "_offered", [])
    monkeypatch.setattr(bytecode, "_offered_templates", [])
    link = ServiceLink()
    assert link.client(120) is not None
    status = current_status()
    assert status is not None and status["pycache"] == str(bytecode.plan(os.environ).folder)
    assert bytecode._offered == [Path(status["pycache"])]
    assert status["templates"] == os.path.realpath(bytecode.templates_folder())  # as ours
    assert bytecode.offered_templates() == [Path(status["templates"])]


@pytest.mark.parametrize(("argv", "own"), [
    (["python", "-m", "hotswap.cli", "service", "status"], True),
    (["python", "/venv/bin/hotswap", "service", "status"], True),
    (["python", "-X", "importtime", "-u", "-m", "hotswap.service", "--dir", "d"], True),
    (["python", "-um", "hotswap.workers"], True),
    (["python", "-m", "hotswap.system.bytecode_fill", "/cache/pycache-311"], True),
    (["python", "-mhotswap"], True),
    (["python", "-m", "hotswap.tools.bench.main", "--row", "hotswap:async"], False),
    (["python", "-Xdev", "-W", "ignore", "train.py", "hotswap"], False),
    (["python", "-c", "import hotswap", "-m", "hotswap.cli"], False),
    (["python", "-uX", "importtime", "-m", "hotswap.cli"], True),
    (["python", "-uXimporttime", "-m", "hotswap.cli"], True),
    (["python", "-uWerror::DeprecationWarning", "-m", "hotswap.cli"], True),
    (["python", "-W", "error", "serve.py"], False),
    (["python"], False),
])
def test_own_programs_are_told_from_the_users(argv: list[str], own: bool) -> None:
    assert early.own_program(argv) is own


def test_who_starts_the_service_early(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSWAP_START_EARLY", "on")
    monkeypatch.setenv("HOTSWAP_SERVICE", "on")
    monkeypatch.delenv("HOTSWAP_EXECUTOR", raising=False)
    monkeypatch.delenv("HOTSWAP_SCRATCH_DIR", raising=False)
    monkeypatch.setattr(sys, "orig_argv", ["python", "train.py"])
    assert early._wanted() is early._service_early
    monkeypatch.setattr(sys, "orig_argv", ["python", "/venv/bin/hotswap", "service", "stop"])
    assert early._wanted() is None
    monkeypatch.setattr(sys, "orig_argv", ["python", "train.py"])
    for name, value in [("HOTSWAP_EXECUTOR", "local"), ("HOTSWAP_SERVICE", "off"),
                        ("HOTSWAP_SERVICE", "maybe"), ("HOTSWAP_SCRATCH_DIR", "/tmp/w"),
                        ("HOTSWAP_START_EARLY", "off"), ("HOTSWAP_START_EARLY", "maybe")]:
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert early._wanted() is not early._service_early, (name, value)


EARLY = """
import threading
import time
import hotswap
from hotswap.service import control, early
from hotswap.service.place import authkey, find_place

deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    try:
        place = find_place(create=False)
        status = control.probe(place, authkey(place, create=False))
    except (FileNotFoundError, control.NotAnswering):
        status = None
    if status is not None:
        print(status["pid"])
        break
    time.sleep(0.05)
"""


def test_importing_hotswap_starts_the_service_and_its_command_line_does_not(
        service_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSWAP_START_EARLY", "on")
    monkeypatch.setenv("HOTSWAP_SERVICE", "on")
    status = subprocess.run([sys.executable, "-m", "hotswap.cli", "service", "status"],
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 1 and "no compile service running" in status.stdout
    time.sleep(1.0)  # a start under way would have made the folder by now
    assert not service_dir.exists()
    # a user's program: no compile asked for, the service answers all the same
    user = subprocess.run([sys.executable, "-c", EARLY], capture_output=True, text=True,
                          timeout=120)
    assert user.returncode == 0 and user.stdout.strip(), user.stderr
    status_now = current_status()
    assert status_now is not None and status_now["pid"] == int(user.stdout)
    monkeypatch.setenv("HOTSWAP_SERVICE", "off")
    monkeypatch.setenv("HOTSWAP_START_EARLY", "off")  # no local pool either
    monkeypatch.setenv("HOTSWAP_SERVICE_DIR", str(service_dir.parent / "other"))
    off = subprocess.run([sys.executable, "-c", EARLY.replace("60", "3")],
                         capture_output=True, text=True, timeout=120)
    assert off.returncode == 0 and off.stdout.strip() == "", off.stdout


SPAWNS = """
import multiprocessing, sys
from hotswap.service import early

WANTED_AT_IMPORT = early._wanted() is not None  # in a spawned child: as it re-imports this module

def report(queue):
    queue.put(WANTED_AT_IMPORT)

if __name__ == "__main__":
    ctx = multiprocessing.get_context(sys.argv[1])
    queue = ctx.Queue()
    child = ctx.Process(target=report, args=(queue,))
    child.start()
    print(WANTED_AT_IMPORT, queue.get(timeout=60))
    child.join(60)
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_multiprocessing_children_start_no_service(method: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "spawns.py"
    script.write_text(SPAWNS)
    monkeypatch.setenv("HOTSWAP_START_EARLY", "on")
    monkeypatch.setenv("HOTSWAP_SERVICE", "on")
    monkeypatch.setenv("HOTSWAP_SERVICE_DIR", str(tmp_path / "svc"))
    monkeypatch.setenv("HOTSWAP_SERVICE_IDLE_EXIT_S", "5")
    try:
        done = subprocess.run([sys.executable, str(script), method], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
    finally:
        kill_services(tmp_path / "svc")  # the parent's own, started as it imported hotswap
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False"]  # the parent would, its child does not


def _take_key(place: Place, barrier: threading.Barrier, keys: list[bytes],
              errors: list[BaseException]) -> None:
    barrier.wait()
    try:
        keys.append(authkey(place, create=True))
    except BaseException as e:
        errors.append(e)


def test_threads_racing_to_make_the_key_all_read_one_whole_key(tmp_path: Path) -> None:
    """The key is written whole under a temporary name and linked into place: sixteen
    processes starting a service at once read an empty key file that one had created and
    not yet written ("shorter than 32 bytes")."""
    for attempt in range(30):
        folder = tmp_path / str(attempt)
        folder.mkdir(mode=0o700)
        place = Place(folder, "stamp")
        barrier = threading.Barrier(16)
        keys: list[bytes] = []
        errors: list[BaseException] = []
        threads = [threading.Thread(target=_take_key, args=(place, barrier, keys, errors))
                   for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors[0]
        assert len(set(keys)) == 1 and len(keys[0]) == 32
        assert (folder / "authkey").stat().st_mode & 0o777 == 0o600
        assert sorted(p.name for p in folder.iterdir()) == ["authkey"]  # no temporary left
