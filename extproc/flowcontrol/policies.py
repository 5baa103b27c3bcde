"""The flow controller's policies, plugins as routing's are (`extproc.routing.framework`): a small
class with a `type_name`, a frozen `Params` dataclass decoded strictly from the config, and a
constructor `(name, params)`, registered explicitly in a `PolicyRegistry` (the composition root
builds it with `builtin_policies`; a policy that needs more than its params, as `token` needs
the VTC counters, is registered with a factory closing over it).

    fairness (inside a band):   FairnessPolicy.index()            -> one per band: told when a
                                                                     flow's head changes, it
                                                                     picks the flow that
                                                                     dispatches next
                                FairnessPolicy.ahead(flows, flow) -> how many go before a new
                                                                     request of `flow` (for
                                                                     deadlines: an estimate)
    ordering (inside a flow):   OrderingPolicy.key(item)          -> smaller goes first

Between bands there is no policy: strict priority (the highest band with anything waiting
goes first, always). Config: `flow_control.fairness` and `flow_control.ordering` name the type,
`flow_control.policy_params.<type>` holds its params.
"""

from __future__ import annotations

import heapq
import itertools
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, is_dataclass
from typing import Any, ClassVar, Literal, Protocol

from extproc.routing.framework import EmptyParams, PluginConfigError, decode_params

__all__ = [
    "Deadline",
    "DeadlineParams",
    "FairnessIndex",
    "FairnessPolicy",
    "Fcfs",
    "Flow",
    "FlowHeap",
    "GlobalStrict",
    "OrderingPolicy",
    "PolicyKind",
    "PolicyRegistry",
    "Queued",
    "RoundRobin",
    "TokenFair",
    "builtin_policies",
]

PolicyKind = Literal["fairness", "ordering"]


@dataclass(eq=False, slots=True)
class Queued:
    """One waiting request, as the policies see it."""

    flow: str  # the fairness id (or the user the VTC counters know), "" when none
    enqueued: float  # monotonic
    expires: float  # monotonic: enqueue + the request's TTL
    deadline: float | None  # monotonic: enqueue + its TTFT SLO when it sent one
    size: int  # body bytes (what the band's byte cap counts)
    seq: int  # arrival order, the final tie-break


class OrderingPolicy(Protocol):
    """Inside one flow: which waiting request goes first (the smallest key)."""

    type_name: ClassVar[str]
    Params: ClassVar[type]
    name: str

    def key(self, item: Queued) -> tuple[float, int]: ...


class Fcfs:
    """First come, first served."""

    type_name: ClassVar[str] = "fcfs"
    Params: ClassVar[type] = EmptyParams

    def __init__(self, name: str, params: object = None) -> None:
        self.name = name

    def key(self, item: Queued) -> tuple[float, int]:
        return (item.enqueued, item.seq)


@dataclass(frozen=True, slots=True)
class DeadlineParams:
    # The deadline of a request that sent no TTFT SLO: this long after it arrived (None: its
    # TTL, so it goes after every request with an SLO that is due sooner).
    default_deadline_s: float | None = None

    def __post_init__(self) -> None:
        if self.default_deadline_s is not None and self.default_deadline_s <= 0:
            raise ValueError("default_deadline_s must be > 0")


class Deadline:
    """Earliest deadline first: the enqueue time plus the request's TTFT SLO when it sent one
    (`x-slo-ttft-ms`), else plus `default_deadline_s` or its TTL (llm-d's EDF and SLO-deadline
    orderings in one)."""

    type_name: ClassVar[str] = "edf"
    Params: ClassVar[type] = DeadlineParams

    def __init__(self, name: str, params: DeadlineParams | None = None) -> None:
        self.name = name
        self._default = (params or DeadlineParams()).default_deadline_s

    def key(self, item: Queued) -> tuple[float, int]:
        if item.deadline is not None:
            due = item.deadline
        elif self._default is not None:
            due = item.enqueued + self._default
        else:
            due = item.expires
        return (min(due, item.expires), item.seq)


