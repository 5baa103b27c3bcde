"""The scoring framework: profiles of filters + weighted scorers + one picker, and plugins by type name.

A `Profile` is a `Strategy`: it runs its filters (an emptied set falls back to the unfiltered
set, and the reason says so), sums `weight * clamp(score, 0, 1)` per candidate, then lets the
picker rank every candidate best first, timing each plugin. Plugins of every kind (filter,
scorer, picker, strategy) are small classes with a `type_name`, a frozen `Params` dataclass
decoded strictly from a mapping, declared `capabilities`, and a constructor `(name, params)`.
They are registered explicitly in a `PluginRegistry` (see `extproc.routing.builtin`); a plugin
that needs more than its params (a model store, a clock) is registered with a factory closing
over it.
"""

from __future__ import annotations

import math
import random
import time
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields, is_dataclass
from types import NoneType, UnionType
from typing import Any, ClassVar, Literal, Protocol, TypeVar

import numpy as np

from extproc.routing.base import (
    NO_CAPABILITIES,
    Capabilities,
    Decision,
    Filter,
    Picker,
    PluginRef,
    PluginTiming,
    PodState,
    RoutingRequest,
    Scorer,
    ScoreValues,
    Snapshot,
)
from extproc.routing.columns import (
    FloatArray,
    IntArray,
    columns_of,
    draws,
    keeping_columns,
    rank_order,
)
from extproc.types import Endpoint

__all__ = [
    "EmptyParams",
    "MaxScorePicker",
    "Plugin",
    "PluginConfigError",
    "PluginFactory",
    "PluginKind",
    "PluginRegistry",
    "Profile",
    "ScoreTable",
    "SoftmaxPicker",
    "WeightedRandomPicker",
    "build_profile",
    "clamp01_array",
    "decode_params",
    "gumbel_order",
    "minmax_lower_better",
    "parse_weighted_header",
]

PluginKind = Literal["filter", "scorer", "picker", "strategy"]
MAX_HEADER_WEIGHT = 1_000_000.0  # AIBrix accepts integer weights in [0, 1e6]


class PluginConfigError(ValueError):
    """A profile or plugin specification is invalid; the message names the offending key."""


@dataclass(frozen=True, slots=True)
class EmptyParams:
    """Parameters of a plugin that takes none."""


P = TypeVar("P")


def _check_value(where: str, key: str, hint: object, value: object) -> object:
    """Return `value` converted to `hint` or raise naming the key path; bool is never an int here."""
    if isinstance(hint, UnionType) or typing.get_origin(hint) is typing.Union:
        args = typing.get_args(hint)
        if value is None and NoneType in args:
            return None
        inner = [a for a in args if a is not NoneType]
        if len(inner) == 1:
            return _check_value(where, key, inner[0], value)
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        result = float(value)
        if not math.isfinite(result):
            raise PluginConfigError(f"{where}.{key}: must be a finite number, got {value!r}")
        return result
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is bool and isinstance(value, bool):
        return value
    if hint is str and isinstance(value, str):
        return value
    if typing.get_origin(hint) is tuple and isinstance(value, list | tuple):
        (elem,) = typing.get_args(hint)[:1]
        return tuple(_check_value(where, key, elem, v) for v in value)
    name = getattr(hint, "__name__", str(hint))
    raise PluginConfigError(f"{where}.{key}: must be {name}, got {type(value).__name__} {value!r}")


