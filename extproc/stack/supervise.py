"""Supervision of the local stack's children: a child that dies is reported, the rest keeps
serving, and (with `restart=True`) the child is started again after a backoff.

The supervisor owns no processes: it asks a `Children` (the `LocalStack`) which children
have exited and to respawn one. Time is injected so the backoff is tested without sleeping.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Backoff", "Children", "Event", "EventKind", "Pausable", "Supervisor", "Throttle"]


class Children(Protocol):
    def names(self) -> Sequence[str]: ...

    def exit_code(self, name: str) -> int | None:
        """None while the child runs; its exit status (negative: killed by that signal)."""
        ...

    def respawn(self, name: str) -> None: ...

    def restart_requested(self, name: str) -> bool:
        """True once if someone asked for this child to be started again (`extproc pod heal`)."""
        ...


class EventKind(enum.Enum):
    EXITED = "exited"
    RESTARTED = "restarted"
    RESTART_FAILED = "restart_failed"


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    name: str
    exit_code: int | None = None
    retry_in_s: float | None = None  # EXITED with restarts on: when the next start is due
    error: str = ""


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before restart n (1-based) is `initial_s * 2**(n-1)`, capped at `max_s`; a child
    that stayed up `stable_s` starts again from `initial_s`."""

    initial_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 30.0

    def delay(self, failures: int) -> float:
        return float(min(self.max_s, self.initial_s * 2 ** max(0, failures - 1)))


@dataclass(slots=True)
class _State:
    started_at: float
    failures: int = 0  # consecutive quick deaths
    down_since: float | None = None
    due_at: float | None = None  # next start, once it died


class Supervisor:
    def __init__(
        self,
        children: Children,
        *,
        restart: bool,
        clock: Callable[[], float],
        backoff: Backoff | None = None,
    ) -> None:
        self._children = children
        self._restart = restart
        self._clock = clock
        self._backoff = backoff or Backoff()
        now = clock()
        self._state = {name: _State(started_at=now) for name in children.names()}

    def down(self) -> list[str]:
        """The children that are dead and not (yet) started again."""
        return [n for n, s in self._state.items() if s.down_since is not None]

    def poll(self) -> list[Event]:
        """Look at every child once: report new deaths, start those that are due."""
        now = self._clock()
        events: list[Event] = []
        for name, st in self._state.items():
            requested = self._children.restart_requested(name)  # consumed even if alive
            if st.down_since is None:
                code = self._children.exit_code(name)
                if code is None:
                    if now - st.started_at >= self._backoff.stable_s:
                        st.failures = 0
                    continue
                st.down_since = now
                st.failures += 1
                retry: float | None = None
                if self._restart:
                    retry = self._backoff.delay(st.failures)
                    st.due_at = now + retry
                events.append(Event(EventKind.EXITED, name, exit_code=code, retry_in_s=retry))
            if requested or (st.due_at is not None and now >= st.due_at):
                events.append(self._start(name, st, now))
        return events

    def _start(self, name: str, st: _State, now: float) -> Event:
        try:
            self._children.respawn(name)
        except OSError as exc:  # e.g. the binary vanished: try again later
            st.failures += 1
            st.due_at = now + self._backoff.delay(st.failures) if self._restart else None
            return Event(EventKind.RESTART_FAILED, name, error=str(exc))
        st.started_at, st.down_since, st.due_at = now, None, None
        return Event(EventKind.RESTARTED, name)


class Pausable(Protocol):
    def slowed(self) -> dict[str, float]: ...

    def signal(self, name: str, sig: int) -> None: ...


class Throttle:
    """`extproc pod slow`: pause each slowed child `duty` of every `period_s` (SIGSTOP, then
    SIGCONT), like a CPU quota. Run `cycle()` in a loop on a thread of the supervisor."""

    def __init__(
        self,
        children: Pausable,
        *,
        sleep: Callable[[float], object],
        period_s: float = 0.2,
    ) -> None:
        self._children = children
        self._sleep = sleep
        self._period_s = period_s
        self._paused: set[str] = set()

    def cycle(self) -> None:
        slowed = self._children.slowed()
        for name in self._paused - set(slowed):  # healed: let it run
            self._children.signal(name, signal.SIGCONT)
        self._paused &= set(slowed)
        if not slowed:
            self._sleep(self._period_s)
            return
        # One shared pause per period: the longest duty; shorter ones resume early.
        by_duty = sorted(slowed.items(), key=lambda kv: kv[1])
        for name, _ in by_duty:
            self._children.signal(name, signal.SIGSTOP)
            self._paused.add(name)
        elapsed = 0.0
        for name, duty in by_duty:
            self._sleep(duty * self._period_s - elapsed)
            elapsed = duty * self._period_s
            self._children.signal(name, signal.SIGCONT)
        self._sleep(self._period_s - elapsed)

    def release(self) -> None:
        """Resume every paused child (before the stack stops)."""
        for name in self._paused:
            self._children.signal(name, signal.SIGCONT)
        self._paused.clear()
