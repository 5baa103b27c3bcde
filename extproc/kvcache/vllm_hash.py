"""vLLM's prefix-cache block hashing, reimplemented bit for bit.

vLLM (v1 engine) names every *full* block of a request by chaining hashes:
``hash_i = H((hash_{i-1}, tuple(block_i_token_ids), extra_keys))`` with ``hash_{-1} = NONE_HASH``.
The full 32-byte digest is chained; only the published (KV-event) form is cut to 64 bits:
the last 8 bytes of the digest read big-endian (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``).
Sources: vllm/utils/hashing.py, vllm/v1/core/kv_cache_utils.py (docs/engines.md §1.3).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum

import cbor2

__all__ = [
    "ExtraKeys",
    "HashAlgo",
    "VllmBlockHasher",
    "block_extra_keys",
    "hash_fn",
    "none_hash",
    "to_published",
]

# One tuple of extra keys per block (LoRA, salt, ...), or None for a plain request, as vLLM passes it.
ExtraKeys = tuple[object, ...] | None

_NONE_HASH_DEFAULT_SEED = "vllm-none-hash"


class HashAlgo(StrEnum):
    SHA256 = "sha256"  # vLLM's default: SHA-256 over pickle (Python-only)
    SHA256_CBOR = "sha256_cbor"  # SHA-256 over canonical CBOR: reproducible in any language


def _sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def hash_fn(algo: HashAlgo) -> Callable[[object], bytes]:
    """The object -> 32-byte digest function vLLM uses for `algo`."""
    return _sha256_cbor if algo is HashAlgo.SHA256_CBOR else _sha256_pickle


def none_hash(algo: HashAlgo, env: Mapping[str, str] | None = None) -> bytes:
    """Parent hash of a sequence's first block: H(PYTHONHASHSEED) when it is set, even to ""
    (vLLM tests `is not None`: an empty seed is a seed of its own), else H("vllm-none-hash")."""
    environ = os.environ if env is None else env
    seed = environ.get("PYTHONHASHSEED")
    return hash_fn(algo)(_NONE_HASH_DEFAULT_SEED if seed is None else seed)


def to_published(block_hash: bytes) -> int:
    """The 64-bit form vLLM publishes in KV events: last 8 digest bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


def block_extra_keys(lora_name: str | None, lora_path: str | None = None) -> ExtraKeys:
    """Extra hash keys of a request: one ("lora", name, path) key for an adapter, as vLLM
    0.33 builds it (`_gen_lora_extra_hash_keys`), else None. `lora_path` is where the adapter
    was loaded from (`--lora-modules name=path`); None: the name (`--lora-modules name=name`).

    A LoRA's KV differs from the base model's for the same tokens, so its blocks must hash apart;
    events carry the adapter's name only, so the router keys LoRA blocks by name (exact.py).
    """
    if lora_name is None:
        return None
    return (("lora", lora_name, lora_name if lora_path is None else lora_path),)


class VllmBlockHasher:
    """Hashes token sequences into vLLM block hashes (full blocks only)."""

    def __init__(
        self,
        *,
        block_size: int = 16,
        algo: HashAlgo = HashAlgo.SHA256,  # vLLM's default --prefix-caching-hash-algo
        env: Mapping[str, str] | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.algo = algo
        self._fn = hash_fn(algo)
        self.none_hash = none_hash(algo, env)

    def hash_block(self, parent: bytes | None, tokens: Sequence[int], extra: ExtraKeys) -> bytes:
        return self._fn((self.none_hash if parent is None else parent, tuple(tokens), extra))

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        *,
        extra: ExtraKeys = None,
        parent: bytes | None = None,
        start_block: int = 0,
    ) -> list[bytes]:
        """Hashes of the full blocks of `token_ids` from block `start_block` on.

        `parent` must be the hash of block `start_block - 1` when resuming a chain.
        """
        bs = self.block_size
        out: list[bytes] = []
        prev = parent
        for start in range(start_block * bs, len(token_ids) - bs + 1, bs):
            prev = self.hash_block(prev, token_ids[start : start + bs], extra)
            out.append(prev)
        return out
