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


@pytest.mark.parametrize("algo", list(HashAlgo))
def test_pythonhashseed_changes_none_hash_and_empty_is_a_seed_of_its_own(algo: HashAlgo) -> None:
    default = none_hash(algo, {})
    assert none_hash(algo, {"PYTHONHASHSEED": "0"}) != default
    # vLLM tests `is not None`: an empty PYTHONHASHSEED hashes "", not the default string.
    empty = none_hash(algo, {"PYTHONHASHSEED": ""})
    assert empty != default
    assert empty == VllmBlockHasher(algo=algo, env={"PYTHONHASHSEED": ""}).none_hash


def test_the_default_is_vllms_sha256_over_pickle() -> None:
    assert VllmBlockHasher(env={}).algo is HashAlgo.SHA256
    assert VllmBlockHasher(env={}).hash_blocks(TOKENS) == VllmBlockHasher(
        algo=HashAlgo.SHA256, env={}
    ).hash_blocks(TOKENS)


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
    # vLLM 0.33's key holds the adapter's path too: the same name loaded from elsewhere is a
    # different cache; no path given means the name is the path (--lora-modules name=name).
    assert block_extra_keys("sql-lora", "/adapters/sql") == (("lora", "sql-lora", "/adapters/sql"),)
    assert block_extra_keys("sql-lora") == (("lora", "sql-lora", "sql-lora"),)
    moved = h.hash_blocks(TOKENS, extra=block_extra_keys("sql-lora", "/adapters/sql"))
    assert set(moved).isdisjoint(lora)


def test_the_simulator_hashes_as_a_default_vllm_unless_told() -> None:
    from extproc.sim.cli import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(["--lora", "a=/adapters/a", "--lora", "b"]))
    assert cfg.hash_algo is HashAlgo.SHA256
    assert cfg.lora_adapters == ("a", "b")
    assert (cfg.lora_path("a"), cfg.lora_path("b"), cfg.lora_path(None)) == (
        "/adapters/a",
        "b",
        None,
    )
    cbor = build_parser().parse_args(["--prefix-caching-hash-algo", "sha256_cbor"])
    assert config_from_args(cbor).hash_algo is HashAlgo.SHA256_CBOR
