"""What a capture holds of one request, in two halves that may live on different processes.

- `DecisionHalf`: what the routing process knew when it decided (model, route, the ids as
  keyed hashes, the prompt's length and its prefix blocks, `max_tokens`, the pick);
- `OutcomeHalf`: what the request's access record said, on whatever process received it
  (status, token counts, TTFT and TPOT, the host that served it).

Both are keyed by the request id's keyed hash; `join.py` puts them together. Nothing here
holds text: no prompt, no header value, no id in the clear (`KeyedHash`). The prompt's blocks
are kept as one chained hash per `FINE_TOKENS` tokens (the routing block that holds each
window's last token, else the last full one inside it), so equal leading windows mean an equal
prompt prefix; they are keyed only when exported, off the request path. The export's Mooncake
`hash_ids` (one per `WINDOW_TOKENS`) are derived from them; the finer windows let a replay see
a shared prefix to the routing block where it ends, not only to the last whole 512-token
window (a conversation's turn adds ~200 tokens: at 512 most of its reuse would be invisible).
At 64 tokens a window (until 2026-12-07) a prefix shared to the middle of a window was lost
from there: on kvwins, whose customers' prompts share 95 blocks of 16, a replay pinned to the
captured pods cached 4.5 % fewer tokens than the engines had (48 a hit), and every cache-aware
rule's hit rate in the twin was 0.03-0.08 low.
"""

from __future__ import annotations

import hmac
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FINE_TOKENS",
    "NO_BLOCK",
    "WINDOW_TOKENS",
    "DecisionHalf",
    "KeyedHash",
    "OutcomeHalf",
    "pack_windows",
    "prefix_windows",
]

# The Mooncake trace format's block size (bench/traces.py reads `hash_ids` at this size).
WINDOW_TOKENS = 512
# The capture's own window: a divisor of WINDOW_TOKENS, the usual (vLLM's default) block size.
# A larger block spans several windows, each given the hash of the block holding its end.
FINE_TOKENS = 16
# A window in which no full routing block ends (a short tail, or a block larger than a window).
NO_BLOCK = 2**64 - 1


class KeyedHash:
    """HMAC-SHA256, truncated to 64 bits (16 hex digits): the same input gives the same value on
    every process sharing the key; without the key, an id cannot be tested against a guess."""

    __slots__ = ("_keyed",)

    def __init__(self, key: str) -> None:
        # The key's HMAC state, copied per value (half the cost of `hmac.digest` each time).
        self._keyed = hmac.new(key.encode("utf-8"), digestmod="sha256")

    def _hash(self, data: bytes) -> str:
        h = self._keyed.copy()
        h.update(data)
        return h.digest()[:8].hex()

    def id(self, value: str | None) -> str | None:
        """A client's id (user, tenant, session, request id) as its keyed hash; None stays None."""
        if not value:
            return None
        return self._hash(b"id\x00" + value.encode("utf-8", "surrogatepass"))

    def block(self, chained: int) -> str:
        """A prefix window's chained block hash as its keyed hash (a block hash of a known
        prompt could otherwise be recomputed and matched)."""
        return self._hash(b"block\x00" + (chained & (2**64 - 1)).to_bytes(8, "big"))