@dataclass(eq=False)
class Flow:
    """One flow's queue inside one band: a heap by the ordering policy's key. A request that
    leaves before its turn (cancelled, expired) is taken out lazily: its entry stays until it
    comes to the head or the removed outnumber the waiting, then the heap is rebuilt. So
    `remove` is O(log n) amortized, the heap never holds more than about twice the requests
    still waiting, and `head()` is always a waiting one."""

    name: str
    heap: list[tuple[tuple[float, int], Queued]] = field(default_factory=list)
    # Arrival numbers of removed requests whose entries are still in the heap.
    removed: set[int] = field(default_factory=set)

    def push(self, item: Queued, ordering: OrderingPolicy) -> None:
        heapq.heappush(self.heap, (ordering.key(item), item))

    def head(self) -> Queued:
        return self.heap[0][1]

    def head_key(self) -> tuple[float, int]:
        return self.heap[0][0]

    def pop(self) -> Queued:
        item = heapq.heappop(self.heap)[1]
        self._drop_removed_heads()
        return item

    def remove(self, item: Queued) -> None:
        """Take a request that is still waiting out of the queue."""
        if self.heap and self.heap[0][1] is item:
            self.pop()
            return
        self.removed.add(item.seq)
        if len(self.removed) > len(self.heap) // 2 + 8:  # mostly removed: rebuild
            self.heap = [e for e in self.heap if e[1].seq not in self.removed]
            heapq.heapify(self.heap)
            self.removed.clear()

    def _drop_removed_heads(self) -> None:
        while self.removed and self.heap and self.heap[0][1].seq in self.removed:
            self.removed.discard(heapq.heappop(self.heap)[1].seq)

    def __len__(self) -> int:
        """The requests still waiting."""
        return len(self.heap) - len(self.removed)


class FairnessIndex(Protocol):
    """One band's flows with a request waiting, in the order a fairness policy serves them.
    The controller keeps one per band and tells it whenever a flow's head request changes, so
    `pick` does not walk the band's flows."""

    def update(self, flow: Flow) -> None:
        """`flow` has a request waiting (it may be new to the band) and its head, or anything
        else its place reads, may have changed: read it again."""
        ...

    def remove(self, flow: Flow) -> None:
        """`flow` has nothing left waiting in the band."""
        ...

    def pick(self) -> Flow:
        """The flow whose head dispatches next (the band has one waiting, at least)."""
        ...


class FairnessPolicy(Protocol):
    """Inside one band: which flow dispatches next, as an index per band (`FlowHeap` keyed by
    the policy's `key` is the one the built-in policies use)."""

    type_name: ClassVar[str]
    Params: ClassVar[type]
    name: str

    def index(self) -> FairnessIndex:
        """A new, empty index for one band."""
        ...

    def ahead(self, flows: Sequence[Flow], flow: str) -> int:
        """Of the requests waiting in `flows`, about how many dispatch before one `flow`
        adds now (its own flow's included)."""
        ...


FlowKey = Callable[[Flow], tuple[float, int]]


