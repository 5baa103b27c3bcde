"""ZMQ subscribers that keep an ExactIndex in step with each pod's KV events.

One `KVEventSubscriber` per pod: a SUB socket connected to the pod's PUB (all topics), and,
when a sequence gap shows lost messages, a short-lived DEALER to the pod's replay ROUTER
(docs/engines.md §1.2). What cannot be replayed is handled by dropping the pod's
entries and rebuilding from live events; a sequence that goes backwards means the publisher
restarted (its cache is empty), so the pod is cleared. Everything runs on the event loop
and yields every `max_blocks_per_wake` blocks so ext_proc streams are never starved. A
stream is read in one go (all it queued); a busy one (it spoke within `drain_interval_s`)
on a tick every subscriber shares, so the loop wakes once per tick for all busy pods rather
than once per batch; a quieter stream wakes the loop when its next batch lands.

`KVEventManager` follows the endpoint set and answers `is_healthy(address)` for the
`auto` index mode. Healthy means the stream is alive, not that blocks were added lately: an
engine publishes a batch only for a step that stored or removed blocks, so an idle engine,
or one serving prompts shorter than a block, is silent and still fine. The stream counts as
alive once a batch arrived or the replay socket answered a probe; it is down when a request
that should have produced events (new full blocks, `note_traffic`) got no batch for
`stall_after_s` and the replay socket, asked for anything after the last seq, either has
batches the live socket never delivered or does not answer (docs/architecture.md, "KV-event
health").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Protocol, cast

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from extproc.config import KVEventsConfig
from extproc.kvcache.exact import ExactIndex, StoreResult
from extproc.kvevents.decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EventBatch,
    KVEvent,
    decode_message,
)
from extproc.kvevents.encode import REPLAY_END_SEQ
from extproc.kvevents.metrics import KVEventMetrics
from extproc.types import Endpoint

__all__ = [
    "ApplyCounts",
    "IndexWriter",
    "KVEventManager",
    "KVEventSubscriber",
    "PodRanks",
    "StreamProbe",
    "SubscriberSettings",
    "SubscriberStats",
    "apply_events",
    "rank_endpoint",
]

_log = logging.getLogger(__name__)

_Key = tuple[str, str, str | None, int]

# Tiers the prefix index models: the GPU cache (vLLM reports "GPU", older builds None).
_INDEXED_MEDIA = (None, "GPU")


class StreamProbe(Enum):
    """What the replay socket said when asked for every batch after the last one we hold."""

    IDLE = "idle"  # nothing newer: the engine published nothing, the stream is alive
    BEHIND = "behind"  # it had batches the live socket never delivered (applied now)
    FAILED = "failed"  # no reply within replay_timeout_s


# A join replay (nothing held yet: a process that has just started asks for the engine's whole
# buffer) waits this many times `replay_timeout_s` for each reply. It is what a restarted
# process knows of the cache its peers saw built; given up, the pod's older blocks stay unknown
# to it until they are stored again. A busy engine answers slowly (a simulator on a loaded
# machine took over 1 s), and nothing waits on a join but the pod's own live batches.
JOIN_REPLAY_TIMEOUT_MULTIPLE = 5.0


@dataclass(frozen=True, slots=True)
class SubscriberSettings:
    replay_timeout_s: float = 1.0  # wait for each replay reply before giving up
    # A request that should produce events, with no batch this long after it => ask the
    # replay socket; down if it has batches we missed or does not answer.
    stall_after_s: float = 10.0
    max_blocks_per_wake: int = 256  # yield to the event loop after this many block events
    rcvhwm: int = 100_000
    # A stream that spoke within this interval is busy: its queued batches are taken on a tick
    # all streams share, one loop wake-up per tick for every busy pod instead of one per batch
    # (a wake-up costs about as much CPU as indexing a batch: bench/kvingest.py). A batch then
    # waits at most this long (0: take each batch as it lands); `kv_events.pending_s` covers
    # that gap many times over.
    drain_interval_s: float = 0.02

    @classmethod
    def from_config(cls, cfg: KVEventsConfig) -> SubscriberSettings:
        return cls(replay_timeout_s=cfg.replay_timeout_s, stall_after_s=cfg.stall_after_s)


@dataclass(slots=True)
class SubscriberStats:
    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    skipped_events: int = 0  # other tiers (CPU, disk) or KV-cache groups other than 0
    unknown_events: int = 0
    decode_errors: int = 0
    duplicates: int = 0  # batches seen twice (live after replay)
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0  # replay unavailable, timed out, or not covering the gap
    resets: int = 0  # entries dropped and rebuilt from live events
    restarts: int = 0  # publisher sequence went backwards
    probes: int = 0  # replay-socket liveness probes (health checks, not gap repairs)
    last_probe: str | None = None  # the last probe's answer (StreamProbe value)
    orphans: int = 0
    last_seq: int | None = None
    last_ts: float | None = None
    lag_s: float | None = None


class IndexWriter(Protocol):
    """What applying a stream's events needs of the index: ExactIndex, or one rank's view."""

    def stored(
        self,
        pod: str,
        engine_hashes: Sequence[int],
        parent_engine_hash: int | None,
        token_ids: Sequence[int],
        *,
        block_size: int | None = None,
        lora_name: str | None = None,
        extra_keys: Sequence[object] | None = None,
    ) -> StoreResult: ...

    def removed(self, pod: str, engine_hashes: Iterable[int]) -> int: ...

    def cleared(self, pod: str) -> int: ...


def rank_endpoint(endpoint: str | None, rank: int) -> str | None:
    """`tcp://host:port` of data-parallel rank `rank`: vLLM binds each rank's publisher and
    replay socket on the configured port + rank (distributed/kv_events.py)."""
    if endpoint is None or rank == 0:
        return endpoint
    head, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"a data-parallel pod's KV endpoint needs a port: {endpoint!r}")
    return f"{head}:{int(port) + rank}"


class PodRanks:
    """The ranks of one data-parallel vLLM server into the pod's one index entry.

    Each rank has a KV cache of its own and its own event stream; the pod holds a block while
    any rank does. A rank's removal (or clear, or reset) removes only the blocks no other rank
    still holds, so one rank's eviction never hides another rank's cache.
    """

    def __init__(self, index: ExactIndex, size: int) -> None:
        self.index = index
        self.size = size
        self._held: list[set[int]] = [set() for _ in range(size)]
        self._count: dict[int, int] = {}

    def view(self, rank: int) -> _RankView:
        return _RankView(self, rank)

    def _add(self, rank: int, hashes: Iterable[int]) -> None:
        held = self._held[rank]
        for h in hashes:
            if h not in held:
                held.add(h)
                self._count[h] = self._count.get(h, 0) + 1

    def _drop(self, pod: str, rank: int, hashes: Iterable[int]) -> int:
        held, gone = self._held[rank], []
        for h in hashes:
            if h in held:
                held.discard(h)
                left = self._count[h] - 1
                if left:
                    self._count[h] = left
                else:
                    del self._count[h]
                    gone.append(h)
        return self.index.removed(pod, gone) if gone else 0


class _RankView:
    def __init__(self, ranks: PodRanks, rank: int) -> None:
        self._ranks = ranks
        self._rank = rank

    def stored(
        self,
        pod: str,
        engine_hashes: Sequence[int],
        parent_engine_hash: int | None,
        token_ids: Sequence[int],
        *,
        block_size: int | None = None,
        lora_name: str | None = None,
        extra_keys: Sequence[object] | None = None,
    ) -> StoreResult:
        result = self._ranks.index.stored(
            pod, engine_hashes, parent_engine_hash, token_ids,
            block_size=block_size, lora_name=lora_name, extra_keys=extra_keys,
        )  # fmt: skip
        self._ranks._add(self._rank, engine_hashes)
        return result

    def removed(self, pod: str, engine_hashes: Iterable[int]) -> int:
        return self._ranks._drop(pod, self._rank, engine_hashes)

    def cleared(self, pod: str) -> int:
        return self._ranks._drop(pod, self._rank, list(self._ranks._held[self._rank]))


class KVEventSubscriber:
    """Feeds one pod's KV events into an ExactIndex."""

    def __init__(
        self,
        *,
        pod: str,
        endpoint: str,
        replay_endpoint: str | None,
        index: ExactIndex,
        context: zmq.asyncio.Context,
        settings: SubscriberSettings | None = None,
        metrics: KVEventMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        label: str | None = None,
        writer: IndexWriter | None = None,
    ) -> None:
        """`label` names the stream in metrics and logs (a data-parallel rank: `pod/dp1`);
        `writer` applies its events (a rank's share of the pod's entry), else `index`."""
        self.pod = pod
        self.label = label or pod
        self._writer: IndexWriter = writer if writer is not None else index
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.index = index
        self._ctx = context
        self._settings = settings or SubscriberSettings()
        self._metrics = metrics
        self._clock = clock
        self._wall = wall_clock
        self._stats = SubscriberStats()
        self._live_high: int | None = None  # highest seq seen on the live socket
        self._alive = False  # a batch arrived, or the replay socket answered a probe
        # The first request that should have produced events since the stream last spoke.
        self._owed_since: float | None = None
        self._probe_verdict: StreamProbe | None = None  # of the last probe since _owed_since
        self._probed_at: float | None = None
        self._probe_task: asyncio.Task[None] | None = None
        # Live batches and probes apply to the index one at a time.
        self._lock = asyncio.Lock()
        self._budget = self._settings.max_blocks_per_wake
        self._sub: zmq.Socket[bytes] | None = None
        self._task: asyncio.Task[None] | None = None

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Connect and start consuming (ZMQ reconnects by itself if the pod goes away)."""
        if self._task is not None:
            return
        # A plain socket: the loop watches its descriptor only while the stream is idle.
        sub: zmq.Socket[bytes] = zmq.Socket(self._ctx, zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self._settings.rcvhwm)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.endpoint)
        self._sub = sub
        self._task = asyncio.get_running_loop().create_task(
            self._run(sub), name=f"kv-events:{self.label}"
        )
        if self._metrics is not None:
            self._metrics.watch(
                self.label, lambda: self.index.pod_block_count(self.pod), self.healthy
            )

    async def stop(self) -> None:
        task, self._task = self._task, None
        probe, self._probe_task = self._probe_task, None
        for t in (task, probe):
            if t is None:
                continue
            # Re-cancel until done: a cancellation that lands as an await completes can be lost.
            while not t.done():
                t.cancel()
                await asyncio.wait({t}, timeout=1.0)
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    # ----------------------------------------------------------------- state

    @property
    def stats(self) -> SubscriberStats:
        return replace(self._stats)

    def note_traffic(self, now: float | None = None) -> None:
        """The router sent this pod a request that should produce events (new full blocks)."""
        if self._owed_since is None:
            self._owed_since = self._clock() if now is None else now
            self._probe_verdict = None

    def healthy(self) -> bool:
        """The stream is alive: it has spoken (a batch, or a probe's answer), and no request
        that should have produced events went unanswered past `stall_after_s` unless the
        replay socket then showed there was nothing to send.

        Asking may start a probe of the replay socket (at most one per `stall_after_s`); the
        answer takes effect when it arrives, so this never waits."""
        if self._task is None or self._task.done():
            return False
        now = self._clock()
        owed = self._owed_since
        if owed is not None and now - owed > self._settings.stall_after_s:
            self._maybe_probe(now)
            # While the probe runs the stream keeps its standing; after it, only an idle
            # answer (which clears the debt) or a new batch makes it healthy again.
            return self._alive and self._probe_task is not None and self._probe_verdict is None
        if not self._alive:
            self._maybe_probe(now)
        return self._alive

    def _maybe_probe(self, now: float) -> None:
        if self.replay_endpoint is None or self._probe_task is not None:
            return
        last = self._probed_at
        if last is not None and now - last < self._settings.stall_after_s:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # asked from another thread: answer, probe next time
            return
        self._probed_at = now
        self._probe_task = loop.create_task(self._probe(), name=f"kv-events-probe:{self.label}")

    async def _probe(self) -> None:
        """Ask the replay socket for every batch after the last one held: none means the
        engine published nothing (alive, idle); some means the live socket lost them."""
        try:
            async with self._lock:
                if self._owed_since is None and self._alive:
                    return  # a batch arrived while we waited for the lock
                last = self._stats.last_seq
                self._stats.probes += 1
                applied, outcome = await self._fetch_replay(0 if last is None else last + 1)
            if outcome == "failed":
                verdict = StreamProbe.FAILED
            elif applied:
                verdict = StreamProbe.BEHIND
            else:
                verdict = StreamProbe.IDLE
            if verdict is StreamProbe.IDLE:
                self._alive = True  # the engine has published nothing we lack
                self._owed_since = None
            elif verdict is StreamProbe.BEHIND and not self._alive:
                self._alive = True  # a first answer is as good as a batch (a join replay)
            if self._owed_since is not None:
                self._probe_verdict = verdict
            self._stats.last_probe = verdict.value
            if self._metrics is not None:
                self._metrics.probes.labels(self.label, verdict.value).inc()
        finally:
            self._probe_task = None

    # ----------------------------------------------------------------- loop

    async def _run(self, sub: zmq.Socket[bytes]) -> None:
        loop = asyncio.get_running_loop()
        interval = self._settings.drain_interval_s
        last = -interval
        while True:
            frames = _recv_nowait(sub)
            if frames is None:
                await _readable(loop, sub)
                continue
            # Busy: the stream spoke within the last interval. Then its next batches queue
            # until the shared tick; a stream that speaks more rarely is read as it speaks
            # (a tick would only add a wake-up of its own).
            now = loop.time()
            busy, last = now - last < interval, now
            while frames is not None:  # everything queued, in one go
                await self._take(frames)
                frames = _recv_nowait(sub)
            if busy:
                await asyncio.sleep(interval - loop.time() % interval)

    async def _take(self, frames: list[bytes]) -> None:
        try:
            async with self._lock:
                await self._on_live(frames)
        except Exception:  # a bug must not end the subscription silently forever
            _log.exception("kv-events %s: failed to apply a batch", self.label)
            self._reset("gap")
        if self._budget <= 0:
            await asyncio.sleep(0)
            self._budget = self._settings.max_blocks_per_wake

    async def _on_live(self, frames: list[bytes]) -> None:
        # Any message, even one we cannot decode, shows the stream is alive.
        self._alive = True
        self._owed_since = None
        self._probe_verdict = None
        try:
            batch = decode_message(frames)
        except DecodeError as exc:
            self._decode_error(exc)
            self._skip_undecodable(frames)
            return
        seq = batch.seq
        if self._live_high is not None and seq <= self._live_high:
            # A publisher's seq only grows; going back means a new process with an empty cache.
            _log.info(
                "kv-events %s: seq %d after %d, publisher restarted",
                self.label,
                seq,
                self._live_high,
            )
            self._stats.restarts += 1
            self._reset("restart")
            self._stats.last_seq = None
        self._live_high = seq
        last = self._stats.last_seq
        expected = 0 if last is None else last + 1
        if seq < expected:
            self._stats.duplicates += 1  # already applied from a replay
            return
        if seq > expected:
            if last is not None:
                self._stats.gaps += 1
                if self._metrics is not None:
                    self._metrics.gaps.labels(self.label).inc()
            await self._replay(expected)
            last = self._stats.last_seq
            expected = 0 if last is None else last + 1
            if seq < expected:
                self._stats.duplicates += 1
                return
            if seq > expected:
                self._reset("gap" if last is not None else "join")
        self._apply(batch)

    def _skip_undecodable(self, frames: list[bytes]) -> None:
        """Step past a batch we cannot read: replaying it would return the same bytes."""
        if len(frames) == 3 and len(frames[1]) == 8:
            seq = int.from_bytes(frames[1], "big")
            last = self._stats.last_seq
            if last is None or seq == last + 1:
                self._stats.last_seq = seq
            self._live_high = seq if self._live_high is None else max(seq, self._live_high)

    async def _replay(self, start: int) -> None:
        """Apply buffered batches from `start`; reset the pod if they do not connect."""
        if self.replay_endpoint is None:
            self._replay_outcome("failed")
            return
        self._stats.replays += 1
        _, outcome = await self._fetch_replay(start)
        self._replay_outcome(outcome)

    async def _fetch_replay(self, start: int) -> tuple[int, str]:
        """Ask the replay socket for batches from `start` and apply them: (batches applied,
        outcome "complete" / "partial" (reset: they did not connect) / "failed")."""
        if self.replay_endpoint is None:
            return 0, "failed"
        timeout = self._settings.replay_timeout_s
        if self._stats.last_seq is None:
            timeout *= JOIN_REPLAY_TIMEOUT_MULTIPLE
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # A fresh socket per replay, so late replies to an abandoned one cannot leak in.
        sock.connect(self.replay_endpoint)
        contiguous = True
        applied = 0
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation.
                async with asyncio.timeout(timeout):
                    frames = await sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]  # the DEALER keeps the ROUTER's empty delimiter
                if len(frames) == 2:  # older replies: [seq, payload], no topic
                    frames = [b"", *frames]
                if len(frames) != 3:
                    self._decode_error(DecodeError(f"replay reply has {len(frames)} frames"))
                    continue
                if frames[1] == REPLAY_END_SEQ:
                    break
                try:
                    batch = decode_message(frames)
                except DecodeError as exc:
                    self._decode_error(exc)
                    continue  # its seq stays missing: the next batch will not connect
                last = self._stats.last_seq
                expected = 0 if last is None else last + 1
                if batch.seq < expected:
                    continue
                if batch.seq > expected:
                    # The buffer starts after what we need (or lost one): rebuild from here.
                    contiguous = False
                    self._reset("gap" if last is not None else "join")
                self._apply(batch)
                applied += 1
                if self._budget <= 0:
                    await asyncio.sleep(0)
                    self._budget = self._settings.max_blocks_per_wake
        except TimeoutError:
            _log.warning("kv-events %s: replay from seq %d timed out", self.label, start)
            return applied, "failed"
        finally:
            sock.close(linger=0)
        return applied, "complete" if contiguous else "partial"

    # ----------------------------------------------------------------- applying

    def _apply(self, batch: EventBatch) -> None:
        st = self._stats
        pod = self.pod
        counts = apply_events(self._writer, pod, batch.events)
        st.batches += 1
        st.stored_blocks += counts.stored_blocks
        st.removed_blocks += counts.removed_blocks
        st.cleared += counts.cleared
        st.skipped_events += counts.skipped
        st.unknown_events += batch.unknown_events
        st.orphans += counts.orphans
        st.last_seq = batch.seq
        st.last_ts = batch.ts
        st.lag_s = self._wall() - batch.ts
        self._budget -= counts.stored_blocks + counts.removed_blocks + 1
        m = self._metrics
        if m is not None:
            label = self.label
            m.series(m.batches, label).inc()
            m.series(m.lag, label).set(st.lag_s)
            for kind, n in (
                ("stored_blocks", counts.stored_blocks),
                ("removed_blocks", counts.removed_blocks),
                ("cleared", counts.cleared),
                ("skipped", counts.skipped),
                ("unknown", batch.unknown_events),
            ):
                if n:
                    m.series(m.events, label, kind).inc(n)
            if counts.orphans:
                m.series(m.orphans, label).inc(counts.orphans)

    def _reset(self, reason: str) -> None:
        self._writer.cleared(self.pod)
        self._stats.resets += 1
        if self._metrics is not None:
            self._metrics.resets.labels(self.label, reason).inc()

    def _replay_outcome(self, outcome: str) -> None:
        if outcome != "complete":
            self._stats.replay_failures += 1
        if self._metrics is not None:
            self._metrics.replays.labels(self.label, outcome).inc()

    def _decode_error(self, exc: DecodeError) -> None:
        self._stats.decode_errors += 1
        _log.debug("kv-events %s: skipped a malformed message: %s", self.label, exc.reason)
        if self._metrics is not None:
            self._metrics.decode_errors.labels(self.label).inc()


def _recv_nowait(sock: zmq.Socket[bytes]) -> list[bytes] | None:
    try:
        return sock.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return None


async def _readable(loop: asyncio.AbstractEventLoop, sock: zmq.Socket[bytes]) -> None:
    """Until `sock` has a message. ZMQ's descriptor signals changes, not data: it is read
    again (EVENTS) after every signal, and watched only while we wait."""
    fd = sock.FD
    while not cast(int, sock.EVENTS) & zmq.POLLIN:
        signalled = loop.create_future()
        loop.add_reader(fd, _set_once, signalled)
        try:
            await signalled
        finally:
            loop.remove_reader(fd)


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass(slots=True)
class ApplyCounts:
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    skipped: int = 0  # events for other tiers or KV-cache groups
    orphans: int = 0


def apply_events(index: IndexWriter, pod: str, events: Iterable[KVEvent]) -> ApplyCounts:
    """Apply one batch's events for `pod` to `index`.

    Only the GPU tier and KV-cache group 0 are indexed: CPU/disk copies and the extra groups
    of hybrid models would otherwise count as GPU prefix hits. Consecutive removals (vLLM
    sends one event per evicted block) reach the index as one call.
    """
    counts = ApplyCounts()
    removals: list[int] = []
    for event in events:
        if isinstance(event, BlockRemoved):
            if event.medium not in _INDEXED_MEDIA or event.group_idx:
                counts.skipped += 1
            else:
                removals += event.block_hashes
            continue
        if removals:
            index.removed(pod, removals)
            counts.removed_blocks += len(removals)
            removals = []
        if isinstance(event, BlockStored):
            if event.medium not in _INDEXED_MEDIA or event.group_idx:
                counts.skipped += 1
                continue
            result = index.stored(
                pod,
                event.block_hashes,
                event.parent_block_hash,
                event.token_ids,
                block_size=event.block_size,
                lora_name=event.lora_name,
                extra_keys=event.extra_keys,
            )
            counts.stored_blocks += len(event.block_hashes)
            counts.orphans += result.orphans
        elif isinstance(event, AllBlocksCleared):
            index.cleared(pod)
            counts.cleared += 1
    if removals:
        index.removed(pod, removals)
        counts.removed_blocks += len(removals)
    return counts


class KVEventManager:
    """Keeps one subscriber per pod that publishes KV events, following the endpoint set.

    `indexes` maps a model name to its ExactIndex; endpoints of other models, or without a
    `kv_events_endpoint`, get no subscriber (their pods stay on the approximate index).
    """

    def __init__(
        self,
        *,
        indexes: Mapping[str, ExactIndex],
        settings: SubscriberSettings | None = None,
        context: zmq.asyncio.Context | None = None,
        registry: CollectorRegistry | None = None,
        metrics: KVEventMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """Pass `registry` to register new metrics, or `metrics` to reuse ones registered
        earlier (a registry accepts each name once, e.g. across config reloads)."""
        self._indexes = dict(indexes)
        self._settings = settings or SubscriberSettings()
        self._own_context = context is None
        self._ctx = zmq.asyncio.Context() if context is None else context
        if metrics is None and registry is not None:
            metrics = KVEventMetrics(registry)
        self._metrics = metrics
        self._clock = clock
        self._wall = wall_clock
        # One subscriber per stream, by label (the address; `address/dp<r>` for rank r > 0).
        self._subs: dict[str, KVEventSubscriber] = {}
        self._ranks: dict[str, tuple[str, ...]] = {}  # address -> its streams' labels
        self._keys: dict[str, _Key] = {}  # address -> (model, pub, replay, data-parallel size)

    async def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """Start subscribers for new pods, stop (and forget) removed or changed ones. A pod
        with `data_parallel_size` N gets one subscriber per rank (base port + rank), all
        feeding its one index entry."""
        wanted: dict[str, _Key] = {}
        for ep in endpoints:
            if ep.kv_events_endpoint and ep.model in self._indexes:
                size = max(1, ep.data_parallel_size)
                wanted[ep.address] = (ep.model, ep.kv_events_endpoint, ep.kv_replay_endpoint, size)
        for address in [a for a in self._ranks if self._keys.get(a) != wanted.get(a)]:
            await self._remove(address)
        for address, key in wanted.items():
            if address in self._ranks:
                continue
            model, pub, replay, size = key
            index = self._indexes[model]
            ranks = PodRanks(index, size) if size > 1 else None
            labels = []
            for rank in range(size):
                label = address if rank == 0 else f"{address}/dp{rank}"
                try:
                    rank_pub = rank_endpoint(pub, rank)
                    rank_replay = rank_endpoint(replay, rank)
                except ValueError as exc:
                    _log.warning("kv-events %s: %s", address, exc)
                    break
                assert rank_pub is not None
                sub = KVEventSubscriber(
                    pod=address,
                    endpoint=rank_pub,
                    replay_endpoint=rank_replay,
                    index=index,
                    context=self._ctx,
                    settings=self._settings,
                    metrics=self._metrics,
                    clock=self._clock,
                    wall_clock=self._wall,
                    label=label,
                    writer=ranks.view(rank) if ranks is not None else None,
                )
                self._subs[label] = sub
                labels.append(label)
                sub.start()
            self._ranks[address] = tuple(labels)
            self._keys[address] = key

    async def set_indexes(self, indexes: Mapping[str, ExactIndex]) -> None:
        """Feed these indexes from now on (a config reload). A subscriber whose model's index
        is another object stops (its pod leaves the old index); `set_endpoints` then starts
        one on the new index. Subscribers of unchanged indexes keep running."""
        new = dict(indexes)
        for address in list(self._ranks):
            model = self._keys[address][0]
            if new.get(model) is not self._indexes.get(model):
                await self._remove(address)
        self._indexes = new

    def is_healthy(self, address: str) -> bool:
        """Every rank's stream is alive (one silent rank hides its cache); for a rank's
        label (`pod/dp1`), that stream alone."""
        labels = self._ranks.get(address)
        if labels is None:
            sub = self._subs.get(address)
            return sub is not None and sub.healthy()
        return bool(labels) and all(self._subs[label].healthy() for label in labels)

    def note_traffic(self, address: str, now: float | None = None) -> None:
        # The server picks a rank itself: each rank's stream may owe the events.
        for label in self._ranks.get(address, ()):
            self._subs[label].note_traffic(now)

    def subscriber(self, address: str) -> KVEventSubscriber | None:
        """The stream of `address`, or of `address/dp<r>` (a rank)."""
        return self._subs.get(address)

    def stats(self) -> dict[str, SubscriberStats]:
        return {label: sub.stats for label, sub in self._subs.items()}

    async def close(self) -> None:
        for address in list(self._ranks):
            await self._remove(address)
        if self._own_context:
            self._ctx.term()

    async def _remove(self, address: str) -> None:
        labels = self._ranks.pop(address)
        model = self._keys.pop(address)[0]
        for label in labels:
            await self._subs.pop(label).stop()
        self._indexes[model].drop_pod(address)
        if self._metrics is not None:
            for label in labels:
                self._metrics.forget(label)