def decode_params(params_type: type[P], raw: Mapping[str, object] | None, where: str) -> P:
    """Decode `raw` into the frozen dataclass `params_type`, strictly (unknown keys are errors).

    `where` is the key path of the params mapping (`routing.strategy_params.kv-aware`); errors
    name the key below it.
    """
    if not is_dataclass(params_type):
        raise TypeError(f"{params_type!r} is not a dataclass")
    raw = raw or {}
    if not isinstance(raw, Mapping):
        raise PluginConfigError(f"{where}: params must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(params_type)
    known = {f.name: f for f in fields(params_type)}
    for key in raw:
        if key not in known:
            allowed = ", ".join(sorted(known)) or "none"
            raise PluginConfigError(f"{where}.{key}: unknown key (allowed: {allowed})")
    values: dict[str, Any] = {}
    for name, f in known.items():
        if name in raw:
            values[name] = _check_value(where, name, hints[name], raw[name])
        elif f.default is MISSING and f.default_factory is MISSING:
            raise PluginConfigError(f"{where}.{name}: required key is missing")
    try:
        return params_type(**values)
    except ValueError as exc:  # __post_init__ range checks
        raise PluginConfigError(f"{where}: {exc}") from exc


def clamp01_array(raw: FloatArray) -> FloatArray:
    """Every value within [0, 1]; NaN and infinities (a bad metric's) are 0, so they cannot
    poison a sum. The ufuncs themselves: `np.clip`'s Python wrapper costs as much as the work."""
    out: FloatArray = np.minimum(np.maximum(raw, 0.0), 1.0)
    finite = np.isfinite(raw)
    if np.count_nonzero(finite) < len(raw):
        out[~finite] = 0.0
    return out


def minmax_lower_better(values: FloatArray) -> FloatArray:
    """GAIE queue-scorer shape: (max - v) / (max - min); all equal -> 1.0 each."""
    if not len(values):
        return values
    lo, hi = values.min(), values.max()
    if hi == lo:
        return np.ones(len(values))
    out: FloatArray = (hi - values) / (hi - lo)
    return out


# ---------------------------------------------------------------- pickers


@dataclass(frozen=True, slots=True)
class SoftmaxParams:
    temperature: float = 0.1

    def __post_init__(self) -> None:
        if self.temperature <= 0.0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


class MaxScorePicker:
    """Highest total first; equal totals are ordered at random (GAIE max-score-picker)."""

    type_name: ClassVar[str] = "max-score"
    Params: ClassVar[type] = EmptyParams
    capabilities: ClassVar[Capabilities] = NO_CAPABILITIES

    def __init__(self, name: str = "max-score", params: EmptyParams | None = None) -> None:
        self.name = name

    def rank(self, totals: FloatArray, rng: random.Random) -> IntArray:
        return rank_order([-totals], rng)


class SoftmaxPicker:
    """Samples the order from softmax(total / T) without replacement (Gumbel top-k).

    Against herding: a burst of equal-ish requests spreads instead of all landing on the
    current best pod before its load signal catches up (llm-d-router PR #2515).
    """

    type_name: ClassVar[str] = "softmax"
    Params: ClassVar[type] = SoftmaxParams
    capabilities: ClassVar[Capabilities] = NO_CAPABILITIES

    def __init__(self, name: str = "softmax", params: SoftmaxParams | None = None) -> None:
        self.name = name
        self.temperature = (params or SoftmaxParams()).temperature

    def rank(self, totals: FloatArray, rng: random.Random) -> IntArray:
        return gumbel_order(totals / self.temperature, rng)


class WeightedRandomPicker:
    """GAIE weighted-random-picker: A-Res keys U^(1/score); zero totals go last, at random."""

    type_name: ClassVar[str] = "weighted-random"
    Params: ClassVar[type] = EmptyParams
    capabilities: ClassVar[Capabilities] = NO_CAPABILITIES

    def __init__(self, name: str = "weighted-random", params: EmptyParams | None = None) -> None:
        self.name = name

    def rank(self, totals: FloatArray, rng: random.Random) -> IntArray:
        u = draws(rng, len(totals))
        positive = totals > 0
        # Zero scores after all others: keys below 0, in random order among themselves.
        keys = np.where(positive, u ** (1.0 / np.where(positive, totals, 1.0)), u - 1.0)
        return _descending(keys)


def gumbel_order(logits: FloatArray, rng: random.Random) -> IntArray:
    """Positions sampled from softmax(`logits`) without replacement (Gumbel top-k): one draw
    per position, in order; equal keys to the later position."""
    u = draws(rng, len(logits))
    if np.count_nonzero(u) < len(u):
        u[u == 0.0] = 1e-300
    return _descending(logits - np.log(-np.log(u)))


def _descending(keys: FloatArray) -> IntArray:
    """Positions by `keys`, highest first, equal keys to the later position."""
    order: IntArray = np.argsort(keys, kind="stable")[::-1]
    return order


# ---------------------------------------------------------------- profile


class ScoreTable(Mapping[str, Mapping[str, float]]):
    """Scores as `Decision.scores` (address -> {name: score}), built only when read.

    Stored by column (one array per name, the value of the pod at `addresses[at[k]]` at
    position k; `at` None: every address in order) and turned into a per-pod mapping only when
    read (explain, the status page): a decision builds no per-pod dicts.
    """

    __slots__ = ("_addresses", "_at", "_columns", "_digits", "_index", "_names")

    def __init__(
        self,
        addresses: Sequence[str],
        names: Sequence[str],
        columns: Sequence[ScoreValues],
        digits: Sequence[int | None] | None = None,
        at: IntArray | None = None,
    ) -> None:
        self._addresses = addresses
        self._names = names
        self._columns = columns
        self._digits = digits  # per column: round(value, digits) when read, None = as is
        self._at = at
        self._index: dict[str, int] | None = None

    def _keys(self) -> Sequence[str]:
        if self._at is None:
            return self._addresses
        return [self._addresses[i] for i in self._at.tolist()]

    def __getitem__(self, address: str) -> Mapping[str, float]:
        if self._index is None:
            self._index = {a: k for k, a in enumerate(self._keys())}
        i = self._index[address]
        if self._digits is None:
            return {
                name: float(col[i]) for name, col in zip(self._names, self._columns, strict=True)
            }
        return {
            name: float(col[i]) if d is None else round(float(col[i]), d)
            for name, col, d in zip(self._names, self._columns, self._digits, strict=True)
        }

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._addresses) if self._at is None else len(self._at)