class FlowHeap:
    """Implements `FairnessIndex` for a policy that serves the flow with the smallest key
    (`key(flow)`, unique per flow: it ends with the head's arrival number). A heap of (key when
    read, push number, flow); a flow's entry is its last push, older ones are skipped when they
    come to the top and rebuilt away once they outnumber the flows. A key may grow between
    `update`s (tokens used, a turn taken): the entry at the top is read again and moves down
    when its key grew, so what `pick` returns is the smallest key over the band as long as no
    key shrinks without an `update` of its flow. `pick` is O(log F) amortized for F flows, plus
    one move per key that grew since it was read."""

    def __init__(self, key: FlowKey) -> None:
        self._key = key
        self._heap: list[tuple[tuple[float, int], int, Flow]] = []
        self._entries: dict[str, tuple[tuple[float, int], int, Flow]] = {}  # each flow's last
        self._pushes = itertools.count()

    def update(self, flow: Flow) -> None:
        self._push(flow, self._key(flow))
        self._compact()

    def remove(self, flow: Flow) -> None:
        self._entries.pop(flow.name, None)
        self._compact()

    def pick(self) -> Flow:
        heap = self._heap
        while True:
            entry = heap[0]
            key, _, flow = entry
            if self._entries.get(flow.name) is not entry:  # a flow's older entry, or gone
                heapq.heappop(heap)
                continue
            now = self._key(flow)
            if not now > key:  # as read (smaller: the smallest still; `not`: ends on a NaN)
                return flow
            heapq.heappop(heap)  # its key grew since it was read: back in at the new one
            self._push(flow, now)

    def get(self, name: str) -> Flow | None:
        entry = self._entries.get(name)
        return entry[2] if entry is not None else None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        """The flows with a request waiting."""
        return len(self._entries)

    def _push(self, flow: Flow, key: tuple[float, int]) -> None:
        entry = (key, next(self._pushes), flow)
        self._entries[flow.name] = entry
        heapq.heappush(self._heap, entry)

    def _compact(self) -> None:
        if len(self._heap) > 2 * len(self._entries) + 64:  # mostly skipped entries: rebuild
            self._heap = list(self._entries.values())
            heapq.heapify(self._heap)


def _depth(flows: Sequence[Flow], flow: str) -> int:
    return next((len(f) for f in flows if f.name == flow), 0)


class GlobalStrict:
    """No fairness: the best head across every flow of the band, by the ordering policy's key
    (llm-d's default)."""

    type_name: ClassVar[str] = "global-strict"
    Params: ClassVar[type] = EmptyParams

    def __init__(self, name: str, params: object = None) -> None:
        self.name = name

    def index(self) -> FlowHeap:
        return FlowHeap(Flow.head_key)

    def ahead(self, flows: Sequence[Flow], flow: str) -> int:
        return sum(len(f) for f in flows)  # one order over the band: everyone already there


class RoundRobin:
    """Each flow with a request waiting takes a turn: the flow served longest ago goes next
    (never served: first), ties by the arrival of its head. The turns are the policy's, over
    every band: a flow's turn in one band counts in the others."""

    type_name: ClassVar[str] = "round-robin"
    Params: ClassVar[type] = EmptyParams

    def __init__(self, name: str, params: object = None) -> None:
        self.name = name
        self._turn = itertools.count()
        self._last: dict[str, int] = {}
        # Every band's index, to re-read the flows whose turns are forgotten (a band's index
        # goes with its band).
        self._indexes: weakref.WeakSet[_TurnHeap] = weakref.WeakSet()

    def key(self, flow: Flow) -> tuple[float, int]:
        return (self._last.get(flow.name, -1), flow.head().seq)

    def index(self) -> FlowHeap:
        index = _TurnHeap(self)
        self._indexes.add(index)
        return index

    def served(self, flow: Flow, index: FlowHeap) -> None:
        """`flow` of the band `index` takes its turn (its key grows: the heaps read it again)."""
        self._last[flow.name] = next(self._turn)
        if len(self._last) > 4 * max(16, len(index)):  # forget flows gone quiet
            forgotten = [k for k in self._last if k not in index]
            self._last = {k: v for k, v in self._last.items() if k in index}
            # A flow waiting in another band whose turn was forgotten goes sooner there now.
            for other in self._indexes:
                if other is not index:
                    for k in forgotten:
                        waiting = other.get(k)
                        if waiting is not None:
                            other.update(waiting)

    def ahead(self, flows: Sequence[Flow], flow: str) -> int:
        # Its own flow's queue, and as many turns of every other flow (those it holds).
        own = _depth(flows, flow)
        return own + sum(min(len(f), own + 1) for f in flows if f.name != flow)


