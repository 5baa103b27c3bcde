"""server.tokenizer_root: the config cannot point the server at files outside the allowed root."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from extproc.app import load_model_tokenizer
from extproc.config import ConfigError, ModelConfig


def model(tokenizer: str) -> ModelConfig:
    return ModelConfig(name="m", tokenizer=tokenizer)


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_tokenizer_inside_the_root_loads(tmp_path: Path, qwen_tokenizer_dir: Path) -> None:
    inside = tmp_path / "tokenizers" / "qwen3"
    shutil.copytree(qwen_tokenizer_dir, inside)
    tok = load_model_tokenizer(model(str(inside)), str(tmp_path / "tokenizers"))
    assert tok.estimated is False
    assert tok.encode_text("Hello, world!")


def test_tokenizer_outside_the_root_is_refused(tmp_path: Path, qwen_tokenizer_dir: Path) -> None:
    root = tmp_path / "tokenizers"
    root.mkdir()
    with pytest.raises(ConfigError, match=r"outside server\.tokenizer_root"):
        load_model_tokenizer(model(str(qwen_tokenizer_dir)), str(root))


def test_symlink_escaping_the_root_is_refused(tmp_path: Path, qwen_tokenizer_dir: Path) -> None:
    root = tmp_path / "tokenizers"
    root.mkdir()
    (root / "sneaky").symlink_to(qwen_tokenizer_dir)
    with pytest.raises(ConfigError, match=r"outside server\.tokenizer_root"):
        load_model_tokenizer(model(str(root / "sneaky")), str(root))
    with pytest.raises(ConfigError, match=r"outside server\.tokenizer_root"):
        load_model_tokenizer(model(str(root / ".." / "..")), str(root))


def test_missing_tokenizer_without_root_falls_back_to_a_labelled_estimate(tmp_path: Path) -> None:
    tok = load_model_tokenizer(model(str(tmp_path / "nope")))
    assert tok.estimated is True
