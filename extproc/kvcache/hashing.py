"""The router's own chained block hash over token ids.

Requests and KV events are both hashed with this function, so one key space indexes both
(vLLM's engine hashes depend on its hash algorithm, seed and version; ours do not).
Block i's hash covers the whole prefix up to block i: equal hash => equal prefix (up to
64-bit collisions). The chain is XXH3-64 of the block's packed token ids seeded with the
parent's hash (Dynamo's router also uses XXH3-64): stable across processes and machines
(never Python's salted `hash()`), and about 9x faster than hashlib's BLAKE2b per block,
because the hashlib constructor dominates for 64-byte inputs. Not collision-resistant
against an adversary; a crafted collision can only misroute the crafter's own request.
The extra key (LoRA adapter name, ...) is folded into the chain's root, so it reaches every
block.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from xxhash import xxh3_64_intdigest

__all__ = [
    "TOKEN_ARRAY_TYPECODE",
    "block_hashes",
    "chain_hashes",
    "lora_extra_key",
    "root_hash",
    "token_bytes",
]

# 4-byte unsigned token ids: every tokenizer in use has < 2**32 entries.
TOKEN_ARRAY_TYPECODE = "I"
_TOKEN_WIDTH = array(TOKEN_ARRAY_TYPECODE).itemsize
# Domain separation between roots and salted blocks and plain blocks.
_ROOT_PREFIX = b"extproc-root\x00"
_SALT_MARK = b"\x00salt\x00"


def root_hash(extra_key: bytes | None = None) -> int:
    """The parent of a sequence's first block (differs per extra key)."""
    return xxh3_64_intdigest(_ROOT_PREFIX + (extra_key or b""))


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as the packed bytes the hash consumes.

    Raises OverflowError or TypeError for ids that are negative, >= 2**32 or not ints.
    """
    if isinstance(token_ids, array) and token_ids.typecode == TOKEN_ARRAY_TYPECODE:
        return token_ids.tobytes()
    return array(TOKEN_ARRAY_TYPECODE, token_ids).tobytes()


def chain_hashes(
    packed_tokens: bytes, block_size: int, parent: int, salts: Sequence[bytes] | None = None
) -> list[int]:
    """Hash every full block of `packed_tokens` (see `token_bytes`), chained from `parent`.

    `salts[i]`, when given and non-empty, is mixed into block i only (and so into every
    block after it through the chain); used for per-block engine extra keys that a plain
    request cannot reproduce (multimodal, cache salt), so such blocks never match one.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    step = block_size * _TOKEN_WIDTH
    end = len(packed_tokens) - step + 1
    out: list[int] = []
    append = out.append
    h = parent
    if salts is None:
        for start in range(0, end, step):
            h = xxh3_64_intdigest(packed_tokens[start : start + step], h)
            append(h)
        return out
    for i, start in enumerate(range(0, end, step)):
        chunk = packed_tokens[start : start + step]
        salt = salts[i] if i < len(salts) else b""
        h = xxh3_64_intdigest(chunk + _SALT_MARK + salt if salt else chunk, h)
        append(h)
    return out


def block_hashes(
    token_ids: Sequence[int], block_size: int, extra_key: bytes | None = None
) -> tuple[int, ...]:
    """Chained hashes of the full blocks of `token_ids` (a trailing partial block is ignored).

    `extra_key` separates key spaces that share token ids but not KV contents, e.g. the
    LoRA adapter name: blocks hashed with different extra keys never compare equal.
    """
    return tuple(chain_hashes(token_bytes(token_ids), block_size, root_hash(extra_key)))


def lora_extra_key(lora_name: str | None) -> bytes | None:
    """The extra key of a LoRA adapter's blocks (None for the base model).

    Requests for an adapter and KV events carrying its `lora_name` must use this same key.
    """
    return None if lora_name is None else b"lora\x00" + lora_name.encode()
