"""Fixtures for discovery tests: a running fake API server and a client pointed at it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client as k8s

from .fake_apiserver import FakeApiServer
from .helpers import Recorder


@pytest.fixture
def apiserver() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def api_client(apiserver: FakeApiServer) -> Iterator[k8s.ApiClient]:
    configuration = k8s.Configuration(host=apiserver.url)
    # No urllib3 retries: the back-off under test is ours, not the connection pool's.
    configuration.retries = False
    api = k8s.ApiClient(configuration)
    try:
        yield api
    finally:
        api.close()  # type: ignore[no-untyped-call]


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()
