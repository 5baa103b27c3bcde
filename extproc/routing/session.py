"""`x-session-id`: AIBrix's contract (the client echoes the id it got back), with an opaque id.

AIBrix sends base64 of the pod's "ip:port"; that hands clients the pod network's addresses.
The gateway sends instead a token that names the pod without showing it:

    "s1." + base64url(BLAKE2b-128 keyed with the session secret, of model NUL address)

so every process and replica that shares the secret (`routing.session_secret[_file]`) reads
the same token as the same pod, and without the secret no one can tell the address or mint a
token for a chosen pod. A token is only ever compared with the tokens of this request's
candidates, so a forged or stale one (its pod left) can never name a non-member.

Any other value (an id the client made up, `abc`, a token of another secret, a stale one) is a
session key: rendezvous hashing over the candidates' addresses puts it on one pod, the same on
every process and replica with no shared memory, and the answer carries that pod's token, which
pins the session even when the pool changes later.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
from collections.abc import Sequence

__all__ = ["MAX_SESSION_ID_LEN", "RESPONSE_ID_PREFIX", "SessionTokens", "rendezvous"]

MAX_SESSION_ID_LEN = 256  # longer values are ignored (no session)
_PREFIX = "s1."
_MEMO_LIMIT = 8192  # (model, address) -> token entries kept; cleared past it (pods churn)
RESPONSE_ID_PREFIX = "resp_"  # vLLM's own prefix, kept: clients may look for it
_TAG, _TAG_LEN = "t", 9  # a model rewrite's target tag: "t" + base64url of 6 MAC bytes


def rendezvous(key: str, addresses: Sequence[str]) -> str:
    """The address with the highest BLAKE2b-64(key NUL address): a key stays on its pod while
    that pod is a candidate; when it leaves, only its keys move."""
    best, best_h = addresses[0], -1
    raw = key.encode("utf-8", "surrogatepass") + b"\0"
    for address in addresses:
        h = int.from_bytes(hashlib.blake2b(raw + address.encode(), digest_size=8).digest(), "big")
        if h > best_h:
            best, best_h = address, h
    return best


class SessionTokens:
    """Mints and reads the opaque session ids of one gateway (one secret)."""

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("the session secret must not be empty")
        # BLAKE2b takes a key of at most 64 bytes: hash a longer secret down to one.
        self._key = secret if len(secret) <= 64 else hashlib.blake2b(secret).digest()
        self._tokens: dict[tuple[str, str], str] = {}
        self._pods: dict[tuple[str, str], str] = {}  # (model, token) -> address

    @classmethod
    def from_secret(cls, secret: str | None) -> SessionTokens:
        """From the configured secret; None makes a random one, good for this process only."""
        return cls(secret.encode() if secret else secrets.token_bytes(32))

    def token(self, model: str, address: str) -> str:
        """The session id that names `address` for `model`."""
        found = self._tokens.get((model, address))
        if found is None:
            if len(self._tokens) >= _MEMO_LIMIT:
                self._tokens.clear()
                self._pods.clear()
            mac = hashlib.blake2b(
                f"{model}\0{address}".encode(), key=self._key, digest_size=16
            ).digest()
            found = _PREFIX + base64.urlsafe_b64encode(mac).rstrip(b"=").decode("ascii")
            self._tokens[(model, address)] = found
            self._pods[(model, found)] = address
        return found

    def resolve(self, model: str, value: str | None, candidates: Sequence[str]) -> str | None:
        """The candidate a request's session id sticks to, or None without a usable id: the pod
        its token names if that pod is a candidate, else the rendezvous pick for the value."""
        if not candidates or value is None:
            return None
        value = value.strip()
        if not value or len(value) > MAX_SESSION_ID_LEN:
            return None
        if value.startswith(_PREFIX):
            value = self.split_tag(value)[0]  # a model rewrite's target tag rides after the token
            pod = self._pods.get((model, value))
            if pod is None:  # not seen yet on this process: the candidates' tokens
                for address in candidates:
                    if self.token(model, address) == value:
                        pod = address
                        break
            if pod is not None and pod in candidates:
                return pod
        return rendezvous(value, candidates)

    # -- stored responses (the Responses API) -------------------------------------------------
    # vLLM keeps a stored response in the memory of the engine that made it, under the
    # `request_id` of its request. The gateway writes that id, so the id itself names the pod:
    #     "resp_" + 32 random hex + "." + base64url(BLAKE2b-96 keyed, of "response" NUL address)
    # Every process and replica that shares the secret reads it alike, with no shared memory and
    # no delay (a client may send the next turn the moment the last one ends).

    def _pod_mac(self, address: str) -> str:
        mac = hashlib.blake2b(f"response\0{address}".encode(), key=self._key, digest_size=12)
        return base64.urlsafe_b64encode(mac.digest()).decode("ascii")

    def response_id(self, address: str, tag: str | None = None) -> str:
        """A new response id that names `address` (unique: 128 random bits), with a model
        rewrite's target tag when one placed the request."""
        middle = f".{tag}" if tag else ""
        return f"{RESPONSE_ID_PREFIX}{secrets.token_hex(16)}{middle}.{self._pod_mac(address)}"

    def response_pod(self, response_id: str, addresses: Sequence[str]) -> str | None:
        """The address among `addresses` that a gateway-made response id names, or None."""
        _, dot, mac = response_id.rpartition(".")
        if not dot or len(mac) != 16:
            return None
        for address in addresses:
            if secrets.compare_digest(self._pod_mac(address), mac):
                return address
        return None

    @staticmethod
    def is_response_id(value: str) -> bool:
        """Shaped like an id this gateway makes (its pod may be gone)."""
        head, dot, mac = value.rpartition(".")
        return bool(dot) and head.startswith(RESPONSE_ID_PREFIX) and len(mac) == 16

    @classmethod
    def response_tag(cls, response_id: str) -> str | None:
        """The target tag inside a gateway-made response id, if a rewrite placed it."""
        if not cls.is_response_id(response_id):
            return None
        return cls.split_tag(response_id.rpartition(".")[0])[1]

    # -- model rewrite targets: a conversation keeps its target ------------------------------

    def target_tag(self, model: str) -> str:
        """`t` + 8 characters naming a rewrite target under the secret (opaque to clients)."""
        mac = hashlib.blake2b(f"target\0{model}".encode(), key=self._key, digest_size=6)
        return _TAG + base64.urlsafe_b64encode(mac.digest()).decode("ascii")

    @staticmethod
    def split_tag(value: str) -> tuple[str, str | None]:
        """(the value without its trailing `.t...` target tag, the tag or None)."""
        base, dot, last = value.rpartition(".")
        if dot and base and len(last) == _TAG_LEN and last.startswith(_TAG):
            return base, last
        return value, None