def _ref(kind: str, plugin: Filter | Scorer | Picker) -> PluginRef:
    return PluginRef(kind, type(plugin).type_name, plugin.name)


class Profile:
    """Filters -> weighted scorers -> picker; itself a `Strategy`."""

    def __init__(
        self,
        name: str,
        filters: Sequence[Filter],
        scorers: Sequence[tuple[Scorer, float]],
        picker: Picker,
    ) -> None:
        for scorer, weight in scorers:
            if not math.isfinite(weight) or weight < 0:
                raise PluginConfigError(
                    f"scorer {scorer.name!r}: weight must be >= 0, got {weight}"
                )
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.picker = picker
        caps = picker.capabilities
        for flt in self.filters:
            caps |= flt.capabilities
        for scorer, _ in self.scorers:
            caps |= scorer.capabilities
        self.capabilities = caps
        # Resolved once: the per-decision loop only calls and times.
        self._filters = [(_ref("filter", f), f) for f in self.filters]
        # A scorer whose scores are in [0, 1] by construction (`bounded`) is not clamped.
        self._scorers = [
            (_ref("scorer", s), w, s, getattr(s, "bounded", False)) for s, w in self.scorers
        ]
        self._picker_ref = _ref("picker", picker)
        self._score_names = (*(ref.name for ref, _, _, _ in self._scorers), "total")
        weights = ",".join(f"{s.name}:{w:g}" for s, w in self.scorers)
        self._reason = f"profile {self.name} [{weights}] picker {picker.name}"

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        clock = time.perf_counter_ns
        timings: list[PluginTiming] = []
        notes: list[str] = []
        pods = keeping_columns(snap.pods)
        for ref, flt in self._filters:
            t0 = clock()
            kept, note = flt.filter(req, pods)
            timings.append((ref, clock() - t0))
            if note:
                notes.append(note)
            if not kept:
                notes.append(f"filter {ref.name} removed every pod; kept all {len(pods)}")
                continue
            pods = keeping_columns(kept)  # its columns built once for every scorer
        cols = columns_of(pods)
        totals, columns = self._score(req, pods, timings, notes)
        t0 = clock()
        order = self.picker.rank(totals, rng)
        timings.append((self._picker_ref, clock() - t0))
        ranked = cols.endpoints_at(order)
        if cols.n < len(snap.pods):
            ranked += self._fallbacks(snap.pods, cols.addresses, rng)
        reason = self._reason
        if notes:
            reason += "; " + "; ".join(notes)
        return Decision(
            ranked=ranked,
            strategy=self.name,
            scores=ScoreTable(cols.addresses, self._score_names, columns),
            reason=reason,
            timings=tuple(timings),
        )

    @staticmethod
    def _fallbacks(
        pods: Sequence[PodState], kept: Sequence[str], rng: random.Random
    ) -> tuple[Endpoint, ...]:
        """The pods the filters removed, least in-flight first: still valid retry fallbacks."""
        cols = columns_of(pods)
        chosen = set(kept)
        rest = np.array([i for i, a in enumerate(cols.addresses) if a not in chosen], dtype=np.intp)
        return cols.endpoints_at(rest[rank_order([cols.in_flight[rest]], rng)])

    def _score(
        self,
        req: RoutingRequest,
        pods: Sequence[PodState],
        timings: list[PluginTiming],
        notes: list[str],
    ) -> tuple[FloatArray, list[ScoreValues]]:
        """Every scorer, timed: the clamped columns, then the weighted totals (last)."""
        clock = time.perf_counter_ns
        totals: FloatArray | None = None
        columns: list[ScoreValues] = []
        for ref, weight, scorer, bounded in self._scorers:
            t0 = clock()
            scores, note = scorer.score(req, pods)
            timings.append((ref, clock() - t0))
            if note:
                notes.append(note)
            clamped = np.asarray(scores, dtype=np.float64)
            if not bounded:
                clamped = clamp01_array(clamped)
            if totals is None:
                totals = clamped * weight  # a new array: the column stays as explain reads it
            else:
                totals += clamped if weight == 1.0 else weight * clamped
            columns.append(clamped)
        assert totals is not None  # a profile has at least one scorer
        columns.append(totals)
        return totals, columns


