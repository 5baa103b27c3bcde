"""Test builders for discovery tests: pods, a callback recorder, polling waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

__all__ = ["Recorder", "make_pod", "wait_until", "write_kubeconfig"]


class Recorder:
    """Collects callback arguments from watcher threads; tests wait on a predicate."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self._cond = threading.Condition()

    def __call__(self, *args: Any) -> None:
        with self._cond:
            self.calls.append(args if len(args) != 1 else args[0])
            self._cond.notify_all()

    @property
    def last(self) -> Any:
        with self._cond:
            return self.calls[-1]

    def wait_for(self, predicate: Callable[[Any], bool], timeout: float = 10.0) -> Any:
        """Waits until the latest call satisfies `predicate` and returns it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (self.calls and predicate(self.calls[-1])):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"timed out; last calls: {self.calls[-3:]}")
                self._cond.wait(remaining)
            return self.calls[-1]


def make_pod(
    name: str,
    ip: str | None = "10.0.0.1",
    *,
    ready: bool = True,
    labels: Mapping[str, str] | None = None,
    namespace: str = "llm",
    deleting: bool = False,
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip is not None:
        status["podIP"] = ip
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": dict(labels if labels is not None else {"app": "vllm"}),
    }
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "status": status}


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def write_kubeconfig(path: Path, server: str, *, token: str, namespace: str | None = None) -> Path:
    """A kubeconfig with one context: `server`, a bearer `token`, and a default namespace."""
    context: dict[str, str] = {"cluster": "c", "user": "u"}
    if namespace is not None:
        context["namespace"] = namespace
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "x", "context": context}],
        "current-context": "x",
    }
    path.write_text(yaml.safe_dump(config))
    return path
