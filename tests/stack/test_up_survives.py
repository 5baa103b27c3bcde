"""`extproc up` as a user runs it: a simulator killed with SIGKILL is reported, the router
(two server processes) routes around it and traffic keeps succeeding; `extproc pod heal`
or `extproc up --restart` brings it back and it serves again. `extproc pod hang|slow|errors`
reach the pod they name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from extproc.admin.guard import ADMIN_TOKEN_HEADER
from extproc.stack.local import ADMIN_TOKEN_FILE
from tests.e2e.harness import metric_samples, metric_sum, port_block, wait_for

pytestmark = pytest.mark.e2e

CHAT = {
    "model": "qwen3",
    "messages": [{"role": "user", "content": "Say hello"}],
    "max_tokens": 4,
}


@dataclass
class Up:
    proc: subprocess.Popen[bytes]
    workdir: Path
    base: int
    stderr_path: Path

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.base + 30}"

    def sim(self, i: int) -> str:
        return f"127.0.0.1:{self.base + i}"

    def admin(self, process: int) -> str:
        return f"http://127.0.0.1:{self.base + 36 + process}"

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def pod(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "extproc", "pod", *args, "--workdir", str(self.workdir)],
            capture_output=True,
            text=True,
            timeout=30,
        )

    def ready_on_every_process(self, address: str) -> set[bool | None]:
        seen: set[bool | None] = set()
        for p in range(2):
            try:
                token = (self.workdir / ADMIN_TOKEN_FILE).read_text().strip()
                eps = httpx.get(
                    f"{self.admin(p)}/debug/endpoints",
                    headers={ADMIN_TOKEN_HEADER: token},
                    timeout=2,
                ).json()
            except httpx.HTTPError:
                seen.add(None)
                continue
            seen.add(next((bool(e["ready"]) for e in eps if e["address"] == address), None))
        return seen

    def served(self, i: int) -> float:
        return metric_sum(
            metric_samples(f"http://{self.sim(i)}/metrics"), "vllm:request_success_total"
        )


def start_up(workdir: Path, *extra: str) -> Up:
    base = port_block()
    args = [
        sys.executable, "-m", "extproc", "up", "--sims", "3", "--processes", "2",
        "--sim-base-port", str(base), "--kv-base-port", str(base + 10),
        "--listen-port", str(base + 30), "--admin-port", str(base + 31),
        "--grpc-port", str(base + 32), "--metrics-port", str(base + 36),
        "--nats-port", str(base + 25), "--workdir", str(workdir),
        "--sim-arg=--time-scale", "--sim-arg=0.2", *extra,
    ]  # fmt: skip
    out, err = workdir / "up.out", workdir / "up.err"
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        args,
        stdout=out.open("wb"),
        stderr=err.open("wb"),
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    up = Up(proc, workdir, base, err)
    if not wait_for(lambda: "READY" in out.read_text() or proc.poll() is not None, 120, 0.2):
        proc.kill()
        pytest.fail(f"extproc up did not get ready:\n{up.stderr()[-3000:]}")
    if proc.poll() is not None:
        pytest.fail(f"extproc up exited with {proc.returncode}:\n{up.stderr()[-3000:]}")
    return up


def stop_up(up: Up) -> None:
    up.proc.send_signal(signal.SIGINT)
    try:
        assert up.proc.wait(30) == 0
    finally:
        if up.proc.poll() is None:
            up.proc.kill()


@dataclass
class Traffic:
    """Sequential chat requests from a thread; each result is kept with its send time."""

    url: str
    results: list[tuple[float, int | str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                t = time.monotonic()
                try:
                    status: int | str = client.post(
                        f"{self.url}/v1/chat/completions", json=CHAT
                    ).status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                self.results.append((t, status))

    def stop(self) -> list[tuple[float, int | str]]:
        self._stop.set()
        self._thread.join(60)
        return self.results


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    u = start_up(tmp_path_factory.mktemp("up"))
    try:
        yield u
    finally:
        stop_up(u)


def test_a_killed_simulator_is_reported_and_the_rest_keeps_serving(up: Up) -> None:
    address = up.sim(1)
    traffic = Traffic(up.gateway)
    assert wait_for(lambda: len(traffic.results) >= 5, 30)
    killed = up.pod("kill", address)
    assert killed.returncode == 0, killed.stderr
    assert "killed sim-1" in killed.stdout
    killed_at = time.monotonic()
    assert wait_for(lambda: "sim-1 (" + address + ") exited, killed by SIGKILL" in up.stderr(), 10)
    assert wait_for(lambda: up.ready_on_every_process(address) == {False}, 15)
    served_after_exclusion = time.monotonic()
    sent_before = len(traffic.results)
    assert wait_for(lambda: len(traffic.results) >= sent_before + 20, 60)
    results = traffic.stop()
    assert up.proc.poll() is None, up.stderr()[-2000:]  # the stack is still up
    after_kill = [s for t, s in results if t >= killed_at]
    assert after_kill and all(s == 200 for s in after_kill), after_kill
    assert len([t for t, _ in results if t >= served_after_exclusion]) >= 20
    assert up.pod("hang", address).returncode == 1  # a dead pod takes no faults


def test_heal_starts_the_dead_simulator_again_and_it_serves(up: Up) -> None:
    address = up.sim(1)
    if up.ready_on_every_process(address) != {False}:  # run alone: kill it first
        assert up.pod("kill", address).returncode == 0
        assert wait_for(lambda: up.ready_on_every_process(address) == {False}, 15)
    healed = up.pod("heal", "sim-1")
    assert healed.returncode == 0, healed.stderr
    assert wait_for(lambda: "sim-1 (" + address + ") started again" in up.stderr(), 10)
    assert wait_for(lambda: up.ready_on_every_process(address) == {True}, 30)
    with httpx.Client(timeout=30) as client:
        for _ in range(30):
            assert client.post(f"{up.gateway}/v1/chat/completions", json=CHAT).status_code == 200
    assert up.served(1) > 0  # the new process answered part of the traffic


def test_hang_errors_and_heal_reach_the_named_pod_only(up: Up) -> None:
    def faults(i: int) -> dict[str, object]:
        out: dict[str, object] = httpx.get(f"http://{up.sim(i)}/admin/faults", timeout=5).json()
        return out

    assert up.pod("hang", up.sim(2)).returncode == 0
    assert up.pod("errors", "sim-2", "--rate", "0.25").returncode == 0
    assert faults(2)["completions_hang"] is True and faults(2)["error_rate"] == 0.25
    assert faults(0)["completions_hang"] is False and faults(0)["error_rate"] == 0.0
    bad = up.pod("errors", "sim-2", "--rate", "2")
    assert bad.returncode == 1 and "error_rate" in bad.stderr
    assert up.pod("heal", up.sim(2)).returncode == 0
    assert faults(2)["completions_hang"] is False and faults(2)["error_rate"] == 0.0
    unknown = up.pod("kill", "127.0.0.1:1")
    assert unknown.returncode == 1 and "no simulated pod" in unknown.stderr


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_slow_pauses_the_pod_part_of_the_time_until_heal(up: Up) -> None:
    state = json.loads((up.workdir / "stack.json").read_text())
    pid = next(c["pid"] for c in state["children"] if c["name"] == "sim-0")
    assert up.pod("slow", up.sim(0), "--duty", "0.9").returncode == 0
    assert wait_for(lambda: _state(pid) == "T", 10, 0.01)  # stopped (paused) at times
    assert up.pod("heal", up.sim(0)).returncode == 0
    time.sleep(0.5)  # a throttle period or two
    states = []
    for _ in range(50):
        states.append(_state(pid))
        time.sleep(0.01)
    assert "T" not in states
    assert httpx.get(f"http://{up.sim(0)}/health", timeout=5).status_code == 200


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_with_restart_a_killed_simulator_and_envoy_come_back_by_themselves(
    tmp_path: Path,
) -> None:
    u = start_up(tmp_path / "up-restart", "--restart")
    try:
        address = u.sim(0)
        assert u.pod("kill", address).returncode == 0
        assert wait_for(lambda: "sim-0 (" + address + ") exited" in u.stderr(), 10)
        assert "restarting in 1s" in u.stderr()
        assert wait_for(lambda: "sim-0 (" + address + ") started again" in u.stderr(), 15)
        # Back at its address (an idle pod killed and restarted between two of its scrapes is
        # never seen down: readiness alone does not say the new engine listens yet).
        assert wait_for(lambda: answers(f"http://{address}/health"), 30)
        assert wait_for(lambda: u.ready_on_every_process(address) == {True}, 30)
        with httpx.Client(timeout=30) as client:
            for _ in range(30):
                r = client.post(f"{u.gateway}/v1/chat/completions", json=CHAT)
                assert r.status_code == 200
        assert u.served(0) > 0 and u.proc.poll() is None
        # The gateway itself comes back too.
        state = json.loads((u.workdir / "stack.json").read_text())
        envoy = next(c for c in state["children"] if c["name"] == "envoy")
        os.kill(envoy["pid"], signal.SIGKILL)
        assert wait_for(lambda: "envoy (" in u.stderr() and "killed by SIGKILL" in u.stderr(), 10)
        assert wait_for(lambda: u.stderr().count("started again") == 2, 15), u.stderr()[-2000:]

        def serves() -> bool:
            try:
                r = httpx.post(f"{u.gateway}/v1/chat/completions", json=CHAT, timeout=10)
            except httpx.HTTPError:
                return False
            return r.status_code == 200

        assert wait_for(serves, 30, 0.5)
        assert u.proc.poll() is None
    finally:
        stop_up(u)
