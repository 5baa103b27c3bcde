"""Many replicas, one view: routing state shared over a bus, never on the decision path.

Each replica (server process) appends what it changes to an outbox, a few microseconds on the
decision path, and publishes one combined message per tick (~10 ms):
- its in-flight requests and tokens per pod as absolute values (a lost message is corrected by
  the next one; a replica that stops publishing has its share expire);
- new approximate prefix-index blocks per (model, pod), for pods without healthy KV events
  (the exact index stays local: every replica reads every pod's KV events itself);
- VTC fairness charges per user (weighted tokens), kept until a publish succeeds;
- once, for a replica that just joined (its first message says hello), a snapshot of the
  approximate index (the most recent blocks per pod) and of the predicted-latency models (each
  pod's sums, `MAX_MODELS_PER_MESSAGE` a message), so it does not start cold: a process
  that restarts routes by what its peers learned, not by its first few samples (on kvwins'
  capture, replayed from no models, predicted-latency collapsed in 10 of 16 seeds, from the
  running gateway's in 0 of 12; docs/strategies.md). The models go after the samples that
  were in the outbox when they were taken (learned by them: the joiner replaces the model it
  learned from those with the peer's, so none counts twice). A sample noted after they were
  taken, of a pod whose model goes in a later message of a large snapshot (50 models a
  message, one message a tick), reaches the joiner first and is then replaced with a model
  that had not learned it: lost there. The joiner keeps a model that learned as many
  samples as the peer's;
- the latency samples this replica learnt from its access-log records (features, TTFT, TPOT),
  since Envoy sends each worker's records to one process: every replica's predicted-latency
  models learn from every record. Like fairness charges they stay in the outbox until a publish
  succeeds, and they go out only while a peer is live (heard within `expire_s`: its
  subscription is up), so samples from a bus outage or a peer's restart reach it afterwards
  (the newest `MAX_PENDING_SAMPLES`, `MAX_SAMPLES_PER_MESSAGE` per tick);
- the engine metrics of the pods this replica owns: each pod is scraped by one live replica,
  chosen by rendezvous hashing over the membership the heartbeats give (`owns`), which
  publishes what it parsed (and, beside the rows, each scrape's inter-token gap count, from
  which every replica's store works out the pod's recent step time); a replica whose copy gets
  old scrapes the pod itself.
- lease releases: a request's access-log record reached this replica but its lease is held by
  another (the record names it); the holder ends it when it hears. Kept until a publish
  succeeds, like fairness charges, and sent again (releases are idempotent) whenever they may
  not have reached the holder: when this replica's link comes back (what its client had not
  written when the connection broke is dropped) and when the holder says hello or joins
  again (its link was down, and core NATS delivers only to the subscriptions of the moment).
  A replica says hello in its first message and in its first after every reconnect. The
  releases of the last `RELEASE_REPLAY_S` are kept for this; one lost otherwise is caught by
  the lease's expiry;
- flow control's waiting requests per (model, band), as absolute values like in-flight (sent
  while any wait, and once more when the queue empties), so every replica dispatches the
  highest band first and splits free slots in proportion to the depths;
- once, at shutdown, this replica's open leases, each addressed to one live peer (rendezvous
  hashing on the lease), which adopts it until its record arrives.
A message goes out at least every heartbeat even when nothing changed, so peers know who is
alive (the membership that scrape ownership uses).

Receiving applies a peer's message to the same objects the decision reads (InflightTracker's
remote shares, the ApproximateIndex, FairnessCounters), so a decision never waits on the bus
and never sees a half-applied message. Messages are deduplicated per peer by sequence number;
an older message's in-flight counts never replace a newer one's.

The bus going away changes nothing for routing: publishes are dropped and counted, peers'
shares expire after `expire_s`, and everything resumes when the bus comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.accounting.fairness import FairnessCounters
from extproc.accounting.inflight import InflightTracker, Load
from extproc.config import SyncConfig
from extproc.kvcache.approx import ApproximateIndex
from extproc.sync.bus import Bus
from extproc.types import EngineMetrics

__all__ = [
    "PROTOCOL_VERSION",
    "AdoptSink",
    "LatencyRows",
    "LatencyRowsSink",
    "LatencySink",
    "MetricsSink",
    "QueueDepths",
    "QueueSink",
    "ReleaseSink",
    "StateSync",
    "SyncMetrics",
    "owner",
]

# (model, address, metrics): a peer's scrape, on this replica's monotonic clock.
MetricsSink = Callable[[str, str, EngineMetrics], None]
# (model, pod, decision tag, ttft_s, tpot_s): a latency sample a peer learnt from a record.
LatencySink = Callable[[str, str, str, float | None, float | None], object]
# Every latency model that learned a TTFT as `[model, pod, values]` rows; what takes a peer's.
LatencyRows = Callable[[], list[list[Any]]]
LatencyRowsSink = Callable[[list[Any]], object]
# (replica, lease number): a peer got the record of this lease.
ReleaseSink = Callable[[str, int], object]
# Lease rows a replica that shut down handed to this one (director.leases.HandoffRow).
AdoptSink = Callable[[list[Any]], object]
# Flow control's waiting requests per model and band: {model: {band: (requests, bytes)}}.
QueueDepths = dict[str, dict[int, tuple[int, int]]]
# (replica, its depths): a peer's queue as it last said ({} once it is empty or gone).
QueueSink = Callable[[str, QueueDepths], object]
_METRIC_FIELDS = (
    "running", "waiting", "kv_cache_usage", "prefix_cache_hits", "prefix_cache_queries",
    "prompt_tokens_total", "generation_tokens_total", "ttft_avg_s", "itl_avg_s",
)  # fmt: skip
_INT_FIELDS = ("max_lora", "block_size", "num_gpu_blocks")


def owner(key: str, members: Sequence[str]) -> str:
    """Rendezvous (highest random weight) hashing: the member that owns `key`. Adding or
    removing a member moves only the keys it wins or owned."""
    return max(members, key=lambda m: xxhash.xxh64_intdigest(f"{m}\x00{key}".encode()))


log = logging.getLogger("extproc.sync")

PROTOCOL_VERSION = 1
_SEEN_WINDOW = 256  # recent sequence numbers remembered per peer, to drop duplicates
MAX_PENDING_BLOCKS = 60_000  # outbox bound (~540 kB; blocks are re-learnt anyway)
MAX_PENDING_CHARGES = 50_000  # users with a fairness charge not yet sent; a new one past it waits
MAX_CHARGES_PER_MESSAGE = 1_000  # ~140 kB with 128-character users (`bounded_id`)
# A message past this goes without its blocks (NATS refuses over max_payload, 1 MiB by default,
# and a message it refuses is refused again: nothing else in it may depend on the blocks).
MAX_MESSAGE_BYTES = 768 * 1024
MAX_PENDING_SAMPLES = 10_000  # latency samples kept for the peers; the oldest go first
MAX_SAMPLES_PER_MESSAGE = 1_000  # ~80 kB: a replay after an outage stays far below max_payload
MAX_PENDING_RELEASES = 100_000  # lease releases kept while the bus is down (then they expire)
MAX_RELEASES_PER_MESSAGE = 2_000  # ~50 kB: no backlog makes a message the bus cannot carry
RELEASE_REPLAY_S = 900.0  # releases sent are kept this long to send again (the longest lease)
SNAPSHOT_BLOCKS_PER_POD = 20_000  # what a peer sends a replica that just joined
# Latency models of a snapshot a message: ~0.75 kB each, and ~130 us each for the joiner to
# take (a Cholesky solve per target, in Python): 50 keep a message's work on its loop ~7 ms.
MAX_MODELS_PER_MESSAGE = 50
DEFAULT_SETTINGS = SyncConfig()
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class SyncMetrics:
    def __init__(self, registry: CollectorRegistry, *, namespace: str = "extproc") -> None:
        ns = namespace
        self.peers = Gauge(
            "sync_peers", "Peer replicas heard from within sync.expire_s", namespace=ns,
            registry=registry,
        )  # fmt: skip
        self.connected = Gauge(
            "sync_connected", "1 while the bus is connected", namespace=ns, registry=registry
        )
        self.lag = Histogram(
            "sync_lag_seconds", "Peer message age on arrival (publisher's clock to ours)",
            buckets=LAG_BUCKETS, namespace=ns, registry=registry,
        )  # fmt: skip
        self.messages = Counter(
            "sync_messages", "Sync messages by direction (sent, received)", ["direction"],
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.dropped = Counter(
            "sync_dropped", "Sync messages not sent or not applied, by reason "
            "(bus_down, duplicate, malformed, version)", ["reason"], namespace=ns,
            registry=registry,
        )  # fmt: skip
        self.stale = Counter(
            "sync_stale", "Peers whose share expired (silent for sync.expire_s)", namespace=ns,
            registry=registry,
        )  # fmt: skip


@dataclass(slots=True)
class _Peer:
    last_seen: float
    last_seq: int
    seen: OrderedDict[int, None]


class StateSync:
    """Publishes this replica's changes and applies its peers'. One per process."""

    def __init__(
        self,
        *,
        replica: str,
        bus: Bus,
        inflight: InflightTracker,
        fairness: FairnessCounters,
        approx: Callable[[str], ApproximateIndex | None],
        models: Callable[[], Iterable[str]] = tuple,
        on_metrics: MetricsSink | None = None,
        on_latency: LatencySink | None = None,
        latency_rows: LatencyRows = list,  # none by default
        on_latency_rows: LatencyRowsSink | None = None,
        on_release: ReleaseSink | None = None,
        on_adopt: AdoptSink | None = None,
        queues: Callable[[], QueueDepths] | None = None,
        on_queues: QueueSink | None = None,
        settings: SyncConfig = DEFAULT_SETTINGS,  # its tick_s, heartbeat_s and expire_s
        metrics: SyncMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.replica = replica
        self._bus = bus
        self._inflight = inflight
        self._fairness = fairness
        self._approx = approx
        self._models = models
        self._snapshot_due = False  # a peer joined: send it our approximate index once
        self._snapshot: deque[tuple[str, str, list[int]]] = deque()  # its rows still to send
        self._on_metrics = on_metrics
        self._on_latency = on_latency
        self._latency_rows = latency_rows
        self._on_latency_rows = on_latency_rows
        # A snapshot's latency models: due once a peer joined, taken when the samples noted
        # before them leave in the same message, then sent MAX_MODELS_PER_MESSAGE a message.
        self._models_due = False
        self._model_rows: deque[list[Any]] = deque()
        self._on_release = on_release
        self._on_adopt = on_adopt
        self._queues = queues
        self._on_queues = on_queues
        self._last_queues: QueueDepths = {}
        self.settings = settings
        self._metrics = metrics
        self._clock = clock
        self._wall = wall_clock
        self._seq = 0
        self._blocks: list[tuple[str, str, list[int]]] = []
        self._pending_blocks = 0
        self._charges: dict[str, float] = {}
        self._scrapes: dict[tuple[str, str], list[Any]] = {}
        # Each scrape's inter-token gap count, sent beside the rows (key "n", one per row of
        # "m"): a replica that predates it reads the rows as before and ignores the key.
        self._itl_counts: dict[tuple[str, str], float | None] = {}
        self._samples: deque[list[Any]] = deque()  # latency samples not yet sent
        # Lease releases, (replica, lease number): not yet sent (in order, each once), and
        # sent (when first sent, oldest first), to send again when they may have been lost.
        self._releases: dict[tuple[str, int], None] = {}
        self._sent_releases: OrderedDict[tuple[str, int], float] = OrderedDict()
        self._hello_due = True  # the first message, and the first after each reconnect
        self._members: list[str] = [replica]
        self._last_inflight: dict[str, Load] | None = None
        self._last_sent = float("-inf")
        self._peers: dict[str, _Peer] = {}
        self._task: asyncio.Task[None] | None = None
        self._was_connected: bool | None = None

    # -- the outbox (decision path) ---------------------------------------------------------

    def note_blocks(self, model: str, pod: str, block_hashes: Sequence[int]) -> None:
        if block_hashes and self._pending_blocks < MAX_PENDING_BLOCKS:
            self._blocks.append((model, pod, list(block_hashes)))
            self._pending_blocks += len(block_hashes)

    def note_charge(self, user: str, tokens: float) -> None:
        charges = self._charges
        if user in charges:
            charges[user] += tokens
        elif len(charges) < MAX_PENDING_CHARGES:
            charges[user] = tokens
        else:  # the bus has been down a while and users keep coming: this one goes unshared
            self._count("dropped", "charges_full")

    def note_metrics(self, model: str, address: str, metrics: EngineMetrics) -> None:
        """A scrape this replica made, for the peers (the latest per pod goes out)."""
        scraped_wall = self._wall() - max(0.0, self._clock() - metrics.updated_at)
        row: list[Any] = [model, address, scraped_wall]
        row.extend(getattr(metrics, f) for f in _METRIC_FIELDS)
        row.extend(getattr(metrics, f) for f in _INT_FIELDS)
        row.append(list(metrics.running_lora_adapters))
        row.append(list(metrics.waiting_lora_adapters))
        self._scrapes[(model, address)] = row
        self._itl_counts[(model, address)] = metrics.itl_count

    def note_latency(
        self, model: str, pod: str, tag: str, ttft_s: float | None, tpot_s: float | None
    ) -> None:
        """A latency sample this replica learnt from an access-log record, for the peers."""
        self._samples.append([model, pod, tag, ttft_s, tpot_s])
        if len(self._samples) > MAX_PENDING_SAMPLES:
            self._samples.popleft()  # the models forget old samples first anyway

    def note_release(self, replica: str, seq: int) -> None:
        """The record of lease `seq` held by `replica` reached this one: tell the holder."""
        if len(self._releases) < MAX_PENDING_RELEASES:
            self._releases[(replica, seq)] = None

    async def handoff(self, rows: Sequence[list[Any]]) -> int:
        """Shutting down: send this replica's open leases (`[replica, seq, ...]` rows) to live
        peers, each to the one rendezvous hashing picks for it, which holds it until its
        record arrives. Returns how many were sent (0 with no live peer or no bus)."""
        peers = sorted(self._peers)
        if not rows or not peers:
            return 0
        targets: dict[str, list[list[Any]]] = {}
        for row in rows:
            targets.setdefault(owner(f"{row[0]}/{row[1]}", peers), []).append(list(row))
        message = self._next_message({})  # no in-flight left here: they move with the leases
        message["a"] = targets
        if not await self._bus.publish(msgpack.packb(message)):
            self._count("dropped", "bus_down")
            return 0
        self._count("messages", "sent")
        return len(rows)

    def _next_message(self, inflight: dict[str, Load]) -> dict[str, Any]:
        """A new message's header (version, replica, sequence, wall time) and this replica's
        absolute in-flight counts; the caller adds what it carries."""
        self._seq += 1
        return {
            "v": PROTOCOL_VERSION,
            "r": self.replica,
            "s": self._seq,
            "t": self._wall(),
            "i": [[a, load.requests, load.tokens] for a, load in inflight.items()],
        }

    def owns(self, key: str) -> bool:
        """Whether this replica scrapes `key` (a metrics URL) among the live members."""
        return owner(key, self._members) == self.replica

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        await self._bus.start(self.receive)
        self._task = asyncio.create_task(self._run(), name="state-sync")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._bus.close()

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # sync must never stop routing; log and go on
                log.exception("state sync tick failed")
            await asyncio.sleep(self.settings.tick_s)

    # -- publishing ------------------------------------------------------------------------

    async def tick(self) -> None:
        """Publish what changed (or a heartbeat), then expire silent peers."""
        now = self._clock()
        self._note_connection()
        inflight = dict(self._inflight.snapshot())
        changed_inflight = inflight != self._last_inflight
        queues = self._queues() if self._queues is not None else {}
        changed_queues = queues != self._last_queues
        due = now - self._last_sent >= self.settings.heartbeat_s
        # Samples wait for a live peer: one whose subscription is up, so they reach someone.
        samples = bool(self._samples) and bool(self._peers)
        pending = (
            self._blocks or self._charges or self._scrapes or samples or self._snapshot_due
            or self._snapshot or self._models_due or self._model_rows or self._releases
        )  # fmt: skip
        if changed_inflight or changed_queues or pending or due:
            message = self._next_message(inflight)
            if queues:  # absolute, like in-flight: a message without it says "none waits"
                message["q"] = {m: {p: list(v) for p, v in b.items()} for m, b in queues.items()}
            if self._hello_due:
                # hello: peers answer with a snapshot of their index and the releases of
                # leases held here that they may have sent while this link was down.
                message["h"] = True
            if self._snapshot_due:
                self._snapshot_due = False
                self._add_snapshot()
            blocks = self._take_blocks()
            if blocks:
                message["b"] = blocks
            charges = list(itertools.islice(self._charges.items(), MAX_CHARGES_PER_MESSAGE))
            for user, _ in charges:
                del self._charges[user]
            if charges:
                message["f"] = charges
            releases = list(itertools.islice(self._releases, MAX_RELEASES_PER_MESSAGE))
            if releases:
                message["x"] = [list(key) for key in releases]
            if self._scrapes:
                message["m"] = list(self._scrapes.values())
                message["n"] = [self._itl_counts.get(key) for key in self._scrapes]
            batch: list[list[Any]] = []
            if samples:
                take = min(len(self._samples), MAX_SAMPLES_PER_MESSAGE)
                batch = [self._samples.popleft() for _ in range(take)]
                message["l"] = batch
            if self._models_due and not self._samples:
                # Every sample the models learned before now has gone out before them or goes
                # in this message, which the peer applies first: none is learned twice there.
                self._models_due = False
                self._model_rows = deque(self._latency_rows())
            rows = [self._model_rows.popleft()
                    for _ in range(min(len(self._model_rows), MAX_MODELS_PER_MESSAGE))]  # fmt: skip
            if rows:
                message["lm"] = rows
            data = msgpack.packb(message)
            if len(data) > MAX_MESSAGE_BYTES and "b" in message:
                del message["b"]
                data = msgpack.packb(message)
                self._count("dropped", "blocks_too_large")
            ok = await self._bus.publish(data)
            if ok:
                self._hello_due = False
                self._keep_sent(releases, now)
                self._last_inflight = inflight
                self._last_queues = queues
                self._last_sent = now
                self._count("messages", "sent")
            else:
                self._count("dropped", "bus_down")  # the releases stay for the next one
                for user, tokens in charges:  # kept for the next publish
                    self._charges[user] = self._charges.get(user, 0.0) + tokens
                self._samples.extendleft(reversed(batch))  # kept for the next publish
                if rows:  # taken again after those samples, as the models will be then
                    self._model_rows.clear()
                    self._models_due = True
                while len(self._samples) > MAX_PENDING_SAMPLES:
                    self._samples.popleft()
            # Blocks and scrapes are not kept for a retry: newer ones replace them anyway.
            self._scrapes = {}
            self._itl_counts = {}
        self._expire(now)

    def _add_snapshot(self) -> None:
        """Our approximate index (the most recent blocks per pod) and latency models for a
        replica that just joined, so it does not start cold; applying blocks twice is harmless,
        a model is taken only where the joiner's own is cold. They go out over the next
        messages, MAX_PENDING_BLOCKS and MAX_MODELS_PER_MESSAGE a message (`_take_blocks`)."""
        self._snapshot.clear()
        self._models_due = True
        for model in self._models():
            index = self._approx(model)
            if index is None:
                continue
            for pod, blocks in index.recent_blocks(SNAPSHOT_BLOCKS_PER_POD).items():
                if blocks:
                    self._snapshot.append((model, pod, list(blocks)))

    def _take_blocks(self) -> list[tuple[str, str, list[int]]]:
        """The blocks for this message, taken out of the outbox now (what is noted while the
        publish awaits goes in the next one): those noted since the last message, then as much
        of a snapshot still to send as fits in MAX_PENDING_BLOCKS."""
        blocks, self._blocks = self._blocks, []
        room, self._pending_blocks = MAX_PENDING_BLOCKS - self._pending_blocks, 0
        while self._snapshot and room > 0:
            model, pod, hashes = self._snapshot[0]
            if len(hashes) <= room:
                self._snapshot.popleft()
            else:
                self._snapshot[0] = (model, pod, hashes[room:])
                hashes = hashes[:room]
            blocks.append((model, pod, hashes))
            room -= len(hashes)
        return blocks

    def _keep_sent(self, releases: list[tuple[str, int]], now: float) -> None:
        sent = self._sent_releases
        for key in releases:
            del self._releases[key]
            sent.setdefault(key, now)  # a release sent again keeps its first time
        horizon = now - RELEASE_REPLAY_S
        while sent and (next(iter(sent.values())) < horizon or len(sent) > MAX_PENDING_RELEASES):
            sent.popitem(last=False)

    def _replay_releases(self, holder: str | None) -> None:
        """Send again the releases sent to `holder` (None: to every holder), which may not
        have reached it. Idempotent at the holder: a lease ends once."""
        for key in self._sent_releases:
            if len(self._releases) >= MAX_PENDING_RELEASES:
                break
            if holder is None or key[0] == holder:
                self._releases[key] = None

    def _note_connection(self) -> None:
        connected = self._bus.connected
        if connected != self._was_connected:
            if self._was_connected is not None:
                if connected:
                    log.info("state sync: bus connected again; sharing resumes")
                    # What this link's client held unsent when it broke was dropped; and
                    # peers sent this replica's releases while it could not hear them.
                    self._replay_releases(None)
                    self._hello_due = True
                else:
                    log.warning("state sync: bus lost; routing goes on with local state")
            self._was_connected = connected
            if self._metrics is not None:
                self._metrics.connected.set(1 if connected else 0)

    def _expire(self, now: float) -> None:
        horizon = now - self.settings.expire_s
        for replica in [r for r, p in self._peers.items() if p.last_seen < horizon]:
            del self._peers[replica]
            self._inflight.drop_remote(replica)
            if self._on_queues is not None:
                self._on_queues(replica, {})
            log.info("state sync: peer %s silent for %.1fs; its share expired", replica,
                     self.settings.expire_s)  # fmt: skip
            if self._metrics is not None:
                self._metrics.stale.inc()
        self._members = sorted([self.replica, *self._peers])
        if self._metrics is not None:
            self._metrics.peers.set(len(self._peers))

    # -- receiving -------------------------------------------------------------------------

    def receive(self, data: bytes) -> None:
        """Apply one peer message. Never raises: a bad message is counted and dropped."""
        try:
            message = msgpack.unpackb(data, strict_map_key=False)
            if not isinstance(message, dict):
                raise TypeError("not a map")
            if message.get("v") != PROTOCOL_VERSION:
                self._count("dropped", "version")
                return
            replica, seq = message["r"], message["s"]
            if not isinstance(replica, str) or not isinstance(seq, int):
                raise TypeError("replica or seq")
            if replica == self.replica:
                return
            self._apply(replica, seq, message)
        except Exception:
            self._count("dropped", "malformed")
            log.debug("state sync: dropped a malformed message", exc_info=True)

    def _apply(self, replica: str, seq: int, message: dict[str, Any]) -> None:
        now = self._clock()
        peer = self._peers.get(replica)
        joined = peer is None
        if peer is None:
            peer = self._peers[replica] = _Peer(last_seen=now, last_seq=0, seen=OrderedDict())
            self._members = sorted([self.replica, *self._peers])
            log.info("state sync: peer %s joined", replica)
            self._replay_releases(replica)  # back after an outage: it heard none of them
        if seq in peer.seen:
            self._count("dropped", "duplicate")
            return
        peer.seen[seq] = None
        if len(peer.seen) > _SEEN_WINDOW:
            peer.seen.popitem(last=False)
        peer.last_seen = now
        self._count("messages", "received")
        if message.get("h") is True:
            self._snapshot_due = True
            if not joined:
                self._replay_releases(replica)  # its link came back within expire_s
        sent_at = message.get("t")
        if isinstance(sent_at, int | float) and self._metrics is not None:
            self._metrics.lag.observe(max(0.0, self._wall() - sent_at))
        if seq > peer.last_seq:  # absolute values: only the newest message's count
            peer.last_seq = seq
            self._inflight.set_remote(replica, _loads(message.get("i", ())))
            queued = message.get("q", {})  # sent whenever anything waits: absent = empty
            if self._on_queues is not None and isinstance(queued, dict):
                self._on_queues(replica, queued)
        for model, pod, hashes in message.get("b", ()):
            index = self._approx(model)
            if index is not None:
                index.record(pod, [int(h) for h in hashes], now)
        for user, tokens in message.get("f", ()):
            self._fairness.add_remote(str(user), float(tokens))
        if self._on_release is not None:
            for holder, lease in message.get("x", ()):
                self._on_release(str(holder), int(lease))
        adopted = message.get("a")
        if self._on_adopt is not None and isinstance(adopted, dict):
            rows = adopted.get(self.replica)
            if rows:
                self._on_adopt(list(rows))
        if self._on_latency is not None:
            for model, pod, tag, ttft, tpot in message.get("l", ()):
                self._on_latency(str(model), str(pod), str(tag), _seconds(ttft), _seconds(tpot))
        rows = message.get("lm")
        if self._on_latency_rows is not None and isinstance(rows, list) and rows:
            self._on_latency_rows(rows)
        if self._on_metrics is not None:
            counts = message.get("n")
            for i, row in enumerate(message.get("m", ())):
                count = counts[i] if isinstance(counts, list) and i < len(counts) else None
                model, address, metrics = self._metrics_from(row, now, count)
                self._on_metrics(model, address, metrics)

    def _metrics_from(
        self, row: list[Any], now: float, itl_count: Any = None
    ) -> tuple[str, str, EngineMetrics]:
        model, address, scraped_wall = str(row[0]), str(row[1]), float(row[2])
        n = len(_METRIC_FIELDS)
        floats = row[3 : 3 + n]
        ints = row[3 + n : 3 + n + len(_INT_FIELDS)]
        running_lora, waiting_lora = row[3 + n + len(_INT_FIELDS) :]
        values: dict[str, Any] = {
            f: None if v is None else float(v) for f, v in zip(_METRIC_FIELDS, floats, strict=True)
        }
        values.update(
            {f: None if v is None else int(v) for f, v in zip(_INT_FIELDS, ints, strict=True)}
        )
        age = max(0.0, self._wall() - scraped_wall)
        metrics = EngineMetrics(
            updated_at=now - age,
            running_lora_adapters=tuple(str(a) for a in running_lora),
            waiting_lora_adapters=tuple(str(a) for a in waiting_lora),
            itl_count=None if itl_count is None else float(itl_count),
            **values,
        )
        return model, address, metrics

    # -- views -----------------------------------------------------------------------------

    def peers(self) -> dict[str, float]:
        """Live peers and how long ago each was heard from (seconds)."""
        now = self._clock()
        return {r: now - p.last_seen for r, p in self._peers.items()}

    def members(self) -> list[str]:
        """This replica and its live peers, sorted: the membership for scrape ownership."""
        return list(self._members)

    def _count(self, name: str, label: str) -> None:
        if self._metrics is not None:
            getattr(self._metrics, name).labels(label).inc()


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _loads(rows: Iterable[Any]) -> dict[str, Load]:
    out: dict[str, Load] = {}
    for address, requests, tokens in rows:
        out[str(address)] = Load(max(0, int(requests)), max(0, int(tokens)))
    return out
