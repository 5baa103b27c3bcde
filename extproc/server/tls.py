"""TLS credentials for the gRPC server that follow certificate rotation without a restart.

cert-manager and Kubernetes secret mounts replace the files in place; gRPC asks
`CertificateFiles.fetch` at each new handshake, and we hand it a new configuration when the
files changed. Established connections keep their session; new ones get the new certificate.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import grpc

__all__ = ["CertificateFiles", "TLSFileError"]

log = logging.getLogger("extproc.server.tls")

_Signature = tuple[tuple[int, int, int], ...]


class TLSFileError(ValueError):
    """A certificate, key or CA file is missing or is not PEM."""


def _read_pem(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TLSFileError(f"cannot read TLS {what} {path}: {exc.strerror}") from None
    if b"-----BEGIN " not in data or b"-----END " not in data:
        # Also catches a file caught half-written during rotation.
        raise TLSFileError(f"TLS {what} {path} is not a complete PEM file")
    return data


class CertificateFiles:
    """Server certificate + key (+ client CA for mTLS) read from files, re-read on change."""

    def __init__(
        self,
        cert_file: str,
        key_file: str,
        client_ca_file: str | None = None,
        *,
        check_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cert_file = cert_file
        self._key_file = key_file
        self._client_ca_file = client_ca_file
        self._interval = check_interval_s
        self._clock = clock
        self._initial = self._load()  # fail start-up loudly on bad files
        self._loaded = self._signature()
        self._checked_at = clock()
        self.reloads = 0
        self.reload_errors = 0

    @property
    def require_client_auth(self) -> bool:
        return self._client_ca_file is not None

    def _paths(self) -> tuple[str, ...]:
        paths = (self._cert_file, self._key_file)
        return (*paths, self._client_ca_file) if self._client_ca_file else paths

    def _signature(self) -> _Signature:
        out: list[tuple[int, int, int]] = []
        for p in self._paths():
            try:
                st = os.stat(p)
            except OSError:
                out.append((-1, -1, -1))
                continue
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(out)

    def _load(self) -> grpc.ServerCertificateConfiguration:
        key = _read_pem(self._key_file, "key")
        cert = _read_pem(self._cert_file, "certificate")
        ca = _read_pem(self._client_ca_file, "client CA") if self._client_ca_file else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's fetcher: a new configuration when the files changed, else None (keep)."""
        now = self._clock()
        if now - self._checked_at < self._interval:
            return None
        self._checked_at = now
        sig = self._signature()
        if sig == self._loaded:
            return None
        try:
            config = self._load()
        except TLSFileError as exc:
            # Keep serving with the old certificate; retry at the next interval.
            self.reload_errors += 1
            log.error("TLS reload failed, keeping the current certificate: %s", exc)
            return None
        self._loaded = sig
        self.reloads += 1
        log.info("TLS certificate files changed: reloaded %s", ", ".join(self._paths()))
        return config

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._initial, self.fetch, require_client_authentication=self.require_client_auth
        )
