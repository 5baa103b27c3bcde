"""Virtual Token Counters (VTC, Sheng et al., OSDI '24) per user.

Each user's counter grows by `input_weight` per prompt token and `output_weight` per
generated token (1 and 2 by default, the paper's prices). When a user goes from no
request in flight to one, its counter is lifted to the smallest counter among the other
active users, so an idle user cannot bank credit and then monopolise the pods.

The number of users kept is bounded: the idle user seen least recently is forgotten first.
Forgetting is safe because a returning user is lifted to the active minimum anyway. What a new
user costs does not grow with how many are known: idle users wait in their own LRU order (the
oldest goes in O(1)), and the active minimum is the top of a heap (counters only grow, so an
entry below its user's counter is refreshed when it comes to the top).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["FairnessCounters"]


@dataclass(slots=True)
class _User:
    tokens: float = 0.0
    active: int = 0


class FairnessCounters:
    """Implements `extproc.routing.base.FairnessView` (tokens, active_min)."""

    def __init__(
        self, *, input_weight: float = 1.0, output_weight: float = 2.0, max_users: int = 10_000
    ) -> None:
        if input_weight < 0 or output_weight < 0 or max_users <= 0:
            raise ValueError("weights must be >= 0 and max_users positive")
        self._w_in = input_weight
        self._w_out = output_weight
        self._max_users = max_users
        self._users: dict[str, _User] = {}  # every user known
        self._idle: OrderedDict[str, None] = OrderedDict()  # idle users, least recently seen first
        self._active: dict[str, _User] = {}  # users with requests in flight
        # (counter when pushed, user) for active users: the smallest valid one is the minimum.
        self._heap: list[tuple[float, str]] = []
        # Called with every charge made here (user, weighted tokens): replica sync's outbox.
        self.on_charge: Callable[[str, float], None] | None = None
        # Called with each user forgotten (its counter reads 0 from now on, the one way a
        # counter shrinks): flow control's token fairness re-reads that user's flows.
        self.on_forget: Callable[[str], None] | None = None

    def __len__(self) -> int:
        return len(self._users)

    def tokens(self, user: str) -> float:
        u = self._users.get(user)
        return u.tokens if u is not None else 0.0

    def active_min(self) -> float:
        """Smallest counter among users with requests in flight (0 when none are)."""
        heap, active = self._heap, self._active
        while heap:
            tokens, name = heap[0]
            u = active.get(name)
            if u is None:  # idle now (or forgotten): its entry goes
                heapq.heappop(heap)
            elif u.tokens != tokens:  # charged since: its entry moves down to its counter
                heapq.heapreplace(heap, (u.tokens, name))
            else:
                return tokens
        return 0.0

    def is_active(self, user: str) -> bool:
        return user in self._active

    def request_started(self, user: str, input_tokens: int = 0) -> None:
        """A request of `user` was admitted; charges its prompt tokens."""
        u = self._users.get(user)
        if u is None:
            self._make_room()
            u = self._users[user] = _User()
        if u.active == 0:
            self._idle.pop(user, None)
            if self._active:  # counter lift for a returning user
                u.tokens = max(u.tokens, self.active_min())
            self._active[user] = u
            heapq.heappush(self._heap, (u.tokens, user))
            if len(self._heap) > 2 * len(self._active) + 64:  # mostly stale: rebuild
                self._heap = [(a.tokens, name) for name, a in self._active.items()]
                heapq.heapify(self._heap)
        u.active += 1
        self._add(user, u, self._w_in * max(0, input_tokens))

    def charge(self, user: str, *, input_tokens: int = 0, output_tokens: int = 0) -> None:
        """Add tokens to a user's counter (e.g. the output tokens counted at end of stream)."""
        u = self._known(user)
        self._add(user, u, self._w_in * max(0, input_tokens) + self._w_out * max(0, output_tokens))

    def request_finished(self, user: str, output_tokens: int = 0) -> None:
        """A request of `user` ended; charges its output tokens. Pair with request_started."""
        u = self._users.get(user)
        if u is None:
            return
        self._add(user, u, self._w_out * max(0, output_tokens))
        if u.active > 0:
            u.active -= 1
            if u.active == 0:
                self._active.pop(user, None)
                self._idle[user] = None  # (its heap entry goes when it comes to the top)

    def _add(self, user: str, u: _User, tokens: float) -> None:
        if tokens:
            u.tokens += tokens
            if self.on_charge is not None:
                self.on_charge(user, tokens)

    def add_remote(self, user: str, tokens: float) -> None:
        """Weighted tokens another replica charged `user` (not passed to `on_charge` again)."""
        self._known(user).tokens += max(0.0, tokens)

    def _known(self, user: str) -> _User:
        """The user's counter, seen now; a new one starts at the active minimum (no banked
        credit)."""
        u = self._users.get(user)
        if u is None:
            self._make_room()
            u = self._users[user] = _User(tokens=self.active_min())
            self._idle[user] = None
        elif u.active == 0:
            self._idle.move_to_end(user)
        return u

    def _make_room(self) -> None:
        """Forget the idle user seen least recently, when full. With every user active the
        count overshoots rather than a counter being lost."""
        if len(self._users) >= self._max_users and self._idle:
            name, _ = self._idle.popitem(last=False)
            del self._users[name]
            if self.on_forget is not None:
                self.on_forget(name)
