from __future__ import annotations

import pytest

from extproc.kvcache.vllm_hash import (
    HashAlgo,
    VllmBlockHasher,
    block_extra_keys,
    none_hash,
    to_published,
)

TOKENS = list(range(1, 33))


def test_sha256_cbor_vectors_from_vllm() -> None:
    h = VllmBlockHasher(block_size=16, algo=HashAlgo.SHA256_CBOR, env={})
    assert h.none_hash.hex() == "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
    b0, b1 = h.hash_blocks(TOKENS)
    assert b0.hex() == "cd7c51bc5a8fc8643f383a2b9e01522fba7473c669e9270c7b0bf7bf7fd01682"
    assert b1.hex() == "2533ea50426b36e9e4d68296cac6bce8cf602e46957d0fe40b368b33d87bf3bf"
    assert [to_published(b0), to_published(b1)] == [8866452693264111234, 807986237951177663]


def test_sha256_pickle_vectors_from_vllm() -> None:
    h = VllmBlockHasher(block_size=16, algo=HashAlgo.SHA256, env={})
    assert h.none_hash.hex() == "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
    assert [to_published(b) for b in h.hash_blocks(TOKENS)] == [
        1403909460543360175,
        1643945449041937783,
    ]


def test_pythonhashseed_changes_none_hash() -> None:
    default = none_hash(HashAlgo.SHA256_CBOR, {})
    assert none_hash(HashAlgo.SHA256_CBOR, {"PYTHONHASHSEED": "0"}) != default
    assert none_hash(HashAlgo.SHA256_CBOR, {"PYTHONHASHSEED": ""}) == default


@pytest.mark.parametrize(
    ("n_tokens", "n_blocks"), [(0, 0), (15, 0), (16, 1), (31, 1), (32, 2), (33, 2)]
)
def test_only_full_blocks_are_hashed(n_tokens: int, n_blocks: int) -> None:
    h = VllmBlockHasher(env={})
    assert len(h.hash_blocks(list(range(n_tokens)))) == n_blocks


def test_chain_resume_and_lora_keys() -> None:
    h = VllmBlockHasher(env={})
    full = h.hash_blocks(TOKENS)
    assert h.hash_blocks(TOKENS, parent=full[0], start_block=1) == full[1:]
    lora = h.hash_blocks(TOKENS, extra=block_extra_keys("sql-lora"))
    assert set(lora).isdisjoint(full)
    assert block_extra_keys(None) is None
