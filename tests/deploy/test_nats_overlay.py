"""deploy/overlays/nats: the replicas share routing state over a NATS server the overlay runs.

Schema validation of every object is in test_manifests.py (the overlay is in its OVERLAYS).
Here: the server's `sync:` settings, the NATS Deployment and its config agree with each other,
and the rendered nats.conf, run by a real nats-server, admits only the ext_proc user and only
on extproc.sync.>.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import posixpath
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats
import nats.errors
import pytest
import yaml
from test_manifests import DEPLOY, find, pod_labels, render, server_config_map

from extproc.config import SyncConfig, load_config_text
from extproc.stack.nats_server import nats_server_binary
from extproc.sync.nats import NatsBus

OVERLAY = "nats"
SYNC_KEYS = {
    "url",
    "subject",
    "user",
    "password_file",
    "tls",
    "tick_s",
    "heartbeat_s",
    "expire_s",
}


def docs() -> tuple[dict[str, Any], ...]:
    return render(OVERLAY)


def sync_config() -> SyncConfig:
    return load_config_text(server_config_map(docs())["data"]["config.yaml"]).sync


def nats_container() -> dict[str, Any]:
    (container,) = find(docs(), "Deployment", "nats")["spec"]["template"]["spec"]["containers"]
    return container


def nats_conf() -> str:
    deployment = find(docs(), "Deployment", "nats")
    (volume,) = [
        v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"
    ]
    configmap = find(docs(), "ConfigMap", volume["configMap"]["name"])
    mounted = {m["name"]: m["mountPath"] for m in nats_container()["volumeMounts"]}["config"]
    # The server is started on the file the ConfigMap mounts.
    args = nats_container()["command"] + nats_container().get("args", [])
    path = args[args.index("--config") + 1]
    assert posixpath.dirname(path) == mounted
    conf: str = configmap["data"][posixpath.basename(path)]
    return conf


def password_env() -> dict[str, Any]:
    """The environment variable nats.conf takes the password from, and where it comes from."""
    (name,) = re.findall(r"^\s*password:\s*\$(\w+)\s*$", nats_conf(), re.MULTILINE)
    (env,) = [e for e in nats_container()["env"] if e["name"] == name]
    return dict(env)


def secret_password() -> str:
    ref = password_env()["valueFrom"]["secretKeyRef"]
    secret = find(docs(), "Secret", ref["name"])
    return base64.b64decode(secret["data"][ref["key"]]).decode()


# -- what the manifests say -----------------------------------------------------------------


def test_the_overlay_config_is_the_base_config_plus_sync() -> None:
    base = yaml.safe_load((DEPLOY / "base" / "config.yaml").read_text())
    overlay = yaml.safe_load(server_config_map(docs())["data"]["config.yaml"])
    sync = overlay.pop("sync")
    assert overlay == base, "copy deploy/base/config.yaml into the overlay's config.yaml"
    assert set(sync) == SYNC_KEYS


def test_sync_url_points_at_the_nats_service_port() -> None:
    url = urlsplit(sync_config().url or "")
    assert url.scheme == "nats"
    service = find(docs(), "Service", "nats")
    namespace = service["metadata"]["namespace"]
    assert url.hostname in (
        f"nats.{namespace}.svc",
        f"nats.{namespace}.svc.cluster.local",
    )
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == url.port]
    container_ports = {p["name"]: p["containerPort"] for p in nats_container()["ports"]}
    assert container_ports[port["targetPort"]] == 4222  # nats.conf `port`
    assert re.search(r"^port:\s*4222\s*$", nats_conf(), re.MULTILINE)
    deployment = find(docs(), "Deployment", "nats")
    assert service["spec"]["selector"].items() <= pod_labels(deployment).items()


def test_the_password_file_is_mounted_from_the_secret_nats_reads() -> None:
    config = sync_config()
    assert config.password_file is not None and config.user is not None
    deployment = find(docs(), "Deployment", "extproc")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    directory, filename = posixpath.split(config.password_file)
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
    assert mount.get("readOnly") is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    secret = volume["secret"]
    (item,) = [i for i in secret["items"] if i["path"] == filename]
    # Readable by the non-root server through the pod's fsGroup, by no one else.
    assert secret["defaultMode"] == 0o440 and pod["securityContext"]["fsGroup"]
    ref = password_env()["valueFrom"]["secretKeyRef"]
    assert (secret["secretName"], item["key"]) == (ref["name"], ref["key"])
    assert find(docs(), "Secret", ref["name"])["metadata"]["namespace"] == "extproc"
    # The user nats.conf gives that password to is the one the server connects as.
    assert re.search(rf"^\s*user:\s*{re.escape(config.user)}\s*$", nats_conf(), re.MULTILINE)


def test_nats_authorization_restricts_the_user_to_the_sync_subjects() -> None:
    conf = nats_conf()
    assert re.search(r'^\s*publish:\s*\["extproc\.sync\.>"\]\s*$', conf, re.MULTILINE)
    assert re.search(r'^\s*subscribe:\s*\["extproc\.sync\.>"\]\s*$', conf, re.MULTILINE)
    settings = "\n".join(line.split("#")[0] for line in conf.splitlines())
    assert "no_auth_user" not in settings and "jetstream" not in settings.lower()
    assert sync_config().subject.startswith("extproc.sync.")


def test_the_nats_server_is_pinned_hardened_and_alone() -> None:
    deployment = find(docs(), "Deployment", "nats")
    assert re.fullmatch(r"nats:2\.\d+\.\d+(-alpine)?", nats_container()["image"])
    # One server, replaced rather than rolled: two unclustered servers would split the view.
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = nats_container()["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}


# -- the rendered nats.conf, run by a real nats-server ---------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def rendered_nats(tmp_path: Path) -> Iterator[str]:
    """nats-server on the overlay's nats.conf and Secret, on 127.0.0.1 and a free port."""
    conf = tmp_path / "nats.conf"
    conf.write_text(nats_conf())
    port = free_port()
    env = {**os.environ, password_env()["name"]: secret_password()}
    args = [nats_server_binary(), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port)]
    with (tmp_path / "nats.log").open("wb") as log:
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 10
            while True:
                assert proc.poll() is None, (tmp_path / "nats.log").read_text()
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                    break
                assert time.monotonic() < deadline, "nats-server did not listen"
                time.sleep(0.02)
            yield f"nats://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(10)


async def test_the_rendered_nats_config_admits_the_server_on_its_subject_only(
    rendered_nats: str,
) -> None:
    config = sync_config()
    received: list[bytes] = []
    bus = NatsBus(rendered_nats, config.subject, user=config.user, password=secret_password())
    try:
        await bus.start(received.append)
        async with asyncio.timeout(5):
            while not bus.connected:  # noqa: ASYNC110 - client state, no event to await
                await asyncio.sleep(0.01)
            assert await bus.publish(b"state")
            while received != [b"state"]:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
    finally:
        await bus.close()

    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(rendered_nats, allow_reconnect=False, connect_timeout=1)

    errors: list[Exception] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)

    nc = await nats.connect(
        rendered_nats,
        user=config.user,
        password=secret_password(),
        allow_reconnect=False,
        error_cb=on_error,
    )
    try:
        await nc.publish("extproc.other", b"outside")
        await nc.flush()
        async with asyncio.timeout(5):
            while not errors:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
    finally:
        await nc.close()
    assert 'permissions violation for publish to "extproc.other"' in str(errors[0]).lower()
