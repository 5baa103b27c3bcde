"""AIBrix `x-session-id`: base64 of the pod's "ip:port".

`decode_session` only checks the shape of the value. It never makes the value routable:
the caller (director) must still check that the address is a ready endpoint of the model,
so a forged id cannot reach an arbitrary address.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress

__all__ = ["MAX_SESSION_ID_LEN", "decode_session", "encode_session"]

MAX_SESSION_ID_LEN = 128  # base64 of the longest "[ipv6]:port" is ~64 chars


def encode_session(address: str) -> str:
    return base64.b64encode(address.encode("ascii")).decode("ascii")


def _valid_address(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or len(port) > 5 or not 0 < int(port) < 65536:
        return False
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return True
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


def decode_session(value: str | None) -> str | None:
    """The "ip:port" inside a session id, or None for anything malformed."""
    if not value or len(value) > MAX_SESSION_ID_LEN:
        return None
    value = value.strip()
    try:
        raw = base64.b64decode(value, validate=True)
        text = raw.decode("ascii")
    except (binascii.Error, ValueError):
        return None
    if not _valid_address(text):
        return None
    return text
