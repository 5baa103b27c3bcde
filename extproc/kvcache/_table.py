"""Block hash -> bitmask of the pods holding it: the shared core of both prefix indexes.

One int per block instead of one set per block keeps memory low, and a longest-prefix
lookup is a single pass of `&` over the request's blocks that stops as soon as no pod
still matches. `match_lengths` answers the same pass as an array over many pods (the pods
that leave the match at one block are one bitmask, unpacked by numpy), and `counts` keeps
each slot's entry count as an array, so a snapshot of hundreds of pods reads both without
a Python step per pod.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat
from operator import and_, or_
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = ["IntArray", "PodBitmaskTable", "PodBlocks"]

IntArray = npt.NDArray[np.int64]


class PodBlocks(NamedTuple):
    """Per pod of a lookup, in the order asked: leading request blocks held, blocks held."""

    matched: IntArray
    held: IntArray


class PodBitmaskTable:
    """Maps block hash -> int bitmask; each pod owns one bit (slots reused after release)."""

    def __init__(self) -> None:
        self.masks: dict[int, int] = {}
        self._bit_of: dict[str, int] = {}  # pod -> its bit value (1 << slot)
        self._slot_of: dict[str, int] = {}  # pod -> its slot
        self._pod_of_slot: list[str | None] = []
        self._free_slots: list[int] = []
        # Per slot: how many entries its pod holds (the owner sets it), one spare 0 at the end
        # that `slots` gives to unknown pods.
        self._counts: IntArray = np.zeros(8, dtype=np.int64)
        # The last `slots` answer: a model's candidates are mostly the same list request after
        # request, and comparing two lists of the same strings is cheaper than a dict pass.
        self._last_slots: tuple[list[str], IntArray] | None = None

    def bit(self, pod: str) -> int:
        """The pod's bit, allocating a slot on first use."""
        bit = self._bit_of.get(pod)
        if bit is None:
            if self._free_slots:
                slot = self._free_slots.pop()
                self._pod_of_slot[slot] = pod
            else:
                slot = len(self._pod_of_slot)
                self._pod_of_slot.append(pod)
                if slot + 1 >= len(self._counts):
                    self._counts = np.concatenate((self._counts, np.zeros_like(self._counts)))
            bit = 1 << slot
            self._bit_of[pod] = bit
            self._slot_of[pod] = slot
            self._last_slots = None
        return bit

    def existing_bit(self, pod: str) -> int:
        """The pod's bit, or 0 when it has none."""
        return self._bit_of.get(pod, 0)

    def release(self, pod: str) -> None:
        """Free the pod's slot. Its blocks must already be cleared (see `discard`)."""
        bit = self._bit_of.pop(pod, 0)
        if bit:
            slot = self._slot_of.pop(pod)
            self._last_slots = None
            self._pod_of_slot[slot] = None
            self._counts[slot] = 0
            self._free_slots.append(slot)

    def set_count(self, bit: int, count: int) -> None:
        """Record how many entries the pod with `bit` holds (read back by `counts`)."""
        self._counts[bit.bit_length() - 1] = count

    def slots(self, pods: Sequence[str]) -> IntArray:
        """Each pod's slot, in order; a pod without one gets the spare slot (never matches,
        count 0)."""
        last = self._last_slots
        if last is not None and last[0] == pods:
            return last[1]
        spare = len(self._pod_of_slot)
        slots = np.fromiter(map(self._slot_of.get, pods, repeat(spare)), np.int64, len(pods))
        slots.flags.writeable = False  # shared by the calls that ask for the same pods
        self._last_slots = (list(pods), slots)
        return slots

    def counts(self, slots: IntArray) -> IntArray:
        """The entry count of each slot in `slots` (0 for the spare)."""
        out: IntArray = self._counts[slots]
        return out

    def pods(self) -> list[str]:
        return list(self._bit_of)

    def add(self, bit: int, block: int) -> bool:
        """Mark `block` as held by the pod with `bit`; True when it was not held before."""
        masks = self.masks
        old = masks.get(block, 0)
        if old & bit:
            return False
        masks[block] = old | bit
        return True

    def add_new(self, bit: int, blocks: Sequence[int]) -> bool:
        """Mark distinct `blocks`, none held by the pod with `bit` yet, in one pass; False,
        marking nothing, when one is held already or one repeats."""
        masks = self.masks
        olds = list(map(masks.get, blocks, repeat(0)))
        if any(map(and_, olds, repeat(bit))) or len(set(blocks)) != len(blocks):
            return False
        masks.update(zip(blocks, map(or_, olds, repeat(bit)), strict=True))
        return True

    def discard_all(self, bit: int, blocks: Iterable[int]) -> None:
        """`discard` every block of `blocks`, in one pass: each is taken out, and the blocks
        other pods hold too go back with their bits (a block listed twice comes out once)."""
        masks = self.masks
        blocks = list(blocks)
        olds = list(map(masks.pop, blocks, repeat(0)))
        others = ~bit
        if any(map(and_, olds, repeat(others))):
            for block, old in zip(blocks, olds, strict=True):
                if old & others:
                    masks[block] = old & others

    def discard(self, bit: int, block: int) -> bool:
        """Unmark; True when the pod held the block."""
        masks = self.masks
        old = masks.get(block, 0)
        if not old & bit:
            return False
        new = old & ~bit
        if new:
            masks[block] = new
        else:
            del masks[block]
        return True

    def mask_of(self, pods: Iterable[str]) -> int:
        bit_of = self._bit_of
        mask = 0
        for pod in pods:
            mask |= bit_of.get(pod, 0)
        return mask

    def longest_prefix(self, blocks: Sequence[int], restrict: int = -1) -> dict[str, int]:
        """Pod -> number of leading `blocks` it holds (pods with 0 are left out).

        One pass: `active` is the set of pods matching every block so far; pods leave it
        at the block they miss, and the loop ends when it is empty. `restrict` is a
        bitmask of the pods of interest (all by default).
        """
        result: dict[str, int] = {}
        masks = self.masks
        active = restrict
        matched = 0
        for block in blocks:
            still = active & masks.get(block, 0)
            if still != active:
                if matched:
                    self._record(active & ~still, matched, result)
                if not still:
                    return result
                active = still
            matched += 1
        if matched and active:
            self._record(active, matched, result)
        return result

    def lookup(self, blocks: Sequence[int], pods: Sequence[str]) -> PodBlocks:
        """Per pod in `pods`: how many leading `blocks` it holds, and its entry count."""
        slots = self.slots(pods)
        return PodBlocks(self.match_lengths(blocks, slots), self.counts(slots))

    def match_lengths(self, blocks: Sequence[int], slots: IntArray) -> IntArray:
        """Per slot in `slots` (see `slots`), the number of leading `blocks` its pod holds.

        The pass of `longest_prefix` over every slot; the pods leaving the match at each step
        are kept as bitmasks and unpacked into one array at the end (few distinct lengths).
        """
        nslots = len(self._pod_of_slot)
        out = np.zeros(nslots + 1, dtype=np.int64)  # + the spare slot of unknown pods
        if not nslots or not blocks:
            return out[slots]
        get = self.masks.get
        active = (1 << nslots) - 1
        left: list[int] = []  # bitmasks of the pods leaving the match...
        at: list[int] = []  # ...and how many blocks they matched
        for matched, block in enumerate(blocks):
            still = active & get(block, 0)
            if still != active:
                if matched:
                    left.append(active & ~still)
                    at.append(matched)
                if not still:
                    break
                active = still
        else:  # some pods hold every block
            left.append(active)
            at.append(len(blocks))
        if left:
            width = (nslots + 7) // 8
            packed = b"".join(m.to_bytes(width, "little") for m in left)
            bits = np.unpackbits(
                np.frombuffer(packed, np.uint8).reshape(len(left), width),
                axis=1,
                count=nslots,
                bitorder="little",
            )
            out[:nslots] = np.asarray(at, dtype=np.int64) @ bits  # a pod leaves once
        result: IntArray = out[slots]
        return result

    def _record(self, mask: int, matched: int, result: dict[str, int]) -> None:
        names = self._pod_of_slot
        while mask:
            low = mask & -mask
            slot = low.bit_length() - 1
            mask ^= low
            # restrict=-1 has bits for slots never allocated; only real pods are reported.
            if slot < len(names):
                name = names[slot]
                if name is not None:
                    result[name] = matched
            else:
                return
