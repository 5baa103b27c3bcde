"""Prompt tokenization: exact (HF `tokenizers` + chat template, incremental) or estimated.

Public API: `load_tokenizer(dir) -> HFTokenizer`, `CharEstimateTokenizer`, `TokenizerPool`
(async, executor for large inputs, optionally loaded lazily), `SharedTokenizers` (one pool per
distinct tokenizer content, a bound on how many are loaded), `bundled_qwen_dir()` for the Qwen3
test tokenizer, and
the caches of the incremental path: `SegmentCache` (text between added tokens -> ids),
`ChatPrefixCache` (an earlier turn's rendered prefix -> ids) and `TextPrefixCache` (long
segments, reused up to a safe cut when a new one starts with the same text).
"""

from __future__ import annotations

from extproc.tokenization._estimate import CharEstimateTokenizer
from extproc.tokenization._hf import (
    HFTokenizer,
    TokenizerLoadError,
    bundled_qwen_dir,
    load_tokenizer,
)
from extproc.tokenization._pool import TokenizeResult, TokenizerPool
from extproc.tokenization._prefix import ChatPrefixCache, ChatPrefixStats
from extproc.tokenization._segments import SegmentCache, SegmentCacheStats
from extproc.tokenization._shared import SharedTokenizers, TokenizerInfo, content_key
from extproc.tokenization._template import ChatTemplate
from extproc.tokenization._textprefix import TextPrefixCache, TextPrefixStats
from extproc.tokenization.base import Tokenizer

__all__ = [
    "CharEstimateTokenizer",
    "ChatPrefixCache",
    "ChatPrefixStats",
    "ChatTemplate",
    "HFTokenizer",
    "SegmentCache",
    "SegmentCacheStats",
    "SharedTokenizers",
    "TextPrefixCache",
    "TextPrefixStats",
    "TokenizeResult",
    "Tokenizer",
    "TokenizerInfo",
    "TokenizerLoadError",
    "TokenizerPool",
    "bundled_qwen_dir",
    "content_key",
    "load_tokenizer",
]