class _TurnHeap(FlowHeap):
    """A band's index under `RoundRobin`: the flow it picks takes its turn."""

    def __init__(self, policy: RoundRobin) -> None:
        super().__init__(policy.key)
        self._policy = policy

    def pick(self) -> Flow:
        flow = super().pick()
        self._policy.served(flow, self)
        return flow


class TokenFair:
    """The flow whose tokens used so far are fewest goes next: the VTC counters (Sheng et al.)
    the response accounting keeps per user and shares between replicas, so a tenant sending
    5x more does not get 5x the pool. The counters only grow, but for a user they forget (the
    idle one seen least recently, past their bound): its flows must then be `update`d (the
    controller's `fairness_changed`), else they keep the place of their old count."""

    type_name: ClassVar[str] = "token"
    Params: ClassVar[type] = EmptyParams

    def __init__(self, name: str, params: object = None, *, tokens: Callable[[str], float]) -> None:
        self.name = name
        self._tokens = tokens

    def key(self, flow: Flow) -> tuple[float, int]:
        return (self._tokens(flow.name), flow.head().seq)

    def index(self) -> FlowHeap:
        return FlowHeap(self.key)

    def ahead(self, flows: Sequence[Flow], flow: str) -> int:
        # Every flow that used fewer tokens goes first, then its own queue.
        used = self._tokens(flow)
        return _depth(flows, flow) + sum(
            len(f) for f in flows if f.name != flow and self._tokens(f.name) < used
        )


PolicyFactory = Callable[[str, Any], Any]


@dataclass(frozen=True, slots=True)
class _Entry:
    params_type: type
    factory: PolicyFactory


class PolicyRegistry:
    """Policy classes by (kind, type name), registered explicitly, decoded strictly (the
    routing `PluginRegistry`'s shape, for flow control's kinds)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[PolicyKind, str], _Entry] = {}

    def register(
        self, kind: PolicyKind, cls: type, *, factory: PolicyFactory | None = None
    ) -> None:
        type_name = getattr(cls, "type_name", None)
        if not isinstance(type_name, str):
            raise TypeError(f"{cls.__name__} has no type_name")
        if (kind, type_name) in self._entries:
            raise ValueError(f"{kind} policy {type_name!r} registered twice")
        params = getattr(cls, "Params", None)
        if not is_dataclass(params) or not isinstance(params, type):
            raise TypeError(f"{cls.__name__}.Params must be a frozen dataclass")
        self._entries[(kind, type_name)] = _Entry(params, factory or cls)

    def type_names(self, kind: PolicyKind) -> list[str]:
        return sorted(name for k, name in self._entries if k == kind)

    def create(
        self,
        kind: PolicyKind,
        type_name: str,
        params: Mapping[str, object] | None = None,
        *,
        where: str | None = None,
        params_where: str | None = None,
    ) -> Any:
        """A new `kind` policy named after its type. Errors name `where` (the key that chose
        the type) and `params_where` (the key of its params)."""
        entry = self._entries.get((kind, type_name))
        if entry is None:
            at = f"{where}: " if where else ""
            known = ", ".join(self.type_names(kind))
            raise PluginConfigError(f"{at}unknown {kind} policy {type_name!r} (known: {known})")
        decoded: object = decode_params(
            entry.params_type, params, params_where or f"{kind} policy {type_name!r} params"
        )
        return entry.factory(type_name, decoded)


def builtin_policies(*, tokens: Callable[[str], float]) -> PolicyRegistry:
    """Every built-in policy; `tokens` is the VTC counters' read (tokens used per flow)."""
    reg = PolicyRegistry()
    reg.register("ordering", Fcfs)
    reg.register("ordering", Deadline)
    reg.register("fairness", GlobalStrict)
    reg.register("fairness", RoundRobin)
    reg.register(
        "fairness", TokenFair, factory=lambda name, params: TokenFair(name, params, tokens=tokens)
    )
    return reg
