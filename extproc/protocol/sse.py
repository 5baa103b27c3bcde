"""Incremental Server-Sent Events decoder for response bodies split at arbitrary bytes."""

from __future__ import annotations

import re

__all__ = ["SSEDecoder"]

_EOL = re.compile(rb"\r\n|\r|\n")


class SSEDecoder:
    """Feed body chunks, get back the `data` payload of each complete event.

    Follows the SSE parsing rules (CRLF, LF or CR line ends, multi-line data joined by
    "\\n", comments ignored) and keeps memory bounded: a line longer than
    `max_line_bytes`, or an event whose data exceeds `max_event_bytes`, is dropped and
    counted in `dropped`, never buffered without limit.
    """

    def __init__(self, *, max_line_bytes: int = 1 << 20, max_event_bytes: int = 4 << 20) -> None:
        self._max_line = max_line_bytes
        self._max_event = max_event_bytes
        self._partial = bytearray()
        self._overflow = False  # the current line is being discarded
        self._skip_lf = False  # previous chunk ended in CR: a leading LF belongs to it
        self._data: list[bytes] = []
        self._data_size = 0
        self._event_overflow = False
        self.dropped = 0  # lines or events discarded for size

    def feed(self, chunk: bytes) -> list[str]:
        out: list[str] = []
        if not chunk:
            return out
        start = 0
        if self._skip_lf:
            self._skip_lf = False
            if chunk[:1] == b"\n":
                start = 1
        for m in _EOL.finditer(chunk, start):
            piece = chunk[start : m.start()]
            if self._overflow:
                self._overflow = False
                self._partial.clear()
            elif self._partial:
                self._partial += piece
                if len(self._partial) > self._max_line:
                    self.dropped += 1
                else:
                    self._line(bytes(self._partial), out)
                self._partial.clear()
            elif len(piece) > self._max_line:
                self.dropped += 1
            else:
                self._line(piece, out)
            start = m.end()
            if m.end() == len(chunk) and m.group() == b"\r":
                self._skip_lf = True
        rest = chunk[start:]
        if rest and not self._overflow:
            if len(self._partial) + len(rest) > self._max_line:
                self._partial.clear()
                self._overflow = True
                self.dropped += 1
            else:
                self._partial += rest
        return out

    def flush(self) -> list[str]:
        """End of body: dispatch a trailing event that lacked its blank line."""
        out: list[str] = []
        if self._partial and not self._overflow:
            self._line(bytes(self._partial), out)
        self._partial.clear()
        self._overflow = False
        self._skip_lf = False
        self._line(b"", out)
        return out

    def _line(self, line: bytes, out: list[str]) -> None:
        if not line:
            if self._data and not self._event_overflow:
                out.append(b"\n".join(self._data).decode("utf-8", errors="replace"))
            self._data = []
            self._data_size = 0
            self._event_overflow = False
            return
        if line[:1] == b":":
            return  # comment / keep-alive
        name, sep, value = line.partition(b":")
        if name != b"data":
            return  # event:, id:, retry: carry nothing the gateway needs
        if sep and value[:1] == b" ":
            value = value[1:]
        if self._event_overflow:
            return
        self._data_size += len(value) + 1
        if self._data_size > self._max_event:
            self._event_overflow = True
            self._data = []
            self.dropped += 1
            return
        self._data.append(value)
