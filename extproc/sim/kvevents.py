"""vLLM KV-cache events published by the simulator: the ZMQ PUB and its replay ROUTER.

The event types and both msgpack encodings are the router's own (`extproc.kvevents`).
Wire format (docs/engines.md §1.1-1.2): PUB frames ``[topic, seq (8-byte BE, from 0),
msgpack [ts, events, dp_rank]]``; a ROUTER socket replays buffered batches with seq >= the
requested start as ``[identity, b"", topic, seq, payload]`` and then the end marker
``[identity, b"", b"", 0xFF*8, b""]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import zmq
import zmq.asyncio

from extproc.kvevents.decode import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from extproc.kvevents.encode import EventEncoding as WireEncoding
from extproc.kvevents.encode import encode_payload
from extproc.sim.config import EventEncoding

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventPublisher",
    "encode_batch",
]

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8


def encode_batch(
    events: list[KVEvent], *, ts: float, encoding: EventEncoding, dp_rank: int = 0
) -> bytes:
    """msgpack of the positional EventBatch envelope ``[ts, events, dp_rank]``.

    The event types and their two encodings are the router's own (`extproc.kvevents`), so
    the simulator publishes exactly what the subscriber is tested to read.
    """
    wire = WireEncoding.MAP if encoding is EventEncoding.MAP else WireEncoding.ARRAY
    return encode_payload(ts, events, dp_rank, wire)


class KVEventPublisher:
    """ZMQ PUB of one batch per engine step, plus a ROUTER replaying a bounded buffer.

    `publish` never blocks: PUB drops at its high-water mark, as vLLM's does.
    """

    def __init__(
        self,
        *,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        encoding: EventEncoding,
        buffer_steps: int = 10000,
        dp_rank: int = 0,
    ) -> None:
        self._topic = topic.encode()
        self._encoding = encoding
        self._dp_rank = dp_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, buffer_steps))
        self._next_seq = 0
        self._drop_next = 0
        self.published = 0
        self.dropped = 0
        # PUB on a plain context: a NOBLOCK send either completes or drops at once, with no
        # future to await; the ROUTER needs asyncio to wait for replay requests.
        self._pub_ctx = zmq.Context()
        self._ctx = zmq.asyncio.Context()
        self._pub = self._pub_ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100000)
        self._pub.bind(endpoint)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        self._replay_task: asyncio.Task[None] | None = None
        if replay_endpoint is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.SNDHWM, 2 * (max(1, buffer_steps) + 1))
            self._router.bind(replay_endpoint)
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def drop_next(self, count: int) -> None:
        """Skip sending (but still number and buffer) the next `count` batches: a test-made gap."""
        self._drop_next += max(0, count)

    def publish(self, events: list[KVEvent]) -> int | None:
        """Send one batch; returns its seq, or None when there was nothing to send."""
        if not events:
            return None
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(
            events, ts=time.time(), encoding=self._encoding, dp_rank=self._dp_rank
        )
        self._buffer.append((seq, payload))
        if self._drop_next > 0:
            self._drop_next -= 1
            self.dropped += 1
            return seq
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart(
                [self._topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
            )
            self.published += 1
        return seq

    async def _serve_replay(self) -> None:
        assert self._router is not None
        router = self._router
        while True:
            try:
                frames = await router.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignoring malformed replay request with %d frames", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart(
                        [identity, b"", self._topic, seq.to_bytes(8, "big"), payload]
                    )
            await router.send_multipart([identity, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
        self._ctx.term()
        self._pub_ctx.term()
