"""The reuse ceiling of a workload: what an oracle router could reach in prefix-cache hits.

A rule's hit rate (cached prompt tokens / prompt tokens, from the engines' `usage`) means little
alone: 0.5 is poor where 0.8 was possible and perfect where 0.5 was. This module computes, from
the prompts a run actually sent (tokenized as the engine tokenizes them), two ceilings:

- `seen`: the share of prompt tokens whose prefix was seen before, block-granular as the
  engines cache (a prompt's block counts only if every block before it did too, and at most
  `(prompt_tokens - 1) // block_size` blocks count: the last token is always recomputed, as in
  vLLM and our simulator). "Seen" means stored by an earlier request: its prompt's full blocks
  and the full blocks of prompt + answer (engines cache the blocks decode fills too, which is
  what a multi-turn history hits). An unbounded cache on one pod reaches exactly this.
- `capacity`: the same share when the caches are the pool's real ones: `pods` caches of
  `capacity_blocks` blocks, least recently used block evicted first. The best of two
  placements: every group of requests (a conversation, a tenant, a document, a customer,
  given by the workload) on one pod, groups partitioned across the pods offline by their
  prompt tokens (longest-processing-time first, so the oracle knows the whole future), and one
  LRU cache of all the pool's blocks (no pod boundary: what a perfect partition approaches).

Both ignore load and timing (a request's blocks are cached the moment it arrives): they bound
what placement can do, not what latency allows. Pure functions over token ids; the bench
tokenizes (`requests_from_records`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Ceiling",
    "CeilingRequest",
    "ChatEncoder",
    "block_chain",
    "partition_groups",
    "requests_from_records",
    "reuse_ceiling",
]


def block_chain(tokens: Sequence[int], block_size: int) -> list[int]:
    """One hash per full block, each over its parent's hash and its own tokens (a prefix
    chain: two sequences share the first k hashes iff they share the first k blocks)."""
    out: list[int] = []
    parent = 0
    for k in range(len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[k * block_size : (k + 1) * block_size])))
        out.append(parent)
    return out


@dataclass(frozen=True, slots=True)
class CeilingRequest:
    """One request, in arrival order: its prompt's block chain, what it leaves cached, its group."""

    prompt_tokens: int
    lookup: tuple[int, ...]  # the prompt blocks that can hit: the first (prompt_tokens - 1) // bs
    stored: tuple[int, ...]  # the full blocks cached after it: prompt + answer
    group: str

    @classmethod
    def of(
        cls, prompt: Sequence[int], answer: Sequence[int], group: str, block_size: int
    ) -> CeilingRequest:
        chain = block_chain(list(prompt) + list(answer), block_size)
        hit_blocks = max(0, len(prompt) - 1) // block_size
        return cls(len(prompt), tuple(chain[:hit_blocks]), tuple(chain), group)


@dataclass(frozen=True, slots=True)
class Ceiling:
    seen: float  # unbounded cache: share of prompt tokens whose prefix was stored before
    capacity: float  # best placement under the pool's caches (max of the two below)
    partitioned: float  # groups partitioned across pods, LRU per pod
    pooled: float  # one LRU of every pod's blocks
    requests: int
    prompt_tokens: int

    def as_dict(self) -> dict[str, float | int]:
        return {
            "ceiling_seen": round(self.seen, 4),
            "ceiling_capacity": round(self.capacity, 4),
            "ceiling_partitioned": round(self.partitioned, 4),
            "ceiling_pooled": round(self.pooled, 4),
            "ceiling_requests": self.requests,
        }


class _Lru:
    """A block cache of `capacity` blocks, least recently used evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def leading(self, chain: Sequence[int]) -> int:
        n = 0
        for h in chain:
            if h not in self._blocks:
                break
            n += 1
        return n

    def store(self, chain: Sequence[int]) -> None:
        blocks = self._blocks
        for h in chain[-self.capacity :] if self.capacity else ():
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)


def _hit_share(
    reqs: Sequence[CeilingRequest], block_size: int, cache_of: Callable[[int], _Lru]
) -> float:
    total = sum(r.prompt_tokens for r in reqs)
    if not total:
        return 0.0
    hit = 0
    for i, r in enumerate(reqs):
        cache = cache_of(i)
        hit += cache.leading(r.lookup) * block_size
        cache.store(r.stored)
    return hit / total


def _seen(reqs: Sequence[CeilingRequest], block_size: int) -> float:
    total = sum(r.prompt_tokens for r in reqs)
    if not total:
        return 0.0
    seen: set[int] = set()
    hit = 0
    for r in reqs:
        n = 0
        for h in r.lookup:
            if h not in seen:
                break
            n += 1
        hit += n * block_size
        seen.update(r.stored)
    return hit / total


def partition_groups(reqs: Sequence[CeilingRequest], pods: int) -> dict[str, int]:
    """Groups onto pods, largest first onto the pod with the fewest prompt tokens so far."""
    size: dict[str, int] = {}
    for r in reqs:
        size[r.group] = size.get(r.group, 0) + r.prompt_tokens
    load = [0] * pods
    out: dict[str, int] = {}
    for g in sorted(size, key=lambda g: (-size[g], g)):
        p = min(range(pods), key=lambda k: (load[k], k))
        out[g] = p
        load[p] += size[g]
    return out


def reuse_ceiling(
    reqs: Sequence[CeilingRequest], *, capacity_blocks: Sequence[int], block_size: int
) -> Ceiling:
    """Both ceilings for requests in arrival order on pods with these cache sizes (blocks)."""
    if not capacity_blocks or block_size <= 0:
        raise ValueError("need at least one pod and a positive block size")
    where = partition_groups(reqs, len(capacity_blocks))
    per_pod = [_Lru(c) for c in capacity_blocks]
    partitioned = _hit_share(reqs, block_size, lambda i: per_pod[where[reqs[i].group]])
    pool = _Lru(sum(capacity_blocks))
    pooled = _hit_share(reqs, block_size, lambda i: pool)
    return Ceiling(
        seen=_seen(reqs, block_size),
        capacity=max(partitioned, pooled),
        partitioned=partitioned,
        pooled=pooled,
        requests=len(reqs),
        prompt_tokens=sum(r.prompt_tokens for r in reqs),
    )


class ChatEncoder:
    """What the simulators tokenize: the chat template over the messages, and an answer's
    text (the simulator's output words are one token each, so re-encoding gives its ids)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def prompt(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        return list(self._tok.encode_chat(list(messages), add_generation_prompt=True))

    def answer(self, text: str) -> list[int]:
        return list(self._tok.encode_text(text)) if text else []


def requests_from_records(
    records: Iterable[Any],
    encoder: ChatEncoder,
    *,
    group_of: Callable[[str], str],
    block_size: int,
) -> list[CeilingRequest]:
    """Ceiling inputs from a run's successful request records (`bench.loadgen.RequestRecord`
    with `messages` and `reply`), in the order they were sent."""
    ok = sorted((r for r in records if r.ok and r.messages), key=lambda r: r.start_s)
    return [
        CeilingRequest.of(
            encoder.prompt(r.messages),
            encoder.answer(r.reply or ""),
            group_of(r.conversation_id),
            block_size,
        )
        for r in ok
    ]
