"""Tokenizers shared across models: one load per distinct tokenizer, lazily, with a bound.

A gateway for many models usually has few distinct tokenizers (100 fine-tunes of one base
model name one tokenizer, often as copies of the same files). Loading one per model cost about
30 MB each and 0.6 s of CPU (3.4 GiB for 100 models naming one file). Here a tokenizer is
identified by the content of the files that decide its ids and chat template (`content_key`),
so every model naming the same content, at any path, shares one `TokenizerPool`: one parsed
tokenizer, one set of incremental caches (sound: equal files give equal ids), one executor.

A pool is loaded by its first encode (or by `warm`), in the executor, never on the event loop.
At most `max_loaded` distinct tokenizers stay loaded; past that the least recently used one is
dropped and loaded again by its next request. A directory that cannot be read or parsed gives a
labelled character estimate (logged), as a model without a tokenizer does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from extproc.tokenization._estimate import CharEstimateTokenizer
from extproc.tokenization._hf import TokenizerLoadError, load_tokenizer
from extproc.tokenization._pool import TokenizerPool
from extproc.tokenization.base import Tokenizer

__all__ = ["CONTENT_FILES", "SharedTokenizers", "TokenizerInfo", "content_key"]

_log = logging.getLogger(__name__)

# The files `load_tokenizer` reads: what decides the ids and the chat template.
CONTENT_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
ESTIMATE_KEY = "estimate"


def _signature(directory: Path) -> tuple[str, tuple[tuple[str, int, int], ...]]:
    real = os.path.realpath(directory)
    files = []
    for name in CONTENT_FILES:
        try:
            st = os.stat(os.path.join(real, name))
        except OSError:
            continue
        files.append((name, st.st_size, st.st_mtime_ns))
    return real, tuple(files)


def content_key(directory: Path) -> str:
    """sha256 over the names and bytes of the tokenizer files present in `directory`.
    Raises OSError when tokenizer.json cannot be read."""
    digest = hashlib.sha256()
    with open(Path(directory) / "tokenizer.json", "rb") as f:
        digest.update(b"tokenizer.json\0")
        digest.update(f.read())
    for name in CONTENT_FILES[1:]:
        path = Path(directory) / name
        if path.is_file():
            digest.update(b"\0" + name.encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None
    return trim  # type: ignore[no-any-return]


def release_free_memory() -> None:
    """Give the C allocator's free pages back to the system (glibc's `malloc_trim`). A
    tokenizer load parses an 11 MB JSON and builds its vocabulary twice over: about 100 MB
    freed afterwards that glibc would otherwise keep for the life of the process."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@dataclass(frozen=True, slots=True)
class TokenizerInfo:
    """One distinct tokenizer, for /debug and the status page."""

    key: str  # content hash (short), or "estimate"
    name: str
    directory: str | None  # the first directory it was named by
    loaded: bool
    loads: int  # times loaded (more than once: it was dropped by the bound and needed again)
    estimated: bool


class SharedTokenizers:
    """Tokenizer pools by content, for every model of every runtime (it outlives reloads)."""

    def __init__(
        self,
        *,
        max_loaded: int = 8,
        threads: int = 1,
        inline_threshold_chars: int = 16384,
        load: Callable[[Path], Tokenizer] = load_tokenizer,
    ) -> None:
        if max_loaded < 1 or threads < 1:
            raise ValueError("max_loaded and threads must be >= 1")
        self.max_loaded = max_loaded
        self._inline = inline_threshold_chars
        self._load = load
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")
        self._pools: dict[str, TokenizerPool] = {}
        self._dirs: dict[str, str] = {}  # key -> the first directory that named it
        self._keys: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}
        self._loaded: OrderedDict[str, TokenizerPool] = OrderedDict()  # LRU, oldest first
        self._by_pool: dict[int, str] = {}
        self._estimate = TokenizerPool(
            CharEstimateTokenizer(), executor=self._executor, inline_threshold_chars=self._inline
        )

    @property
    def estimate(self) -> TokenizerPool:
        """The character estimate's pool (models without a tokenizer)."""
        return self._estimate

    def set_inline_threshold(self, chars: int) -> None:
        """`server.tokenize_inline_bytes` after a reload: applies to every pool."""
        self._inline = chars
        for pool in (*self._pools.values(), self._estimate):
            pool.inline_threshold_chars = chars

    def key_of(self, directory: Path) -> str | None:
        """The content key of `directory` (memoised by path, sizes and mtimes: a changed file
        gives a new key, so an edited tokenizer loads anew), or None if it cannot be read."""
        sig = _signature(directory)
        key = self._keys.get(sig)
        if key is None:
            try:
                key = content_key(directory)
            except OSError:
                return None
            self._keys[sig] = key
        return key

    def pool(self, directory: Path | None, *, model: str = "") -> TokenizerPool:
        """The pool for the tokenizer in `directory` (None: the estimate). Nothing is loaded
        here; an unreadable directory gives the estimate, logged."""
        if directory is None:
            return self._estimate
        key = self.key_of(directory)
        if key is None:
            _log.error(
                "model %s: cannot read a tokenizer in %s; token counts are ESTIMATED",
                model or "?", directory,
            )  # fmt: skip
            return self._estimate
        pool = self._pools.get(key)
        if pool is None:
            path = Path(directory)
            pool = TokenizerPool(
                load=lambda: self._load_or_estimate(path),
                name=path.name,
                on_use=self._used,
                executor=self._executor,
                inline_threshold_chars=self._inline,
            )
            self._pools[key] = pool
            self._dirs[key] = str(path)
            self._by_pool[id(pool)] = key
        return pool

    def _load_or_estimate(self, directory: Path) -> Tokenizer:
        try:
            tok = self._load(directory)
        except TokenizerLoadError as exc:
            _log.error("%s; token counts are ESTIMATED until the file is fixed", exc)
            return CharEstimateTokenizer()
        release_free_memory()
        _log.info("tokenizer %s loaded from %s", tok.name, directory)
        return tok

    def _used(self, pool: TokenizerPool) -> None:
        if not pool.loaded:
            return
        key = self._by_pool[id(pool)]
        loaded = self._loaded
        if key in loaded:
            loaded.move_to_end(key)
            return
        loaded[key] = pool
        while len(loaded) > self.max_loaded:
            _, oldest = loaded.popitem(last=False)
            oldest.unload()
            _log.info(
                "tokenizer %s dropped (more than %d loaded; loaded again when needed)",
                oldest.name, self.max_loaded,
            )  # fmt: skip

    async def warm(self) -> None:
        """Load up to `max_loaded` of the known tokenizers now, in the order models named them
        (start-up: the first requests do not wait for a load)."""
        for pool in list(self._pools.values())[: self.max_loaded]:
            await pool.ready()

    def info(self) -> list[TokenizerInfo]:
        out = [
            TokenizerInfo(
                key=key[:12],
                name=pool.name,
                directory=self._dirs.get(key),
                loaded=pool.loaded,
                loads=pool.loads,
                estimated=pool.loaded and bool(pool.tokenizer.estimated),
            )
            for key, pool in self._pools.items()
        ]
        out.append(TokenizerInfo(ESTIMATE_KEY, "char-estimate", None, True, 0, True))
        return out

    def loaded_count(self) -> int:
        return len(self._loaded)

    def close(self) -> None:
        """Stop the shared executor (running encodes finish first)."""
        self._executor.shutdown(wait=True, cancel_futures=True)
