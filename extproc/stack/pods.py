"""`extproc pod kill|hang|slow|errors|heal POD`: faults in a running local stack, for demos.

A pod is named by its address (`127.0.0.1:8001`, as the router and the status page show it)
or its child name (`sim-1`). Only children of the stack in `--workdir` are touched: the
address is looked up in the stack's `stack.json`, never taken as a URL from the command line.

- kill: SIGKILL the simulator process (the router sees its scrapes fail and routes around it).
- hang: completions hang (the router's stall detection takes the pod out of the candidates).
- slow: the supervisor pauses the process part of the time (SIGSTOP/SIGCONT), like a
  throttled CPU: everything the pod does, scrapes included, takes longer.
- errors: a fraction of completions answer 503.
- heal: clear the faults; a dead pod is started again by the supervisor.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from extproc.stack.local import FAULTS_DIR, RESTART_DIR, STATE_FILE

__all__ = ["Child", "PodError", "add_pod_arguments", "find_child", "read_children", "run_pod"]

_CLEAR = {"metrics": "ok", "completions_hang": False, "healthy": True, "error_rate": 0.0}


class PodError(RuntimeError):
    """The stack or the pod was not found, or the pod did not accept the fault."""


@dataclass(frozen=True, slots=True)
class Child:
    name: str
    pid: int
    address: str | None

    @property
    def running(self) -> bool:
        return _pid_alive(self.pid) and _is_ours(self)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but someone else's: certainly not our child
        return False
    return True


def _is_ours(child: Child) -> bool:
    """Guard against a recycled pid: the process must still be the one the stack started."""
    try:
        cmdline = Path(f"/proc/{child.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True  # no /proc (not Linux): the pid check is all we have
    if child.address is None or not child.name.startswith("sim-"):
        return True
    port = child.address.rpartition(":")[2].encode()
    return b"sim" in cmdline and port in cmdline


def read_children(workdir: Path) -> list[Child]:
    path = workdir / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        raise PodError(f"no local stack in {workdir} (start one with `extproc up`)") from None
    except ValueError as exc:
        raise PodError(f"{path} is not valid JSON: {exc}") from None
    if not _pid_alive(int(state.get("supervisor_pid", 0))):
        raise PodError(f"the stack in {workdir} is not running (its supervisor is gone)")
    return [
        Child(str(c["name"]), int(c["pid"]), c.get("address")) for c in state.get("children", [])
    ]


def find_child(children: list[Child], pod: str) -> Child:
    for child in children:
        if child.name.startswith("sim-") and pod in (child.name, child.address):
            return child
    pods = ", ".join(f"{c.address} ({c.name})" for c in children if c.name.startswith("sim-"))
    raise PodError(f"no simulated pod {pod!r} in this stack; pods: {pods or 'none'}")


def _post_faults(child: Child, faults: dict[str, Any]) -> dict[str, Any]:
    if not child.running:
        raise PodError(f"{child.name} ({child.address}) is not running; `heal` starts it again")
    try:
        resp = httpx.post(f"http://{child.address}/admin/faults", json=faults, timeout=5)
    except httpx.HTTPError as exc:
        raise PodError(f"{child.name} ({child.address}) did not answer: {exc}") from None
    if resp.status_code != 200:
        raise PodError(f"{child.name} refused the fault: {resp.status_code} {resp.text[:200]}")
    out: dict[str, Any] = resp.json()
    return out


def _set_slow(workdir: Path, child: Child, duty: float | None) -> None:
    """The supervisor reads `faults/<name>` (the paused fraction) on every tick."""
    path = workdir / FAULTS_DIR / child.name
    if duty is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"{duty}\n")


def apply(workdir: Path, action: str, pod: str, *, rate: float = 0.5, duty: float = 0.8) -> str:
    """Inject one fault; returns what was done, in one line."""
    child = find_child(read_children(workdir), pod)
    who = f"{child.name} ({child.address})"
    if action == "kill":
        if not child.running:
            raise PodError(f"{who} is not running")
        os.kill(child.pid, signal.SIGKILL)
        return f"killed {who}, pid {child.pid}"
    if action == "hang":
        _post_faults(child, {"completions_hang": True})
        return f"{who}: completions hang (until `heal`)"
    if action == "errors":
        _post_faults(child, {"error_rate": rate})
        return f"{who}: {rate:.0%} of completions answer 503"
    if action == "slow":
        if not 0 < duty < 1:
            raise PodError("--duty must be within (0, 1)")
        if not child.running:
            raise PodError(f"{who} is not running")
        _set_slow(workdir, child, duty)
        return f"{who}: paused {duty:.0%} of the time (until `heal`)"
    if action == "heal":
        _set_slow(workdir, child, None)
        if not child.running:
            restart = workdir / RESTART_DIR
            restart.mkdir(exist_ok=True)
            (restart / child.name).touch()
            return f"{who}: asked the supervisor to start it again"
        _post_faults(child, dict(_CLEAR))
        return f"{who}: faults cleared"
    raise PodError(f"unknown action {action!r}")


ACTIONS = ("kill", "hang", "slow", "errors", "heal")


def add_pod_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action", choices=ACTIONS,
        help="kill: SIGKILL; hang: completions hang; slow: paused --duty of the time "
        "(SIGSTOP/SIGCONT); errors: --rate of completions answer 503; heal: clear the faults, "
        "or start a dead one again",
    )  # fmt: skip
    p.add_argument("pod", help="the pod's address (127.0.0.1:8001) or child name (sim-1)")
    p.add_argument(
        "--workdir", default=".run", help="the stack's workdir (`extproc up --workdir`; default: .run)"
    )  # fmt: skip
    p.add_argument(
        "--rate", type=float, default=0.5, help="errors: fraction answered 503 (default: 0.5)"
    )
    p.add_argument(
        "--duty", type=float, default=0.8, help="slow: fraction of time paused (default: 0.8)"
    )


def run_pod(args: argparse.Namespace) -> int:
    try:
        print(apply(Path(args.workdir), args.action, args.pod, rate=args.rate, duty=args.duty))
    except PodError as exc:
        print(f"extproc pod: {exc}", file=sys.stderr)
        return 1
    return 0
