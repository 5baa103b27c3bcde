"""A vLLM-style KV-event publisher for tests: XPUB + replay ROUTER on 127.0.0.1 free ports.

XPUB (wire-compatible with vLLM's PUB) lets a test wait until the subscriber's subscription
arrived, so no message is lost to ZMQ's slow-joiner window unless the test drops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from extproc.kvevents import EventEncoding, KVEvent, encode_message, encode_payload
from extproc.kvevents.encode import REPLAY_END_SEQ


class TestPublisher:
    __test__ = False  # not a test class

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        encoding: EventEncoding = EventEncoding.MAP,
        buffer_steps: int = 10_000,
        replay: bool = True,
        legacy_replay: bool = False,
        topic: bytes = b"kv@test",
        pub_port: int | None = None,  # fixed ports (a data-parallel rank's): else any free one
        replay_port: int | None = None,
    ) -> None:
        self.encoding = encoding
        self.topic = topic
        self.legacy_replay = legacy_replay
        self.replay_silent = False
        self.replay_delay_s = 0.0  # a busy engine: each replay answered this late
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        # Report every subscription, also one that duplicates a subscriber still detaching.
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.pub.bind(f"tcp://127.0.0.1:{pub_port or '*'}")
        self.endpoint: str = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        self.replay_requests: list[int] = []
        self._task: asyncio.Task[None] | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(f"tcp://127.0.0.1:{replay_port or '*'}")
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)

    async def __aenter__(self) -> TestPublisher:
        if self.router is not None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)

    async def wait_subscribed(self) -> None:
        async with asyncio.timeout(15.0):
            # Skip unsubscriptions (b"\x00...") left by earlier subscribers.
            while (await self.pub.recv())[:1] != b"\x01":
                pass

    async def publish(self, events: Sequence[KVEvent], *, drop: bool = False) -> int:
        """Buffer a batch (as vLLM does) and send it unless `drop` (a lost message)."""
        seq = self.seq
        self.seq += 1
        payload = encode_payload(time.time(), events, 0, self.encoding)
        self.buffer.append((seq, payload))
        if not drop:
            await self.pub.send_multipart(encode_message(self.topic, seq, payload))
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    def restart(self) -> None:
        """A new engine process: seq from 0, empty replay buffer."""
        self.seq = 0
        self.buffer.clear()

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start_frame = frames
            start = int.from_bytes(start_frame, "big")
            self.replay_requests.append(start)
            if self.replay_silent:
                continue
            if self.replay_delay_s:
                await asyncio.sleep(self.replay_delay_s)
            for seq, payload in list(self.buffer):
                if seq >= start:
                    body = [seq.to_bytes(8, "big"), payload]
                    if not self.legacy_replay:
                        body.insert(0, self.topic)
                    await self.router.send_multipart([ident, b"", *body])
            end = [REPLAY_END_SEQ, b""] if self.legacy_replay else [b"", REPLAY_END_SEQ, b""]
            await self.router.send_multipart([ident, b"", *end])