# ---------------------------------------------------------------- plugin registry


class Plugin(Protocol):
    """What every plugin class has, whatever its kind (the kind adds one method)."""

    type_name: ClassVar[str]
    Params: ClassVar[type]
    name: str

    @property
    def capabilities(self) -> Capabilities: ...


PluginFactory = Callable[[str, Any], Any]  # (instance name, decoded Params) -> plugin


@dataclass(frozen=True, slots=True)
class _Entry:
    params_type: type
    factory: PluginFactory


class PluginRegistry:
    """Plugin classes by (kind, type name) and aliases, registered explicitly, decoded strictly."""

    def __init__(self) -> None:
        self._entries: dict[tuple[PluginKind, str], _Entry] = {}
        self._aliases: dict[tuple[PluginKind, str], str] = {}

    def register(
        self,
        kind: PluginKind,
        cls: type[Plugin],
        *aliases: str,
        factory: PluginFactory | None = None,
    ) -> None:
        """Register `cls` under its `type_name` (and `aliases`).

        Instances are made by `factory(name, params)`, by default `cls(name, params)`: pass a
        factory to inject what the params cannot carry (a shared model store, a clock).
        """
        type_name = cls.type_name
        for key in (type_name, *aliases):
            if (kind, key) in self._entries or (kind, key) in self._aliases:
                raise ValueError(f"{kind} type {key!r} registered twice")
        if not is_dataclass(cls.Params):
            raise TypeError(f"{cls.__name__}.Params must be a frozen dataclass")
        self._entries[(kind, type_name)] = _Entry(cls.Params, factory or cls)
        for alias in aliases:
            self._aliases[(kind, alias)] = type_name

    def type_names(self, kind: PluginKind) -> list[str]:
        return sorted(name for k, name in self._entries if k == kind)

    def canonical(self, kind: PluginKind, type_name: str) -> str:
        return self._aliases.get((kind, type_name), type_name)

    def params_type(self, kind: PluginKind, type_name: str) -> type:
        return self._entry(kind, type_name, None).params_type

    def _entry(self, kind: PluginKind, type_name: str, where: str | None) -> _Entry:
        entry = self._entries.get((kind, self.canonical(kind, type_name)))
        if entry is None:
            at = f"{where}.type: " if where else ""
            known = ", ".join(self.type_names(kind))
            raise PluginConfigError(f"{at}unknown {kind} {type_name!r} (known: {known})")
        return entry

    def create(
        self,
        kind: PluginKind,
        type_name: str,
        params: Mapping[str, object] | None = None,
        name: str | None = None,
        *,
        where: str | None = None,
        params_where: str | None = None,
    ) -> Any:
        """A new `kind` plugin. For errors: `where` is the key path of its config item (with
        `type` and `params` keys), `params_where` that of its params when they sit elsewhere."""
        entry = self._entry(kind, type_name, where)
        at = params_where or (f"{where}.params" if where else f"{kind} {type_name!r} params")
        decoded: object = decode_params(entry.params_type, params, at)
        return entry.factory(name or self.canonical(kind, type_name), decoded)


def _require_mapping(value: object, where: str) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise PluginConfigError(f"{where}: must be a mapping, got {type(value).__name__}")
    return value


def _require_list(value: object, where: str) -> list[object]:
    if not isinstance(value, list | tuple):
        raise PluginConfigError(f"{where}: must be a list, got {type(value).__name__}")
    return list(value)


