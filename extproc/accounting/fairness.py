"""Virtual Token Counters (VTC, Sheng et al., OSDI '24) per user.

Each user's counter grows by `input_weight` per prompt token and `output_weight` per
generated token (1 and 2 by default, the paper's prices). When a user goes from no
request in flight to one, its counter is lifted to the smallest counter among the other
active users, so an idle user cannot bank credit and then monopolise the pods.

The number of users kept is bounded: the least recently seen idle user is forgotten
first. Forgetting is safe because a returning user is lifted to the active minimum anyway.
"""

from __future__ import annotations

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
        self._users: OrderedDict[str, _User] = OrderedDict()
        self._active: dict[str, _User] = {}  # users with requests in flight
        # Called with every charge made here (user, weighted tokens): replica sync's outbox.
        self.on_charge: Callable[[str, float], None] | None = None

    def __len__(self) -> int:
        return len(self._users)

    def tokens(self, user: str) -> float:
        u = self._users.get(user)
        return u.tokens if u is not None else 0.0

    def active_min(self) -> float:
        """Smallest counter among users with requests in flight (0 when none are)."""
        if not self._active:
            return 0.0
        return min(u.tokens for u in self._active.values())

    def is_active(self, user: str) -> bool:
        return user in self._active

    def request_started(self, user: str, input_tokens: int = 0) -> None:
        """A request of `user` was admitted; charges its prompt tokens."""
        u = self._users.get(user)
        if u is None:
            self._make_room()
            u = self._users[user] = _User()
        else:
            self._users.move_to_end(user)
        if u.active == 0:
            if self._active:  # counter lift for a returning user
                u.tokens = max(u.tokens, self.active_min())
            self._active[user] = u
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

    def _add(self, user: str, u: _User, tokens: float) -> None:
        if tokens:
            u.tokens += tokens
            if self.on_charge is not None:
                self.on_charge(user, tokens)

    def add_remote(self, user: str, tokens: float) -> None:
        """Weighted tokens another replica charged `user` (not passed to `on_charge` again)."""
        self._known(user).tokens += max(0.0, tokens)

    def _known(self, user: str) -> _User:
        """The user's counter; a new one starts at the active minimum (no banked credit)."""
        u = self._users.get(user)
        if u is None:
            self._make_room()
            u = self._users[user] = _User(tokens=self.active_min())
        return u

    def _make_room(self) -> None:
        """Forget least recently seen idle users until one more fits."""
        if len(self._users) < self._max_users:
            return
        for name, u in list(self._users.items()):
            if u.active == 0:
                del self._users[name]
                if len(self._users) < self._max_users:
                    return
        # Every remaining user is active: allow the overshoot rather than corrupt counts.