def prefix_windows(
    hashes: Sequence[int], block_size: int, tokens: int, window: int = WINDOW_TOKENS
) -> tuple[int, ...]:
    """One chained hash per `window` tokens of a `tokens`-token prompt whose full
    `block_size` blocks have the chained `hashes` (the routing's, already computed): the hash
    of the full block that holds the window's last token (equal ids: equal prompts up to
    there, and a block larger than a window still says which of its windows are shared), else
    of the last full block that ends inside the window (a prompt's tail), else NO_BLOCK.
    Empty when no hash was computed (the rule reads no prefix)."""
    if not hashes or block_size <= 0 or tokens <= 0:
        return ()
    out = []
    n = len(hashes)
    for start in range(0, tokens, window):
        end = min(start + window, tokens)
        k = (end - 1) // block_size  # the block holding the window's last token
        if k >= n:  # not a full block: the last full one ending inside the window
            k = min(end // block_size, n) - 1
            if k < 0 or (k + 1) * block_size <= start:
                out.append(NO_BLOCK)
                continue
        out.append(hashes[k])
    return tuple(out)


def pack_windows(windows: Sequence[int]) -> bytes:
    """Window hashes as 8 bytes each (a tuple of Python ints costs 6 times as much)."""
    return array("Q", windows).tobytes()


@dataclass(frozen=True, slots=True)
class DecisionHalf:
    """A routed request as its routing process saw it (ids already keyed)."""

    rid: str  # the request id's keyed hash: the join key
    at: float  # wall clock (s) when it was routed
    model: str
    route: str
    api: str  # chat | completion | embeddings | responses | messages
    user: str | None
    tenant: str | None  # its fairness id
    session: str | None  # its session header, as sent
    # The session id the gateway answered with (the token naming the pick, keyed like every
    # id): a client that echoes it (AIBrix's contract) sends it as its next turn's `session`.
    session_answer: str | None
    priority: int
    prompt_tokens: int  # the gateway's count (tokenized, or estimated when `estimated`)
    estimated: bool
    # What tokenizing the prompt took (0: the rule read no tokens): part of the request's time
    # to first token that a rule which reads no prompt does not spend.
    tokenize_s: float
    max_tokens: int | None
    stream: bool
    endpoint: str  # the pick
    strategy: str
    windows: bytes  # `pack_windows(prefix_windows(..., FINE_TOKENS))`; empty: none computed
    replica: str  # the process that routed it

    def export(self, keyed: KeyedHash, memo: dict[int, str]) -> dict[str, Any]:
        """JSON-ready, window hashes keyed (`memo`: the export's keyed windows so far; shared
        prefixes are keyed once)."""
        out: dict[str, Any] = {
            "rid": self.rid, "at": self.at, "model": self.model, "route": self.route,
            "api": self.api, "user": self.user, "tenant": self.tenant, "session": self.session,
            "session_answer": self.session_answer, "priority": self.priority,
            "prompt_tokens": self.prompt_tokens, "estimated": self.estimated,
            "tokenize_s": self.tokenize_s, "max_tokens": self.max_tokens, "stream": self.stream,
            "endpoint": self.endpoint, "strategy": self.strategy, "replica": self.replica,
        }  # fmt: skip
        blocks: list[str | None] | None = None
        if self.windows:
            blocks = []
            for h in memoryview(self.windows).cast("Q"):
                if h == NO_BLOCK:
                    blocks.append(None)
                    continue
                found = memo.get(h)
                if found is None:
                    found = memo[h] = keyed.block(h)
                blocks.append(found)
        out["blocks"] = blocks
        return out


@dataclass(frozen=True, slots=True)
class OutcomeHalf:
    """A routed request's end as its access record told it (ids already keyed). Times are
    seconds from the request's first byte (Envoy's), None when not reached."""

    rid: str
    start: float  # wall clock (s): the request's first byte, as Envoy saw it
    model: str
    route: str
    user: str | None
    prompt_tokens: int  # the routing decision's count, from the record's metadata
    estimated: bool
    stream: bool
    endpoint: str  # the pick
    served_by: str | None  # the host that answered (after Envoy's retries)
    strategy: str
    status: int  # 499: the client went away
    outcome: str  # complete | client_aborted | upstream_failed
    attempts: int
    input_tokens: int | None  # the engine's usage
    output_tokens: int | None
    cached_tokens: int | None
    counted: bool  # output_tokens counted from content events (no usage in the answer)
    ttft_s: float | None  # first content token
    done_s: float | None  # last byte from the engine
    tpot_s: float | None  # (done - first token) / (output tokens - 1)
    replica: str  # the process that routed it

    def export(self) -> dict[str, Any]:
        return {
            "rid": self.rid, "start": self.start, "model": self.model, "route": self.route,
            "user": self.user, "prompt_tokens": self.prompt_tokens, "estimated": self.estimated,
            "stream": self.stream, "endpoint": self.endpoint, "served_by": self.served_by,
            "strategy": self.strategy, "status": self.status, "outcome": self.outcome,
            "attempts": self.attempts, "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens, "cached_tokens": self.cached_tokens,
            "counted": self.counted, "ttft_s": self.ttft_s, "done_s": self.done_s,
            "tpot_s": self.tpot_s, "replica": self.replica,
        }  # fmt: skip