def _plugin_fields(
    item: Mapping[str, object], where: str, allowed: set[str]
) -> tuple[str, Mapping[str, object] | None, str | None]:
    for key in item:
        if key not in allowed:
            raise PluginConfigError(
                f"{where}.{key}: unknown key (allowed: {', '.join(sorted(allowed))})"
            )
    type_name = item.get("type")
    if not isinstance(type_name, str) or not type_name:
        raise PluginConfigError(f"{where}.type: must be a non-empty string")
    params = item.get("params")
    if params is not None:
        params = _require_mapping(params, f"{where}.params")
    name = item.get("name")
    if name is not None and not isinstance(name, str):
        raise PluginConfigError(f"{where}.name: must be a string")
    return type_name, params, name


def build_profile(
    name: str, spec: Mapping[str, object], plugins: PluginRegistry, where: str | None = None
) -> Profile:
    """Build a profile from `{filters: [{type, params}], scorers: [{type, weight, params}], picker}`.

    `where` is the key path of `spec` in the config (default `profiles.<name>`); every error
    names the offending key below it.
    """
    where = where or f"profiles.{name}"
    spec = _require_mapping(spec, where)
    for key in spec:
        if key not in ("filters", "scorers", "picker"):
            raise PluginConfigError(
                f"{where}.{key}: unknown key (allowed: filters, picker, scorers)"
            )
    filters: list[Filter] = []
    for i, raw in enumerate(_require_list(spec.get("filters", []), f"{where}.filters")):
        at = f"{where}.filters[{i}]"
        t, params, n = _plugin_fields(_require_mapping(raw, at), at, {"type", "params", "name"})
        filters.append(plugins.create("filter", t, params, n, where=at))
    scorers: list[tuple[Scorer, float]] = []
    raw_scorers = _require_list(spec.get("scorers", []), f"{where}.scorers")
    if not raw_scorers:
        raise PluginConfigError(f"{where}.scorers: must list at least one scorer")
    for i, raw in enumerate(raw_scorers):
        at = f"{where}.scorers[{i}]"
        item = _require_mapping(raw, at)
        t, params, n = _plugin_fields(item, at, {"type", "params", "name", "weight"})
        weight = _check_value(at, "weight", float, item.get("weight", 1.0))
        assert isinstance(weight, float)
        if weight < 0:
            raise PluginConfigError(f"{at}.weight: must be >= 0, got {weight}")
        scorers.append((plugins.create("scorer", t, params, n, where=at), weight))
    picker: Picker = MaxScorePicker()
    if "picker" in spec:
        at = f"{where}.picker"
        t, params, n = _plugin_fields(
            _require_mapping(spec["picker"], at), at, {"type", "params", "name"}
        )
        picker = plugins.create("picker", t, params, n, where=at)
    return Profile(name, filters, scorers, picker)


def parse_weighted_header(value: str, plugins: PluginRegistry) -> Profile:
    """Build an ad hoc profile from AIBrix-style `"prefix-cache:3,least-request:1"`.

    A missing weight means 1 and weight 0 drops the scorer (AIBrix multi-strategy rules).
    """
    scorers: list[tuple[Scorer, float]] = []
    seen: set[str] = set()
    for part in value.split(","):
        part = part.strip()
        if not part:
            raise PluginConfigError(f"empty item in routing spec {value!r}")
        type_name, sep, weight_text = part.partition(":")
        type_name = type_name.strip()
        weight = 1.0
        if sep:
            try:
                weight = float(weight_text.strip())
            except ValueError:
                raise PluginConfigError(
                    f"weight of {type_name!r} is not a number: {weight_text!r}"
                ) from None
            if not (0.0 <= weight <= MAX_HEADER_WEIGHT):
                raise PluginConfigError(
                    f"weight of {type_name!r} must be in [0, 1000000], got {weight_text!r}"
                )
        canonical = plugins.canonical("scorer", type_name)
        if canonical in seen:
            raise PluginConfigError(f"scorer {type_name!r} listed twice in {value!r}")
        seen.add(canonical)
        scorer = plugins.create("scorer", type_name)
        if weight > 0:
            scorers.append((scorer, weight))
    if not scorers:
        raise PluginConfigError(f"routing spec {value!r} has no scorer with a weight above 0")
    return Profile(value.replace(" ", ""), [], scorers, MaxScorePicker())
