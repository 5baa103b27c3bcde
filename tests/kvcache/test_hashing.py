from __future__ import annotations

import subprocess
import sys

import pytest

from extproc.kvcache.hashing import (
    block_hashes,
    chain_hashes,
    lora_extra_key,
    root_hash,
    token_bytes,
)


def test_full_blocks_only() -> None:
    assert len(block_hashes(list(range(47)), 16)) == 2
    assert len(block_hashes(list(range(48)), 16)) == 3
    assert block_hashes(list(range(15)), 16) == ()


def test_chain_means_equal_hash_equal_prefix() -> None:
    a = block_hashes([1] * 16 + [2] * 16, 16)
    b = block_hashes([9] * 16 + [2] * 16, 16)
    # Same second block tokens, different first block: the chain separates them.
    assert a[1] != b[1]
    assert block_hashes([1] * 16 + [3] * 16, 16)[0] == a[0]


def test_extra_key_separates_every_block() -> None:
    tokens = list(range(64))
    base = block_hashes(tokens, 16)
    lora = block_hashes(tokens, 16, lora_extra_key("sql-lora"))
    other = block_hashes(tokens, 16, lora_extra_key("other"))
    assert not set(base) & set(lora)
    assert not set(lora) & set(other)
    assert lora_extra_key(None) is None


def test_resuming_from_a_parent_equals_hashing_the_whole_prefix() -> None:
    tokens = list(range(1000, 1080))
    whole = block_hashes(tokens, 16)
    tail = chain_hashes(token_bytes(tokens[32:]), 16, whole[1])
    assert tuple(tail) == whole[2:]
    assert chain_hashes(token_bytes(tokens), 16, root_hash()) == list(whole)


def test_salt_changes_that_block_and_its_descendants() -> None:
    packed = token_bytes(list(range(48)))
    plain = chain_hashes(packed, 16, root_hash())
    salted = chain_hashes(packed, 16, root_hash(), [b"", b"mm", b""])
    assert salted[0] == plain[0]
    assert salted[1] != plain[1] and salted[2] != plain[2]


@pytest.mark.parametrize("bad", [[-1] * 16, [2**32] * 16])
def test_out_of_range_tokens_raise(bad: list[int]) -> None:
    with pytest.raises(OverflowError):
        block_hashes(bad, 16)


def test_stable_across_processes() -> None:
    # A fresh interpreter with a different hash seed must produce the same values.
    code = "from extproc.kvcache.hashing import block_hashes; print(block_hashes(list(range(40)), 16, b'x'))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
        cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]),
    ).stdout
    assert out.strip() == str(block_hashes(list(range(40)), 16, b"x"))
